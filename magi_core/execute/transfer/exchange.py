"""Ranks of one node that stream the same weights: each copies a share of a unit, then they all-gather it.

N ranks running the same graph (data parallel, replicas) each stream every weight over their own host link.
With :class:`ExchangeTransfer` each rank copies only ``1/N`` of a batch's place from the host (rank ``r`` the
``r``-th shard of the place's bytes) and the ranks all-gather the place over the device interconnect
(``torch.distributed.all_gather_into_tensor``, in place) on a gather stream; the compute stream waits on an
event recorded after the gather, as it waits on a copy otherwise. The host bytes must be identical on every
rank: a batch is exchanged only when every rank reports the same identity for each of its weights (by
default, the node-shared host arena and offset they lie at, see :func:`magi_core.compile.exchange`);
other batches are copied whole by each rank.

Every rank must issue the same collectives in the same order, so the ranks must agree on everything that
decides them: the plan (checked at :meth:`~ExchangeTransfer.set_actions`: a disagreement is an error, never a
hang), the planning rate (:meth:`~ExchangeTransfer.rate`: the slowest rank's measured exchange rate) and
which batches are exchanged (agreed at the first step of a plan, and again at any step where some rank's
weights were replaced: each step starts with a one-integer all-reduce on the metadata group, which is also
where a rank that died or hangs is reported, after the group's timeout).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from magi_core.errors import MagiError
from magi_core.execute.actions import StepActions, batch_lifetimes
from magi_core.execute.transfer.unit import WEIGHT_ALIGNMENT, UnitTransfer, align_up
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

#: What identifies a host weight's bytes across ranks (equal identities: equal bytes), or None when unknown.
Identity = Callable[[torch.Tensor], Hashable | None]


class ExchangeDisagreement(MagiError):
    """The ranks of an exchange group disagree on what they stream: they would deadlock in the exchange."""


def plan_fingerprint(actions: StepActions, sizes: Sequence[Sequence[int]]) -> str:
    """A digest of what decides the collectives of a step: copy batches, their bytes, lifetimes and order."""
    text = repr((actions.batches, [list(s) for s in sizes], batch_lifetimes(actions), actions.start, actions.carry,
                 actions.issue))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ExchangeTransfer(UnitTransfer):
    """One shard per rank from the host, the rest over the interconnect (see the module docstring)."""

    #: Its shards are planned for its own buffer with the other ranks: not shared with other runtimes.
    shareable = False
    #: Every rank must install the same plan: planning agrees on the unit timings across the ranks.
    collective = True

    def __init__(self, backend: Backend, device: torch.device, group: Any, meta_group: Any,
                 identity: Identity) -> None:
        super().__init__(backend, device)
        self.group = group
        self.meta_group = meta_group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._identity = identity
        self.gather_stream = backend.device_module.Stream()
        self._synchronize = backend.device_module.synchronize
        self._host_register, self._host_unregister = backend.host_register, backend.host_unregister
        self._batches: tuple[tuple[int, ...], ...] = ()
        self._eligible: list[bool] = []
        self._shards: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = []
        self._signature: int | None = None
        #: Batches exchanged and bytes received over the interconnect so far (``bytes_copied``: from the host).
        self.exchanges = 0
        self.bytes_gathered = 0

    # -- agreement ---------------------------------------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.meta_group)
        return out

    def set_actions(self, actions: StepActions, sizes: Sequence[Sequence[int]]) -> None:
        """Check that every rank installs the same plan, then place its batches (shards of equal size)."""
        mine = plan_fingerprint(actions, sizes)
        theirs = self._gather(mine)
        if any(f != mine for f in theirs):
            differ = [r for r, f in enumerate(theirs) if f != theirs[0]]
            raise ExchangeDisagreement(
                f"ranks {differ} of the exchange group installed a different offload plan from rank 0 (plan digests "
                f"{theirs}); exchanging weights needs the same plan on every rank: use the same OffloadConfig and "
                "model on every rank, or OffloadConfig(exchange='off')"
            )
        self._batches = actions.batches
        self._eligible = [False] * len(actions.batches)
        self._shards = [()] * len(actions.batches)
        self._signature = None
        super().set_actions(actions, sizes)

    def _place_bytes(self, sizes: Sequence[int]) -> int:
        """A batch's place, padded so that it splits into one equal, aligned shard per rank."""
        unit = self.world * WEIGHT_ALIGNMENT
        return align_up(sum(align_up(n) for n in sizes), unit)

    def all_agree(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank of the group: one decision for all (their units must match)."""
        agreed = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.meta_group)
        return bool(agreed.item())

    def rate(self, measured_Bps: float) -> float:
        """The slowest rank's rate of exchanging a place of the probe's size (what every rank plans with)."""
        agreed = torch.tensor([float(measured_Bps)], dtype=torch.float64)  # each rank measured its own link
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.meta_group)
        measured_Bps = float(agreed.item())  # one probe size on every rank (the all-gather needs equal shards)
        nbytes = max(self.world * WEIGHT_ALIGNMENT, int(min(measured_Bps * 0.02, 1 << 30)))
        nbytes = -(-nbytes // (self.world * WEIGHT_ALIGNMENT)) * (self.world * WEIGHT_ALIGNMENT)
        host = torch.empty(nbytes // self.world, dtype=torch.uint8)
        place = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        shard = place[self.rank * (nbytes // self.world):(self.rank + 1) * (nbytes // self.world)]
        best = float("inf")
        # pinned in place through the backend, as the weights are (no second, allocator-pinned copy)
        if self._needs_release:
            self._host_register(host.data_ptr(), host.numel())
        try:
            for _ in range(3):
                self._synchronize()
                dist.barrier(group=self.meta_group)
                t0 = time.perf_counter()
                with self._stream_ctx(self.copy_stream):
                    shard.copy_(host, non_blocking=True)
                    work = dist.all_gather_into_tensor(place, shard, group=self.group, async_op=True)
                    work.wait()
                self._synchronize()
                best = min(best, time.perf_counter() - t0)
        finally:
            if self._needs_release:
                self._host_unregister(host.data_ptr())
        rate = torch.tensor([nbytes / best], dtype=torch.float64)
        dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=self.meta_group)
        logger.info("magi exchange: %d ranks receive weights at %.2f GB/s each (host link alone: %.2f GB/s)",
                    self.world, rate.item() / 1e9, measured_Bps / 1e9)
        return float(rate.item())

    def begin_step(self, args: Sequence[Any]) -> bool | None:
        """Agree which batches are exchanged when any rank's streamed weights changed (first step of a plan)."""
        batches = self._batches
        # (the registrations' version too: a unit's copies are split at their bounds, and the shards with them)
        signature = hash((self._registered.version, *((id(args[w]), args[w].data_ptr()) for ws in batches for w in ws)))
        flag = torch.tensor([int(signature != self._signature)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.meta_group)
        except RuntimeError as exc:
            raise ExchangeDisagreement(
                f"rank {self.rank} of the weight exchange group: another rank did not start this step with it "
                f"(it exited, crashed, or stopped calling the model; the group waits MAGI_EXCHANGE_TIMEOUT_S): {exc}"
            ) from exc
        if not flag.item():
            return None
        self._signature = signature
        mine: list[Any] = []
        for b, ws in enumerate(batches):
            hosts = [args[w] for w in ws]
            mine.append(self._batch_identity(b, hosts))
        everyone = self._gather(mine)
        for b in range(len(batches)):
            ok = mine[b] is not None and all(other[b] == mine[b] for other in everyone)
            self._eligible[b] = ok
            self._shards[b] = self._shard_copies(self._slots[b]) if ok else ()
        logger.info("magi exchange: %d of %d copy batches exchanged across %d ranks", sum(self._eligible),
                    len(batches), self.world)
        return None

    def _batch_identity(self, b: int, hosts: Sequence[torch.Tensor]) -> Any:
        if self._buffer is None or b >= len(self._slots):
            return None
        slot = self._slots[b]
        key = self._key(hosts)
        if key != slot.key and not self._lay_out(slot, hosts, key):
            return None
        if not all(d.is_contiguous() and h.is_contiguous() for d, h in slot.copies):
            return None  # a copy that keeps a permuted layout cannot be cut into byte shards
        ids = tuple(self._identity(h) for h in hosts)
        return None if any(i is None for i in ids) else (ids, [tuple(h.shape) for h in hosts])

    def _shard_copies(self, slot: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """This rank's part of every copy into the slot: the bytes of its shard of the place."""
        size = slot.size // self.world
        lo, hi = slot.offset + self.rank * size, slot.offset + (self.rank + 1) * size
        out = []
        assert self._buffer is not None
        base = self._buffer.data_ptr()
        for dev, host in slot.copies:
            d = dev.view(-1).view(torch.uint8) if dev.dtype != torch.uint8 else dev.view(-1)
            h = host.reshape(-1).view(torch.uint8) if host.dtype != torch.uint8 else host.reshape(-1)
            start = d.data_ptr() - base
            a, z = max(lo, start), min(hi, start + d.numel())
            if a < z:
                out.append((d[a - start:z - start], h[a - start:z - start]))
        return tuple(out)

    # -- fetch -------------------------------------------------------------------------------------------
    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Exchange an agreed batch (this rank's shard from the host, the place gathered); others as a unit copy."""
        if batch is None or batch >= len(self._eligible) or not self._eligible[batch]:
            return super().fetch(hosts, event, batch)
        slot = self._slots[batch]
        if any(self._slots[j].live for j in slot.shares):
            raise MagiError(
                f"copy batch {batch}: its place in the device buffer is still in use, and exchanged batches cannot "
                "fall back to a private copy (the other ranks wait for this one); this is a bug in magi-core, "
                "please report it (OffloadConfig(exchange='off') avoids it)"
            )
        assert self._buffer is not None
        if slot.gate:
            self._gate_event.record(self._current_stream())
            self.copy_stream.wait_event(self._gate_event)
        place = self._buffer[slot.offset:slot.offset + slot.size]
        size = slot.size // self.world
        shard = place[self.rank * size:(self.rank + 1) * size]
        with self._stream_ctx(self.copy_stream):
            for dev, host in self._shards[batch]:
                dev.copy_(host, non_blocking=True)
            copied = self._event()
            copied.record(self.copy_stream)
        self.gather_stream.wait_event(copied)
        with self._stream_ctx(self.gather_stream):
            work = dist.all_gather_into_tensor(place, shard, group=self.group, async_op=True)
            work.wait()  # the gather stream (not the host) waits for the collective
            ev = self._event() if event is None else event
            ev.record(self.gather_stream)
        slot.live = len(hosts)
        self.copies += len(hosts)
        self.copy_calls += len(self._shards[batch])
        self.bytes_copied += sum(h.numel() for _, h in self._shards[batch])
        self.bytes_gathered += slot.size - size
        self.exchanges += 1
        return list(slot.views), ev
