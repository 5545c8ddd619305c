"""One device copy buffer for the runtimes of one model on one device (one per input shape or graph).

Each runtime's plan places its copy batches in a buffer of its own size (:class:`~magi_core.execute.transfer.
unit.UnitTransfer`); runtimes of one model run one step at a time (the model's handle gives them one step lock),
so they can take turns in one buffer, sized for the largest: device memory for copies is the largest plan's
buffer, not the sum over input shapes. Taking turns costs what a turn overwrote: the copies a runtime carried
into its next step (issued during its last step's tail) are gone once another runtime ran, so that runtime
copies them again at its step start (:meth:`SharedBuffer.claim` says when). Device order: a runtime taking
over makes its copy stream wait for the previous one's compute and copy streams, so nothing it writes lands
before the previous runtime's queued work is done with the bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from magi_core.execute.transfer.unit import UnitTransfer


class SharedBuffer:
    """The copy buffer the runtimes of one model share on one device (callers hold the model's step lock)."""

    def __init__(self, record_stream: Callable[[torch.Tensor, Any], None], event: Callable[[], Any]) -> None:
        self._record_stream = record_stream
        self._event = event
        self.tensor: torch.Tensor | None = None
        self._sharers: weakref.WeakSet[UnitTransfer] = weakref.WeakSet()
        self._owner: weakref.ref[UnitTransfer] | None = None
        self._made: Any = None  # event recorded on the allocating stream when the buffer was made
        self._waited: weakref.WeakSet[UnitTransfer] = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer now (0 before any runtime needed one)."""
        return 0 if self.tensor is None else int(self.tensor.numel())

    def join(self, t: UnitTransfer) -> None:
        """``t`` places its batches in this buffer from now on."""
        self._sharers.add(t)

    def ensure(self, nbytes: int, alloc: Callable[[int], torch.Tensor], stream: Any) -> torch.Tensor | None:
        """The buffer, sized for the largest of ``nbytes`` and the sharers' plans (made again when that changed:
        the old one is freed first, after every sharer's queued work; None once no plan needs one, so a buffer a
        warm-up needed is not kept next to the resident weights of plans that stream nothing). ``alloc``
        allocates on ``stream``."""
        need = max([nbytes, *(s.buffer_bytes for s in self._sharers)])
        if need == self.nbytes:
            return self.tensor
        if self.tensor is not None:
            # every sharer drops its views (carried copies too); the host waits for the work queued on the old
            # bytes, so they are free before the new buffer is made: the device never holds both (planning is
            # rare, a wait there costs nothing per step)
            done = [ev for s in list(self._sharers) for ev in s.forget_buffer()]
            for ev in done:
                ev.synchronize()
            self.tensor = None
        if need == 0:
            return None
        self.tensor = alloc(need)
        # the allocator orders the new block after earlier work only on the allocating stream: other streams
        # wait for this point before they first write or read it
        self._made = self._event()
        self._made.record(stream)
        self._waited = weakref.WeakSet()
        self._owner = None
        return self.tensor

    def claim(self, t: UnitTransfer, compute_stream: Any) -> bool:
        """Make ``t`` the runtime whose copies the buffer holds; True when another one wrote it since ``t`` last
        did (what ``t`` carried over is gone). ``t``'s copy stream then waits for the previous one's streams."""
        prev = self._owner() if self._owner is not None else None
        if prev is t:
            return False
        if self._made is not None and t not in self._waited:
            t.copy_stream.wait_event(self._made)  # its compute stream reads only after its copy events
            self._waited.add(t)
        if prev is not None:
            for stream in (prev.copy_stream, prev.last_compute):
                if stream is not None:
                    ev = self._event()
                    ev.record(stream)
                    t.copy_stream.wait_event(ev)
        if self.tensor is not None:  # its memory is reused only after this runtime's streams are done with it
            self._record_stream(self.tensor, t.copy_stream)
            self._record_stream(self.tensor, compute_stream)
        self._owner = weakref.ref(t)
        return True

    def leave(self, t: UnitTransfer) -> None:
        """``t`` is closing; the buffer goes when no runtime uses it any more."""
        self._sharers.discard(t)
        if self._owner is not None and self._owner() is t:
            self._owner = None
        if not self._sharers:
            self.tensor = None
