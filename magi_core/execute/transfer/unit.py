"""One copy per unit: each copy batch in a fixed place of one device buffer planned for the step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from magi_core.execute.actions import StepActions, batch_lifetimes
from magi_core.execute.transfer.base import PerTensorTransfer
from magi_core.execute.transfer.shared import SharedBuffer
from magi_core.plan.packing import Packing, pack
from magi_core.plugin.facade import Backend
from magi_core.plugin.registered import RegisteredRanges

logger = logging.getLogger(__name__)


#: A batch is copied as one span when the span is at most this much larger than its weights (alignment gaps).
SPAN_SLACK = 1.125


class _Span:
    """How one batch of host weights is copied as one byte span of their shared storage."""

    __slots__ = ("host", "layout")

    def __init__(self, host: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]):
        self.host = host  # uint8 view of the span in the host storage
        self.layout = layout  # per weight: dtype, size, stride, element offset from the span start


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def plan_span(hosts: Sequence[torch.Tensor], slack: float = SPAN_SLACK,
              registered: RegisteredRanges | None = None) -> _Span | None:
    """The span that holds every weight of ``hosts`` in one host storage, or None when they cannot share one.

    They share one when all are host tensors of one storage, every weight starts at a multiple of its element
    size from the span start, the span is at most ``slack`` times their bytes (plus a page), and no bound of a
    ``registered`` host range lies inside it (a runtime refuses one copy from two registrations).
    """
    if len(hosts) < 2 or any(h.device.type != "cpu" or h.numel() == 0 for h in hosts):
        return None
    storage = hosts[0].untyped_storage()
    sptr = storage.data_ptr()
    if any(h.untyped_storage().data_ptr() != sptr for h in hosts):
        return None
    lo = min(h.data_ptr() for h in hosts)
    hi = max(h.data_ptr() + _extent(h) for h in hosts)
    if hi - lo > slack * sum(_extent(h) for h in hosts) + 4096:
        return None
    if registered is not None and registered.crossed(lo, hi):
        return None
    layout = []
    for h in hosts:
        off = h.data_ptr() - lo
        if off % h.element_size():
            return None
        layout.append((h.dtype, tuple(h.shape), tuple(h.stride()), off // h.element_size()))
    span = torch.empty(0, dtype=torch.uint8).set_(storage, lo - sptr, (hi - lo,))  # type: ignore[call-overload]
    return _Span(span, layout)



#: Byte alignment of each weight inside its batch's place in the device buffer (that of the host arena's slots).
WEIGHT_ALIGNMENT = 256
#: Byte alignment of each batch's place in the device buffer.
BATCH_ALIGNMENT = 512


def align_up(n: int, a: int = WEIGHT_ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


class _Slot:
    """One copy batch's fixed place in the device buffer, and how its weights are copied into it."""

    __slots__ = ("offset", "size", "shares", "gate", "key", "views", "copies", "live", "event")

    def __init__(self, offset: int, size: int, shares: tuple[int, ...], gate: bool) -> None:
        self.offset = offset
        self.size = size
        self.shares = shares  # batches whose bytes overlap this one's (never alive at the same time)
        self.gate = gate  # issued at step start, before any executor gate: order it after the compute stream
        # the registrations' version and the host tensors the views below were made for
        self.key: tuple[Any, ...] | None = None
        self.views: tuple[torch.Tensor, ...] = ()
        self.copies: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (device bytes, host bytes) per copy
        self.live = 0  # fetched weights not yet released
        self.event: Any = None  # recorded after the batch's last copy


