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

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        """Copy ``hosts`` on the copy stream; ``event`` (optional) is re-recorded instead of creating one."""
        device = self.device
        with self._stream_ctx(self.copy_stream):
            outs = [h.to(device, non_blocking=True) for h in hosts]
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        self.copies += len(hosts)
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
        self.bytes_copied += host.nbytes

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        """``record_stream`` on the compute stream: the allocator reuses ``t`` once that stream is past it."""
        if self._needs_release:
            self._record_stream(t, compute_stream)

    def nbytes(self, sizes: Sequence[int]) -> int:
        """Each weight is its own copy: the sum of their sizes."""
        return sum(sizes)
