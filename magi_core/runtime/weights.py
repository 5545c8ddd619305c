"""Device copies of host weights: streamed copy batches on a copy stream, and the shared resident store.

Streamed weights are allocated on the copy stream and, after their last user, handed back with
``record_stream(t, compute_stream)`` so the allocator reuses them only when the compute stream is done.
Resident weights are copied once per host tensor and shared by every executor in the process (one per
input shape); they are re-copied when the host tensor passed in changes identity.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magi_core.backend import Backend


class CopyEngine:
    """Issues host-to-device weight copies on a dedicated copy stream, one event per batch."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        dm = backend.device_module
        self.device = device
        self.copy_stream = dm.Stream()
        self._stream_ctx = dm.stream
        self._event = dm.Event
        self._record_stream = backend.record_stream
        #: False on the host backend: nothing to hand back to a device allocator.
        self.needs_release = backend.is_accelerator
        self.copies = 0

    def copy_batch(self, hosts: list[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        """Copy ``hosts`` to the device on the copy stream (non-blocking); return the copies and their event.

        ``event`` (optional) is re-recorded instead of creating one: the executor keeps one per copy batch.
        """
        device = self.device
        with self._stream_ctx(self.copy_stream):
            outs = [h.to(device, non_blocking=True) for h in hosts]
            ev = self._event() if event is None else event
            ev.record(self.copy_stream)
        self.copies += len(hosts)
        return outs, ev

    def copy_now(self, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
        """Copy one weight on the copy stream and make ``compute_stream`` wait for it (resident weights)."""
        (dev,), ev = self.copy_batch([host])
        compute_stream.wait_event(ev)
        return dev

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        """Hand a streamed weight back to the allocator once ``compute_stream`` is done with it."""
        self._record_stream(t, compute_stream)


@dataclass
class _Entry:
    host: weakref.ref[torch.Tensor]
    device: torch.Tensor
    refs: int


class ResidentStore:
    """Process-wide resident weights keyed by host tensor identity, reference-counted by executors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int, torch.device], _Entry] = {}

    def acquire(
        self, host: torch.Tensor, device: torch.device, copy: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The device copy of ``host`` (made with ``copy`` if no executor holds one), with one more reference."""
        key = (id(host), host.data_ptr(), device)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.host() is host:
                e.refs += 1
                return e.device
        with torch.no_grad():
            dev = copy(host)
        with self._lock:
            self._entries[key] = _Entry(weakref.ref(host), dev, 1)
        return dev

    def release(self, host_id: int, host_ptr: int, device: torch.device) -> None:
        """Drop one reference to the copy of host tensor ``host_id`` (data at ``host_ptr``); free it at zero."""
        key = (host_id, host_ptr, device)
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            e.refs -= 1
            if e.refs <= 0:
                del self._entries[key]

    def nbytes(self) -> int:
        """Bytes held on devices by resident weights now."""
        with self._lock:
            return sum(e.device.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


RESIDENT = ResidentStore()


class ResidentSet:
    """One executor's resident weights: input index -> device tensor, re-validated each step.

    A weight is copied again when the host tensor passed in is another object or its storage moved
    (``param.data = ...``).
    """

    def __init__(self, store: ResidentStore, device: torch.device, indices: tuple[int, ...]) -> None:
        self._store = store
        self._device = device
        self.indices = indices
        self._hosts: list[torch.Tensor | None] = [None] * len(indices)
        self._devs: list[torch.Tensor | None] = [None] * len(indices)
        self._ptrs: list[int] = [0] * len(indices)
        self.copies = 0

    def fill(self, args: Sequence[Any], env: list[Any], copier: CopyEngine, compute_stream: Any) -> None:
        """Put every resident weight's device copy into ``env`` (copying only when the host tensor changed)."""
        hosts, devs, ptrs = self._hosts, self._devs, self._ptrs
        for k, i in enumerate(self.indices):
            h: torch.Tensor = args[i]
            if h is not hosts[k] or h.data_ptr() != ptrs[k]:
                if hosts[k] is not None:
                    self._store.release(id(hosts[k]), ptrs[k], self._device)
                devs[k] = self._store.acquire(h, self._device, lambda t: copier.copy_now(t, compute_stream))
                hosts[k] = h
                ptrs[k] = h.data_ptr()
                self.copies += 1
            env[i] = devs[k]

    def close(self) -> None:
        """Release every resident weight this set holds."""
        for k, h in enumerate(self._hosts):
            if h is not None:
                self._store.release(id(h), self._ptrs[k], self._device)
                self._hosts[k] = None
                self._devs[k] = None
