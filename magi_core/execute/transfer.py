"""The transfer seam: how streamed and resident weights reach the device, and when they may be freed.

The executor never issues a copy itself. It asks a :class:`WeightTransfer` to bring a batch of host weights
to the device (:meth:`~WeightTransfer.fetch`: device tensors plus an event the compute stream waits on), and
hands each streamed weight back after its last user (:meth:`~WeightTransfer.release`). Planning asks the
same object what a group of weights costs to move (:meth:`~WeightTransfer.nbytes`), so a transfer that
moves weights differently (one contiguous buffer per unit, a share per rank) plans and runs consistently.

:class:`PerTensorTransfer` is the implementation in use: one non-blocking copy per weight on a dedicated
copy stream, one event per batch; released weights are handed back with ``record_stream(t, compute_stream)``
so the caching allocator reuses their memory only once the compute stream is done with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from magi_core.plugin.facade import Backend


class WeightTransfer(Protocol):
    """Bring weights to the device on a copy stream, give an event, release them after their last use."""

    #: The stream copies run on (the executor gates it on the compute stream before issuing).
    copy_stream: Any
    #: Weight copies issued so far, and their bytes.
    copies: int
    bytes_copied: int

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        """Start copying ``hosts`` to the device; return their device tensors and an event recorded after them."""
        ...

    def fetch_now(self, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
        """One weight's device copy, ordered before whatever ``compute_stream`` runs next (resident weights)."""
        ...

    def refresh(self, dev: torch.Tensor, host: torch.Tensor, compute_stream: Any) -> None:
        """Overwrite a kept device copy with ``host``'s values: after the work queued on ``compute_stream``
        (which may still read the old values), and before whatever it runs next."""
        ...

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        """Hand a fetched weight back once ``compute_stream`` has finished the work already queued on it."""
        ...

    def nbytes(self, sizes: Sequence[int]) -> int:
        """Bytes moved to fetch weights of these sizes together (what planning accounts)."""
        ...


class PerTensorTransfer:
    """One non-blocking host-to-device copy per weight on a dedicated copy stream, one event per batch."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        dm = backend.device_module
        self.device = device
        self.copy_stream = dm.Stream()
        self._stream_ctx = dm.stream
        self._event = dm.Event
        self._record_stream = backend.record_stream
        self._needs_release = backend.is_accelerator  # the host backend has no device allocator to hand back to
        self.copies = 0
        self.bytes_copied = 0
        #: Host-to-device copy calls issued (one per weight here; one per span in :class:`SpanTransfer`).
        self.copy_calls = 0

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        """Copy ``hosts`` on the copy stream; ``event`` (optional) is re-recorded instead of creating one."""
        device = self.device
        with self._stream_ctx(self.copy_stream):
            outs = [h.to(device, non_blocking=True) for h in hosts]
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        self.copies += len(hosts)
        self.copy_calls += len(hosts)
        self.bytes_copied += sum(h.nbytes for h in hosts)
        return outs, ev

    def fetch_now(self, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
        """Copy one weight on the copy stream and make ``compute_stream`` wait for it."""
        (dev,), ev = self.fetch([host])
        compute_stream.wait_event(ev)
        return dev

    def refresh(self, dev: torch.Tensor, host: torch.Tensor, compute_stream: Any) -> None:
        """Copy ``host`` into ``dev`` on the copy stream, between the compute stream's queued and next work."""
        gate = self._event()
        gate.record(compute_stream)
        self.copy_stream.wait_event(gate)
        with self._stream_ctx(self.copy_stream):
            dev.copy_(host, non_blocking=True)
            done = self._event()
            done.record(self.copy_stream)
        compute_stream.wait_event(done)
        self.copies += 1
        self.copy_calls += 1
        self.bytes_copied += host.nbytes

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        """``record_stream`` on the compute stream: the allocator reuses ``t`` once that stream is past it."""
        if self._needs_release:
            self._record_stream(t, compute_stream)

    def nbytes(self, sizes: Sequence[int]) -> int:
        """Each weight is its own copy: the sum of their sizes."""
        return sum(sizes)


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


def plan_span(hosts: Sequence[torch.Tensor], slack: float = SPAN_SLACK) -> _Span | None:
    """The span that holds every weight of ``hosts`` in one host storage, or None when they cannot share one.

    They share one when all are host tensors of one storage, every weight starts at a multiple of its element
    size from the span start, and the span is at most ``slack`` times their bytes (plus a page).
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
    layout = []
    for h in hosts:
        off = h.data_ptr() - lo
        if off % h.element_size():
            return None
        layout.append((h.dtype, tuple(h.shape), tuple(h.stride()), off // h.element_size()))
    span = torch.empty(0, dtype=torch.uint8).set_(storage, lo - sptr, (hi - lo,))  # type: ignore[call-overload]
    return _Span(span, layout)


class SpanTransfer(PerTensorTransfer):
    """One copy per batch: the byte span of the arena that holds the batch's weights, then a view per weight.

    Weights that ``offload`` laid out in one arena in module order lie next to each other, so a unit's
    weights form one span with only alignment gaps; its one device buffer is freed once every view of it
    was released (the allocator frees a block when its last view is gone, after the streams recorded on it).
    Batches that do not form a tight span (:func:`plan_span`) fall back to one copy per weight.
    """

    def __init__(self, backend: Backend, device: torch.device, slack: float = SPAN_SLACK) -> None:
        super().__init__(backend, device)
        self._slack = slack
        self._plans: dict[tuple[tuple[int, int], ...], _Span | None] = {}

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        """Copy the batch's span on the copy stream and return views of it (per-weight copies when no span)."""
        key = tuple((id(h), h.data_ptr()) for h in hosts)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            if len(self._plans) > 4096:  # weights were replaced many times: forget old layouts
                self._plans.clear()
            plan = plan_span(hosts, self._slack)
            self._plans[key] = plan
        if plan is None:
            return super().fetch(hosts, event)
        assert isinstance(plan, _Span)
        with self._stream_ctx(self.copy_stream):
            dev = plan.host.to(self.device, non_blocking=True)
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        typed: dict[torch.dtype, torch.Tensor] = {}
        outs = []
        for dtype, size, stride, offset in plan.layout:
            base = typed.get(dtype)
            if base is None:
                item = dtype.itemsize
                base = typed[dtype] = dev[: dev.numel() // item * item].view(dtype)
            outs.append(base.as_strided(size, stride, base.storage_offset() + offset))  # as_strided's is absolute
        self.copies += len(hosts)
        self.copy_calls += 1
        self.bytes_copied += plan.host.numel()
        return outs, ev

    def nbytes(self, sizes: Sequence[int]) -> int:
        """The weights' bytes: alignment gaps inside a span add at most ``slack`` (planning ignores them)."""
        return sum(sizes)


_MISSING: Any = object()
