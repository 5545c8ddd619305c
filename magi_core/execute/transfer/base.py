"""The transfer protocol, and the transfer that makes one copy per weight from the caching allocator."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from magi_core.execute.actions import StepActions
from magi_core.plugin.facade import Backend


class WeightTransfer(Protocol):
    """Bring weights to the device on a copy stream, give an event, release them after their last use."""

    #: The stream copies run on (the executor gates it on the compute stream before issuing).
    copy_stream: Any
    #: Weight copies issued so far, and their bytes.
    copies: int
    bytes_copied: int
    #: True when each fetch allocates device memory (the executor then bounds how far the host runs ahead).
    allocates: bool

    def set_actions(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> None:
        """A plan was installed: ``actions``' copy batches (``sizes``: their weights' bytes) are what
        :meth:`fetch` will be asked for, by batch id, every step until the next call."""
        ...

    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Start copying ``hosts`` (copy batch ``batch`` of the installed actions, or None for an unplanned
        copy) to the device; return their device tensors and an event recorded after them. The caller has
        ordered the copy stream after the compute work that used this batch's predecessors (its gate)."""
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

    def abort(self) -> None:
        """A step failed part way: weights it fetched will not be released."""
        ...

    def begin_step(self, args: Sequence[Any]) -> bool | None:
        """A step starts with these inputs (weights at the installed actions' input indices), before any fetch;
        True when copies kept from the last step (carried into this one) are gone and must be made again."""
        ...

    def rate(self, measured_Bps: float) -> float:
        """The rate to plan with, given the measured host-to-device bandwidth."""
        ...

    def close(self) -> None:
        """Drop what the transfer keeps for the installed actions (the executor is closing)."""
        ...


class SourceKeeper:
    """Host tensors a queued copy reads, held until an event recorded after the copy completes.

    A non-blocking copy reads its host bytes when the device runs it, not when it is issued: a weight whose
    ``.data`` another thread rebinds meanwhile would lose its last reference and have its memory freed (and reused
    by the next allocation) before the copy read it. Every copy therefore reads a view of the data taken when it
    was issued (one storage, whatever is rebound later), and that view lives here until the copy is done.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: deque[tuple[Any, Any]] = deque()

    def keep(self, event: Any, sources: Any) -> None:
        """Hold ``sources`` until ``event`` (recorded after the copies that read them) has completed."""
        held = self._held
        while held and held[0][0].query():
            held.popleft()
        held.append((event, sources))

    def clear(self) -> None:
        """Forget everything held (the device is idle or the caller synchronised it)."""
        self._held.clear()

    def drain(self) -> None:
        """Wait for every held copy to complete, then forget its sources: nothing then keeps the host memory mapped
        (a released model's mappings are unmapped only once no tensor views them)."""
        held = self._held
        while held:
            held[0][0].synchronize()
            held.popleft()


class PerTensorTransfer:
    """One non-blocking host-to-device copy per weight on a dedicated copy stream, one event per batch.

    Every copy reads a view of its weight's data taken when it is issued, kept alive (on an accelerator) until the
    copy completes (:class:`SourceKeeper`): a weight rebound by another thread reaches the device whole, old or
    new, never freed memory. On the host backend the "copy" is that view itself.
    """

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
        self.allocates = True
        #: Host-to-device copy calls issued (one per weight here; one per batch and host storage with UnitTransfer).
        self.copy_calls = 0
        self._sources = SourceKeeper()

    def set_actions(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> None:
        """Nothing to prepare: every fetch allocates its device tensors."""

    def abort(self) -> None:
        """Nothing kept per step."""

    def begin_step(self, args: Sequence[Any]) -> bool | None:
        """Nothing to prepare per step."""
        return None

    def rate(self, measured_Bps: float) -> float:
        """Weights move at the measured host-to-device rate."""
        return measured_Bps

    def close(self) -> None:
        """Wait for the queued copies and drop the host views they read."""
        self._sources.drain()

    def release_buffer(self) -> None:
        """No buffer to give up: its copies are allocated per fetch (the executor drops the carried ones)."""

    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Copy ``hosts`` on the copy stream; ``event`` (optional) is re-recorded instead of creating one."""
        device = self.device
        # a view per weight, taken now: it holds the storage, so another thread rebinding ``.data`` cannot free the
        # bytes while a copy (or, on the host backend, the unit computing with them) reads them
        sources = [h.detach() for h in hosts]
        with self._stream_ctx(self.copy_stream):
            outs = [h.to(device, non_blocking=True) for h in sources]
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        if self._needs_release:
            self._sources.keep(ev, sources)
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
        """Copy ``host`` into ``dev`` on the copy stream, between the compute stream's queued and next work, ``dev``'s
        memory held until the copy is done (nothing when ``dev`` is ``host``'s own storage, as on the host backend:
        a copy onto itself would only bump its version counter, which other runtimes' freshness checks read as an
        edit)."""
        if dev.device == host.device and dev.data_ptr() == host.data_ptr():
            return
        gate = self._event()
        gate.record(compute_stream)
        self.copy_stream.wait_event(gate)
        source = host.detach()
        with self._stream_ctx(self.copy_stream):
            dev.copy_(source, non_blocking=True)
            done = self._event()
            done.record(self.copy_stream)
        compute_stream.wait_event(done)
        if self._needs_release:
            self._sources.keep(done, source)
            # the copy stream wrote ``dev``, which another executor may own and free: its allocator must wait for
            # this stream too, not only for the stream that frees it
            self._record_stream(dev, self.copy_stream)
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
