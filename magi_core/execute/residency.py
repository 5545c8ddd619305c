"""Resident weights: device copies kept across steps, shared by every executor of the process.

Resident weights are copied once per host tensor (through the executor's
:class:`~magi_core.execute.transfer.WeightTransfer`) and shared by every executor in the process (one per
input shape); they are re-copied when the host tensor passed in changes identity.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magi_core.execute.transfer import WeightTransfer


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
        self, host: torch.Tensor, data: torch.Tensor, device: torch.device,
        copy: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, bool]:
        """The device copy of ``host`` whose data is ``data`` (made with ``copy(data)`` if no executor holds one),
        with one more reference, and whether it was made now (False: another executor's copy, as fresh as that
        executor last checked it, which may be older than the host's bytes).

        ``data`` is one view of ``host``'s data taken by the caller (``host.detach()``): the key and the copy
        both come from it, so a ``host.data = ...`` from another thread meanwhile cannot pair one storage's
        address with another storage's bytes (the next step sees the new address and copies again).
        """
        key = (id(host), data.data_ptr(), device)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.host() is host:
                e.refs += 1
                return e.device, False
        with torch.no_grad():
            dev = copy(data)
        with self._lock:
            self._entries[key] = _Entry(weakref.ref(host), dev, 1)
        return dev, True

    def release(self, host_id: int, host_ptr: int, device: torch.device) -> torch.Tensor | None:
        """Drop one reference to the copy of host tensor ``host_id`` (data at ``host_ptr``).

        Returns the device tensor when this was the last reference (the caller frees it stream-ordered).
        """
        key = (host_id, host_ptr, device)
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            e.refs -= 1
            if e.refs <= 0:
                del self._entries[key]
                return e.device
            return None

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
    (``param.data = ...``), and refreshed in place when its values changed (``changed``, from the executor's
    :class:`~magi_core.execute.freshness.WeightWatch`). A copy another executor made (another input shape) is
    only as fresh as that executor's last check: taken over while ``changed`` says the weight changed (a new
    watch says so of every weight), it is refreshed before use. A device copy no executor holds any more is handed
    back through the transfer, ordered after the compute stream's queued work that may still read it.
    """

    def __init__(self, store: ResidentStore, device: torch.device, indices: tuple[int, ...]) -> None:
        self._store = store
        self._device = device
        self.indices = indices
        self._hosts: list[torch.Tensor | None] = [None] * len(indices)
        self._devs: list[torch.Tensor | None] = [None] * len(indices)
        self._ptrs: list[int] = [0] * len(indices)
        self._held = 0  # positions with a device copy: ``complete`` is asked every step, and ``None in`` a list of
        # tensors would compare each tensor with None through torch (microseconds per weight)
        self.copies = 0

    @property
    def complete(self) -> bool:
        """True once every resident weight has a device copy (after the first step of the plan)."""
        return self._held == len(self.indices)

    def acquire(self, args: Sequence[Any], transfer: WeightTransfer, compute_stream: Any) -> frozenset[int]:
        """Make or take over the device copy of every resident weight that has none for the host tensor passed in;
        the positions (in :attr:`indices`) copied now, from the bytes the host holds now.

        The step's first act where copies are missing: long-lived copies are allocated together, before the step's
        streamed buffers, so that they do not split the allocator's memory between short-lived blocks."""
        made_now: set[int] = set()
        for k, i in enumerate(self.indices):
            h: torch.Tensor = args[i]
            if h is not self._hosts[k] or h.data_ptr() != self._ptrs[k]:
                if self._take(k, h, transfer, compute_stream):
                    made_now.add(k)
        return frozenset(made_now)

    def fill(
        self, args: Sequence[Any], env: list[Any], transfer: WeightTransfer, compute_stream: Any,
        changed: set[int] | frozenset[int] = frozenset(), part: range | None = None,
        made_now: frozenset[int] = frozenset(),
    ) -> None:
        """Put resident weights' device copies into ``env``, copying what is new or ``changed`` on the host: all of
        them, or those at positions ``part`` of :attr:`indices`. ``made_now``: positions :meth:`acquire` copied in
        this step (from the bytes ``changed`` was judged on: not copied again)."""
        hosts, devs, ptrs, indices = self._hosts, self._devs, self._ptrs, self.indices
        for k in range(len(indices)) if part is None else part:
            i = indices[k]
            h: torch.Tensor = args[i]
            if h is not hosts[k] or h.data_ptr() != ptrs[k]:
                self._take(k, h, transfer, compute_stream, stale=i in changed)
            elif i in changed and k not in made_now:
                kept = devs[k]
                assert kept is not None
                # (rebound since the check above: these bytes now, and the next step sees the new address)
                transfer.refresh(kept, h.detach(), compute_stream)
                self.copies += 1
            env[i] = devs[k]

    def _take(
        self, k: int, h: torch.Tensor, transfer: WeightTransfer, compute_stream: Any, stale: bool = False,
    ) -> bool:
        """Hold the device copy of host tensor ``h`` at position ``k`` (its old one handed back); True when it was
        copied now, False when another executor's copy was taken over (refreshed first where ``stale``: checked by
        that executor before a change this one saw)."""
        # one view of the data now: what is copied and the address recorded for it are the same storage even if
        # another thread rebinds ``h.data`` meanwhile (the next step then sees the new address)
        data = h.detach()
        old_host = self._hosts[k]
        if old_host is not None:
            self._hosts[k] = self._devs[k] = None  # released: a failed copy below leaves the position empty
            self._held -= 1
            old = self._store.release(id(old_host), self._ptrs[k], self._device)
            if old is not None:
                transfer.release(old, compute_stream)
        dev, made = self._store.acquire(h, data, self._device, lambda t: transfer.fetch_now(t, compute_stream))
        if not made and stale:
            transfer.refresh(dev, data, compute_stream)
        self._devs[k] = dev
        self._hosts[k] = h
        self._held += 1
        self._ptrs[k] = data.data_ptr()
        self.copies += 1
        return made

    def close(self, transfer: WeightTransfer | None = None, compute_stream: Any = None) -> None:
        """Release every resident weight this set holds (stream-ordered through ``transfer`` when given)."""
        for k, h in enumerate(self._hosts):
            if h is not None:
                old = self._store.release(id(h), self._ptrs[k], self._device)
                if old is not None and transfer is not None:
                    transfer.release(old, compute_stream)
                self._hosts[k] = None
                self._devs[k] = None
        self._held = 0