class UnitTransfer(PerTensorTransfer):
    """One copy per batch (a unit's streamed weights) into a fixed place of one device buffer; views made once.

    :meth:`set_actions` places every copy batch of the plan in one device buffer (:func:`~magi_core.plan.packing.
    pack`: batches alive at the same time never share bytes) and allocates it. A batch whose host weights lie
    in one tight span of one host storage (the host arena lays a unit's weights out together) is one copy;
    weights of several storages (dtypes) are one copy per storage, loose ones one copy each, all into the
    batch's place; the device views are made at the first fetch and reused while the host tensors stay the
    same. No allocator call and no ``record_stream`` per step: a batch's bytes are rewritten only by a batch
    whose lifetime starts after this one's last use, and every copy is ordered after the compute work queued
    before it (the executor gates the copy stream before a unit's copies; batches issued at step start are
    gated here). A fetch that finds its place still in use (a bug, or a step that failed half way) falls back
    to allocating, counted in :attr:`fallbacks`.
    """

    #: Whether the model's other runtimes may place their batches in this transfer's buffer (:meth:`share`).
    shareable = True

    def __init__(self, backend: Backend, device: torch.device) -> None:
        super().__init__(backend, device)
        self._current_stream = backend.device_module.current_stream
        self._registered = backend.registered
        self._buffer: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._slots: list[_Slot] = []
        self._owner: dict[int, _Slot] = {}  # id(view) -> its batch's slot
        self._gate_event = self._event()
        self.allocates = False  # the plan's buffer is fixed: the host may enqueue a whole step ahead
        #: Bytes of the device buffer of the installed plan.
        self.buffer_bytes = 0
        #: Fetches that could not use their place and allocated instead.
        self.fallbacks = 0
        #: The buffer shared with the model's other runtimes on this device (:meth:`share`), or None: its own.
        self.shared: SharedBuffer | None = None
        #: The compute stream of the last step begun (a runtime taking the shared buffer over waits for it).
        self.last_compute: Any = None
        #: Called when the shared buffer is replaced: whoever keeps views of it across steps (the executor's
        #: carried copies) drops them, so the old buffer's memory is free before the new one is made.
        self.on_forget: Callable[[], None] | None = None

    def buffer_need(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> int:
        """Bytes of the device buffer :meth:`set_actions` would place these batches in (nothing is allocated)."""
        return self._packing(actions, sizes)[1].total

    def _packing(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> tuple[list[int], Packing]:
        slot_bytes = [self._place_bytes(ws) for ws in sizes]
        return slot_bytes, pack(slot_bytes, batch_lifetimes(actions), BATCH_ALIGNMENT)

    def set_actions(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> None:
        """Place ``actions``' copy batches (``sizes``: bytes of each batch's weights) in a new device buffer."""
        self._drop_buffer()
        slot_bytes, packing = self._packing(actions, sizes)
        carried = set(actions.carry)
        at_start = {b for b in actions.start if b not in carried}
        self._slots = [
            _Slot(packing.offsets[b], slot_bytes[b], packing.shares_with[b], b in at_start)
            for b in range(len(slot_bytes))
        ]
        self.buffer_bytes = packing.total
        if self.shared is not None:
            self._buffer = self.shared.ensure(packing.total, self._alloc, self.copy_stream)
        elif packing.total:
            self._buffer = self._alloc(packing.total)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """A device buffer of ``nbytes``, allocated on the copy stream, which writes it first."""
        with self._stream_ctx(self.copy_stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def share(self, shared: SharedBuffer) -> None:
        """Place the batches in ``shared`` (the model's other runtimes' buffer) from now on, instead of a buffer
        of this transfer's own (callers hold the model's step lock)."""
        self._drop_buffer()
        self.shared = shared
        shared.join(self)
        if self.buffer_bytes:
            self._buffer = shared.ensure(self.buffer_bytes, self._alloc, self.copy_stream)

    def release_buffer(self) -> None:
        """Give the installed plan's copy buffer up until the next :meth:`set_actions` (its runtime is idle): an own
        buffer is freed after the work queued on it; a shared one no longer counts this transfer's need, so the
        next plan installed in it sizes it for the others alone."""
        self._drop_buffer()
        self._slots = []
        self.buffer_bytes = 0

    def forget_buffer(self) -> list[Any]:
        """The shared buffer is being replaced: drop every view of it, the carried ones too (:attr:`on_forget`);
        returns events recorded after this transfer's queued work, which the replacer waits for before freeing."""
        done = []
        if self._needs_release:
            for stream in (self.copy_stream, self.last_compute):
                if stream is not None:
                    ev = self._event()
                    ev.record(stream)
                    done.append(ev)
        self._forget_views()
        self._buffer = None
        if self.on_forget is not None:
            self.on_forget()
        return done

    def begin_step(self, args: Sequence[Any]) -> bool | None:
        """Take the shared buffer's turn (if shared); True when another runtime wrote it since this one's last
        step, so batches carried over from that step are gone (every place counts as free again)."""
        compute = self._current_stream()
        shared = self.shared
        lost = False
        if shared is not None:
            if self._buffer is not shared.tensor and self.buffer_bytes:
                self._forget_views()
                self._buffer = shared.ensure(self.buffer_bytes, self._alloc, self.copy_stream)
            lost = shared.claim(self, compute)
            # (streams compare by handle: current_stream() makes a new Python object each call)
            if not lost and compute != self.last_compute and shared.tensor is not None and self._needs_release:
                self._record_stream(shared.tensor, compute)  # a new compute stream reads it too
            if lost:
                self.abort()
        self.last_compute = compute
        return lost

    @property
    def device_buffer(self) -> torch.Tensor | None:
        """The device buffer the batches are placed in now (shared with other runtimes when :attr:`shared`)."""
        return self._buffer

    def _place_bytes(self, sizes: Sequence[int]) -> int:
        """Bytes of a batch's place for weights of these sizes (each aligned to :data:`WEIGHT_ALIGNMENT`)."""
        return sum(align_up(n) for n in sizes)

    def close(self) -> None:
        """Forget the plan's buffer (after the compute stream's queued work, which may still read it), and the host
        views its queued copies read once they are done."""
        self.release_buffer()
        if self.shared is not None:
            self.shared.leave(self)
            self.shared = None
        self._sources.drain()

    def abort(self) -> None:
        """A step failed part way: no fetched weight will be released, so every place counts as free again."""
        for slot in self._slots:
            slot.live = 0

    def _drop_buffer(self) -> None:
        if self._buffer is not None and self._needs_release:
            self._record_stream(self._buffer, self._current_stream())
        self._buffer = None
        self._forget_views()

    def _forget_views(self) -> None:
        """Drop every view made of the buffer (made again at each batch's next fetch)."""
        self._typed = {}
        self._owner = {}
        for slot in self._slots:
            if slot.event is not None and slot.copies and self._needs_release:
                self._sources.keep(slot.event, [host for _, host in slot.copies])
            slot.key, slot.views, slot.copies, slot.event = None, (), (), None

    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Copy batch ``batch`` into its place and return its views (allocating when it has no usable place)."""
        slots = self._slots
        if batch is None or batch >= len(slots) or self._buffer is None:
            return super().fetch(hosts, event)
        slot = slots[batch]
        if any(slots[j].live for j in slot.shares):
            self.fallbacks += 1
            logger.debug("copy batch %d: its place is still in use; allocating instead", batch)
            return super().fetch(hosts, event)
        key = self._key(hosts)
        if key != slot.key and not self._lay_out(slot, hosts, key):
            return super().fetch(hosts, event)
        if slot.gate:
            self._gate_event.record(self._current_stream())
            self.copy_stream.wait_event(self._gate_event)
        with self._stream_ctx(self.copy_stream):
            for dev, host in slot.copies:
                dev.copy_(host, non_blocking=True)
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        slot.event = ev
        slot.live = len(hosts)
        self.copies += len(hosts)
        self.copy_calls += len(slot.copies)
        self.bytes_copied += sum(h.nbytes for h in hosts)
        return list(slot.views), ev

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        """A view of the buffer frees its batch's place after the batch's last weight; others as per tensor."""
        slot = self._owner.get(id(t))
        if slot is None:
            super().release(t, compute_stream)
        elif slot.live > 0:
            slot.live -= 1

    def _typed_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        base = self._typed.get(dtype)
        if base is None:
            assert self._buffer is not None
            base = self._typed[dtype] = self._buffer.view(dtype)
        return base

    def _key(self, hosts: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """What a batch's views and copies were made for: the host tensors, and the registrations' version."""
        return (self._registered.version, *((id(h), h.data_ptr()) for h in hosts))

    def _lay_out(self, slot: _Slot, hosts: Sequence[torch.Tensor], key: tuple[Any, ...]) -> bool:
        """Make ``slot``'s views and copies for these host tensors; False when they cannot use the buffer."""
        if any(h.device.type != "cpu" or _extent(h) != h.nbytes or h.dtype.itemsize < 1 for h in hosts):
            return False  # overlapping or gapped strides: copied (and allocated) per weight
        assert self._buffer is not None
        # one span per storage and registered piece of it: an arena pinned in pieces (while it was filled, or
        # under a pin budget) is several registrations, and one copy must not run from one into the next
        reg = self._registered
        groups: dict[tuple[int, int], list[int]] = {}
        for i, h in enumerate(hosts):
            g = (h.untyped_storage().data_ptr(), reg.region(h.data_ptr())) if h.numel() else (-1 - i, 0)
            groups.setdefault(g, []).append(i)
        spans = {g: plan_span([hosts[i] for i in idx], registered=reg) for g, idx in groups.items()}
        need = sum(align_up(s.host.numel()) if s is not None else sum(align_up(hosts[i].nbytes) for i in groups[g])
                   for g, s in spans.items())
        if need > slot.size:
            spans = dict.fromkeys(groups)  # the spans' gaps do not fit: one copy per weight
        views: list[torch.Tensor | None] = [None] * len(hosts)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = slot.offset
        for g, idx in groups.items():
            span = spans[g]
            if span is not None:
                copies.append((self._buffer[at:at + span.host.numel()], span.host))
                for i, (dtype, size, stride, off) in zip(idx, span.layout, strict=True):
                    views[i] = self._typed_buffer(dtype).as_strided(size, stride, at // dtype.itemsize + off)
                at = align_up(at + span.host.numel())
                continue
            for i in idx:
                h = hosts[i].detach()  # the data now: a later rebind of the weight changes the key, not this copy
                v = self._typed_buffer(h.dtype).as_strided(h.shape, h.stride(), at // h.dtype.itemsize)
                copies.append((v, h))
                views[i] = v
                at = align_up(at + h.nbytes)
        for v in slot.views:
            self._owner.pop(id(v), None)
        if slot.event is not None and slot.copies and self._needs_release:
            # the last copies may still be reading the old sources (the device views go: they hold the buffer)
            self._sources.keep(slot.event, [host for _, host in slot.copies])
        slot.views = tuple(v for v in views if v is not None)
        slot.copies = tuple(copies)
        slot.key = key
        for v in slot.views:
            self._owner[id(v)] = slot
        return True

    def nbytes(self, sizes: Sequence[int]) -> int:
        """The weights' bytes: alignment gaps inside a batch's place add at most 256 bytes a weight."""
        return sum(sizes)
