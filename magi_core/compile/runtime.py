"""The warm-up state machine around an :class:`~magi_core.execute.executor.OffloadExecutor`.

With ``warmup_calls = w`` (config): calls ``1 .. w-1`` run a simple look-ahead plan (BASE, nothing
resident); call ``w`` runs the same plan while a unit timer records each unit's compute on the compute
stream (events only, no barrier per unit); call ``w + 1`` reads the timings, measures the host-to-device
bandwidth (once per process, cached: this rank's own link) and installs the policy's static plan, which
every later call follows. ``w = 0`` plans on the first call from weight sizes alone. A call is no collective:
under torch.distributed each rank plans from its own timings and link, whenever its own calls get there (ranks
may call their models a different number of times, with other shapes), except a runtime whose weights are
exchanged across the node's ranks, which must install one plan on every rank and agrees on rank 0's timings.

Runtimes of one model (one per input shape, one per graph of a forward with graph breaks) share its device
budget (:meth:`OffloadRuntime._share_with_peers`): weights another runtime keeps resident stay resident here
for free, ``gpu_resident_weight_ratio`` bounds the union of the runtimes' resident weights, and
``device_memory_budget_bytes`` counts every runtime's resident weights and copy buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from magi_core.compile.device_room import DeviceRoom, PeakMeter, check_unit_fits, device_room, release_cached_blocks
from magi_core.config import OffloadConfig, Policy
from magi_core.errors import ConfigError, DeviceMemoryError
from magi_core.execute.actions import unit_profiles, weight_owners
from magi_core.execute.executor import ExecutorSuspended, OffloadExecutor
from magi_core.execute.profiler import UnitTimer, broadcast_profiles, measure_h2d_bandwidth
from magi_core.plan import build_plan
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

Planner = Callable[[Sequence[UnitProfile], float, OffloadConfig], Plan]
BandwidthFn = Callable[[], float]

#: Plans tried to fit ``device_memory_budget_bytes`` with what the plan really holds (with its copy buffer).
_FIT_ROUNDS = 6
#: The bisection stops when the planning budgets that fit and do not fit are this close (share of the budget).
_FIT_RESOLUTION = 1 / 64
#: Fit-the-card plans: less device memory whose predicted step is within this share of the fastest plan's.
_SAME_STEP = 0.005
#: How many times one graph plans again because another graph of the model made weights resident.
_MAX_REPLANS = 2
#: How many times one graph takes the device memory of the model's other graphs back (:meth:`_evict_peers`).
_MAX_EVICTIONS = 2

#: The smallest default bandwidth probe (and its granularity) on a card with little free memory.
_MIN_PROBE_BYTES = 16 << 20

_bw_lock = threading.Lock()
_bw_cache: dict[tuple[str, int], float] = {}


def cached_bandwidth(backend: Backend, device: torch.device, config: OffloadConfig) -> float:
    """Host-to-device bandwidth in bytes/s, measured once per process and device (this rank's own)."""
    nbytes = config.probe_bytes(backend.is_accelerator)
    if config.bandwidth_probe_bytes is None and backend.is_accelerator:
        # the default probe on a small or busy card: a quarter of what it has free (a few MiB copy at link speed)
        info = backend.device_memory(device)
        if info is not None:
            nbytes = min(nbytes, max(_MIN_PROBE_BYTES, info.free // 4 // _MIN_PROBE_BYTES * _MIN_PROBE_BYTES))
    key = (str(device), nbytes)
    with _bw_lock:
        if key not in _bw_cache:
            # this rank's own link, no collective: a model call must not wait for other ranks (which may call
            # their models a different number of times, or not at all); an exchange agrees on its own rate
            _bw_cache[key] = float(measure_h2d_bandwidth(nbytes=nbytes, backend=backend, device=device,
                                                         broadcast=False))
            logger.info("magi offload: host-to-device bandwidth %.2f GB/s (%d B probe)", _bw_cache[key] / 1e9, nbytes)
        return _bw_cache[key]


def default_planner(profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
    """The registered scheduler for ``config.policy``."""
    return build_plan(list(profiles), bandwidth_Bps, config)


class OffloadRuntime:
    """The callable the compile backend returns: warm-up, profiling, then the static plan."""

    def __init__(
        self,
        executor: OffloadExecutor,
        config: OffloadConfig,
        planner: Planner = default_planner,
        bandwidth: BandwidthFn | None = None,
        timer_factory: Callable[[int], Any] | None = None,
    ) -> None:
        self.executor = executor
        self.config = config
        self._planner = planner
        self._bandwidth = bandwidth or (lambda: cached_bandwidth(executor.backend, executor.device, config))
        self._timer_factory = timer_factory or self._default_timer
        self.calls = 0
        self.phase = "warmup"
        self.profiles: list[UnitProfile] | None = None
        self.bandwidth_Bps: float | None = None
        self._timer: Any = None
        self._planned = False
        #: Warm-up calls (look-ahead, profile, planning) run one at a time; planned calls never take it.
        self._warmup_lock = threading.Lock()
        #: The other runtimes of the same model (set by its handle), which share its device budget.
        self.peers: Callable[[], Sequence[OffloadRuntime]] | None = None
        #: Held while planning, so runtimes of one model plan one at a time (set by the handle).
        self.plan_lock: Any = None
        #: Why less of the device budget was left to plan with (other runtimes of the model), for errors.
        self._peer_note = ""
        #: Bytes of the copy buffer this runtime shares with its planned peers that they need (their largest).
        self._peer_buffer = 0
        #: Host tensors (id, data pointer) of the weights the static plan keeps resident, with their bytes.
        self.resident_hosts: dict[tuple[int, int], int] = {}
        #: Host tensors (id, data pointer) of every weight this graph reads (known once planned).
        self.weight_hosts: frozenset[tuple[int, int]] = frozenset()
        #: Set when another graph of the model made resident weights this one streams: plan again next call.
        self._replan = False
        self._replans = 0
        #: Times this graph took the device memory of the model's other graphs back to plan.
        self._evictions = 0
        #: Device bytes a warm-up call allocated beyond its weights (activations, workspaces): the last one's.
        self.activation_bytes = 0
        #: What the installed static plan holds on the device: resident weights, copy buffer, activations.
        self.predicted_peak_bytes: int | None = None
        #: Device bytes the last measured planned step held (weights held before it plus its own peak).
        self.measured_peak_bytes: int | None = None
        #: The device budget the static plan was fitted to (bytes; None: none, the host backend or a ratio).
        self.device_budget_bytes: int | None = None
        self._meter = PeakMeter(executor.backend.device_module, executor.device)
        self._measure_steps = 0  # planned steps still to measure (the second planned step is measured)
        #: Why the warm-up plan did not fit the device when compiled: raised at the first call, unless the model's
        #: other graphs (not known yet here) give their memory back then.
        self._unfit: DeviceMemoryError | None = None
        if config.warmup_calls > 0:
            plan = self.warmup_plan()
            try:
                self._check_fits(plan)
            except DeviceMemoryError as e:
                self._unfit = e
            else:
                executor.set_plan(plan)

    def _default_timer(self, n_units: int) -> Any:
        return UnitTimer(n_units, backend=self.executor.backend)

    def warmup_plan(self) -> Plan:
        """BASE look-ahead with nothing resident (weights in profile order, compute unknown)."""
        profiles = unit_profiles(self.executor.units, None, self.executor.transfer.nbytes)
        return self._planner(profiles, 1e9, self._warmup_config())

    def _warmup_config(self) -> OffloadConfig:
        return self.config.replace(policy=Policy.BASE, gpu_resident_weight_ratio=0.0, device_memory_budget_bytes=None)

    def _warm_up_next_to_peers(self, args: Sequence[Any]) -> None:
        """A graph compiled after others of the model planned warms up reading the weights they keep resident,
        streaming only the rest: its copy buffer then fits next to their resident weights, within their budget.
        An idle graph (:meth:`_idle_peers`) installs its warm-up plan again, the same way."""
        if self._unfit is not None:
            self._fit_warmup_in_peers_room()
        idle = self.phase == "idle"
        if idle:
            self.phase = "warmup"
        if any(r._planned for r in self._peers_on_device()):
            profiles = unit_profiles(self.executor.units, None, self.executor.transfer.nbytes)
            with self.plan_lock if self.plan_lock is not None else contextlib.nullcontext():
                try:
                    planned, _, shared, _ = self._share_with_peers(profiles, args, self.config)
                except ConfigError:  # the budget is spent: planning says so, with what to do
                    shared = frozenset()
                if shared:
                    plan = self._planner(planned, 1e9, self._warmup_config())
                    plan = dataclasses.replace(plan, resident=plan.resident | shared)
                    plan.validate(profiles)
                    self.executor.set_plan(plan)
                    return
        if idle:
            plan = self.warmup_plan()
            self._check_fits(plan)
            self.executor.set_plan(plan)

    def _fit_warmup_in_peers_room(self) -> None:
        """A warm-up plan that did not fit the device beside what the model's other graphs hold: they give their
        memory back (:meth:`_evict_peers`) and it is checked again; still too large, the error raised when compiled
        is raised now, before anything is allocated."""
        assert self._unfit is not None
        with self.plan_lock if self.plan_lock is not None else contextlib.nullcontext():
            if not self._evict_peers():
                raise self._unfit
            logger.info("magi offload: a graph's warm-up does not fit next to what the model's other graphs hold on "
                        "%s; they hold nothing until their next call", self.executor.device)
            release_cached_blocks(self.executor.backend)  # what they held is free, not cached
            plan = self.warmup_plan()
            self._check_fits(plan)
            self.executor.set_plan(plan)
            self._unfit = None

    def _idle_peers(self) -> None:
        """Graphs of the model still warming up and not running now hold nothing on the device while this one plans
        (phase ``"idle"``): a graph that ran once and may never run again (a first decoding step, a shape seen
        once) does not keep its warm-up copy buffer next to the plans of the graphs that do run. Its next call
        installs its warm-up plan again. Callers hold the plan lock."""
        for r in self._peers_on_device():
            if r._planned or r.phase == "idle" or not r._warmup_lock.acquire(blocking=False):
                continue  # planned, idle already, or in a call now
            try:
                if not r._planned and r.executor.plan is not None and r.executor.suspend():
                    r.phase = "idle"
                    logger.info("magi offload: a graph of the model still warming up holds nothing on the device "
                                "until its next call (another graph is planning)")
            finally:
                r._warmup_lock.release()

    @property
    def plan(self) -> Plan | None:
        """The plan the executor follows now."""
        return self.executor.plan

    def __call__(self, *args: Any) -> Any:
        """Run one step (the static-plan fast path after warm-up)."""
        if self._planned and not self._measure_steps and not self._replan:
            try:
                return self.executor.run(args, None)
            except ExecutorSuspended:
                pass  # another graph took this one's device memory back: it plans again below
        with self._warmup_lock:
            if self._planned:  # planned while this call waited
                if self._replan or self.executor.plan is None:
                    self._install_plan(args)
                return self._planned_step(args)
            return self._warmup_call(args)

    def _planned_step(self, args: Sequence[Any]) -> Any:
        """A planned step, planned again where another graph took this one's memory back after it was planned (a
        thread calling another graph of the model may do so between this graph's planning and its step). Each graph
        takes memory back at most :data:`_MAX_EVICTIONS` times, so this ends."""
        while True:
            try:
                return self._planned_call(args)
            except ExecutorSuspended:
                self._install_plan(args)

    def _planned_call(self, args: Sequence[Any]) -> Any:
        """A planned step; the second one after planning is measured (the first fills resident copies)."""
        if self._measure_steps == 1 and self._meter.available:
            held = self._held_now()
            with self._meter.measure():
                self._meter.peak = 0
                out = self.executor.run(args, None)
            self.measured_peak_bytes = held + self._meter.peak
            self._measure_steps = 0
            return out
        self._measure_steps = max(0, self._measure_steps - 1)
        return self.executor.run(args, None)

    def _warmup_call(self, args: Sequence[Any]) -> Any:
        self.calls += 1
        w = self.config.warmup_calls
        if (self.calls == 1 and w > 0) or (self.phase == "idle" and self.calls <= w):
            self._warm_up_next_to_peers(args)
        if self.calls > w:
            self._install_static_plan(args)
            return self._planned_step(args)
        timer = None
        if self.calls == w:
            self.phase = "profile"
            self._timer = timer = self._timer_factory(self.executor.n_units)
        self._meter.peak = 0
        with self._meter.measure():
            out = self.executor.run(args, timer)
        # weights a transfer allocates per copy are in the peak: what the plan holds of them comes off
        in_flight = 0 if getattr(self.executor.transfer, "buffer_bytes", 0) else self._plan_peak(self.executor.plan)
        self.activation_bytes = max(0, self._meter.peak - in_flight)
        return out

    def _install_static_plan(self, args: Sequence[Any]) -> None:
        compute_ms = None
        if self._timer is not None:
            compute_ms = [float(x) for x in self._timer.elapsed_ms()]
            if getattr(self.executor.transfer, "collective", False):  # the exchange: one plan on every rank
                compute_ms = broadcast_profiles(compute_ms)
            self._timer = None
        self.profiles = unit_profiles(self.executor.units, compute_ms, self.executor.transfer.nbytes)
        self.bandwidth_Bps = self.executor.transfer.rate(self._bandwidth())
        self.weight_hosts = frozenset(_key(args[w.input_index]) for u in self.executor.units for w in u.weights)
        self._install_plan(args)

    def _install_plan(self, args: Sequence[Any]) -> None:
        """Plan for the device next to the model's other graphs and install the plan (again, when another
        graph made weights resident that this one streamed: they are resident here too from now on)."""
        with self.plan_lock if self.plan_lock is not None else contextlib.nullcontext():
            if self._replan:
                self._replans += 1
                logger.info("magi offload: planning a graph again: another graph of the model keeps weights "
                            "resident that it streams")
            self._replan = False
            self._idle_peers()
            before = {k for r in self._peers_on_device() if r._planned for k in r.resident_hosts}
            buffer_before = _buffer_bytes(self)
            plan = self._plan_for_device(args)
            actions = self.executor.set_plan(plan)
            if self.device_budget_bytes is not None:
                # a copy buffer the plan replaced goes back to the device, not into the allocator's cache, where
                # its fragments could not serve the resident copies and activations the budget counted on
                release_cached_blocks(self.executor.backend)
            self.resident_hosts = {_key(args[i]): int(args[i].nbytes) for i in actions.resident}
            self.predicted_peak_bytes = self._own_bytes() + self.activation_bytes
            self.phase = "planned"
            self._planned = True  # before the lock is let go: the next runtime to plan counts this one
            self._measure_steps = 2
            added = self.resident_hosts.keys() - before
            freed = _buffer_bytes(self) < buffer_before  # the copy buffer its warm-up needed: room for the others
            for r in self._peers_on_device():
                # a graph planned before streams what this one now keeps resident, or planned next to the larger
                # buffer this one needed: it plans again (a bounded number of times, so graphs never take turns
                # re-planning each other)
                streams = r.weight_hosts - r.resident_hosts.keys()
                if r._planned and r._replans < _MAX_REPLANS and streams and (freed or added & streams):
                    r._replan = True
        logger.info(
            "magi offload: %s plan for %d units: %d/%d weight bytes resident, %d streamed per step, "
            "predicted step %.3f ms (stall %.3f ms)",
            plan.policy, self.executor.n_units, actions.resident_bytes, actions.resident_bytes + actions.streamed_bytes,
            actions.streamed_bytes, plan.predicted_step_ms, plan.predicted_stall_ms,
        )

    # -- fitting the device ----------------------------------------------------------------------------
    def _peers_on_device(self) -> list[OffloadRuntime]:
        return [r for r in (self.peers() if self.peers is not None else ())
                if r is not self and r.executor.device == self.executor.device]

    def _own_bytes(self) -> int:
        """Device bytes this runtime's installed plan holds: its resident copies and its copy buffer (or, for a
        transfer that allocates per copy, the plan's weights in flight)."""
        actions = self.executor.actions
        resident = 0 if actions is None else int(actions.resident_bytes)
        buffer = int(getattr(self.executor.transfer, "buffer_bytes", 0))
        return resident + (buffer or self._plan_peak(self.executor.plan, streamed_only=True))

    def _held_now(self) -> int:
        """Device bytes this runtime holds between steps: resident copies, the copy buffer, or (a transfer that
        allocates per copy) the next step's copies carried over."""
        ex = self.executor
        actions = ex.actions
        if actions is None:
            return 0
        held = int(actions.resident_bytes) + int(getattr(ex.transfer, "buffer_bytes", 0))
        if ex.transfer.allocates:
            sizes = {w.input_index: w.nbytes for u in ex.units for w in u.weights}
            held += sum(sizes[w] for b in actions.carry for w in actions.batches[b])
        return held

    @staticmethod
    def _plan_peak(plan: Plan | None, streamed_only: bool = False) -> int:
        if plan is None:
            return 0
        peak = int(plan.notes.get("peak_device_bytes", 0))
        return peak - int(plan.notes.get("resident_bytes", 0)) if streamed_only else peak

    def _room(self, with_peers: bool) -> DeviceRoom | None:
        """The device's room for this model's weights now; ``with_peers``: the other runtimes' resident weights and
        buffers count as the model's (a budget for the whole model), else only the copy buffer this runtime
        would reuse."""
        ex = self.executor
        shared = getattr(ex.transfer, "shared", None)
        held = shared.nbytes if shared is not None else int(getattr(ex.transfer, "buffer_bytes", 0))
        peers = self._peers_on_device()
        activations = max([self.activation_bytes, *(r.activation_bytes for r in peers)])
        if with_peers:
            counted: dict[tuple[int, int], int] = dict(self.resident_hosts)  # planning again: its own count too
            for r in peers:
                counted.update(r.resident_hosts)
                if shared is None or getattr(r.executor.transfer, "shared", None) is not shared:
                    held += _buffer_bytes(r)
            held += sum(counted.values())
        return device_room(ex.backend, ex.device, held, activations, release_cached=with_peers)

    def _check_fits(self, plan: Plan) -> None:
        """Before anything is allocated: a plan streaming one unit after another must fit the device."""
        room = self._room(with_peers=False)
        if room is None or not self.executor.units:
            return
        largest = max(self.executor.units, key=lambda u: u.nbytes)
        check_unit_fits(room, self._footprint(plan), largest.label or largest.attr, largest.nbytes,
                        self.executor.device)

    def _plan_for_device(self, args: Sequence[Any]) -> Plan:
        """The static plan for what the config asks and the device can spare (:meth:`_plan_next_to_peers`); where
        that does not fit next to what the model's other graphs hold, they give it back (:meth:`_evict_peers`) and
        this graph plans with the model's whole budget, less what they need at least to stream."""
        try:
            return self._plan_next_to_peers(args)
        except (ConfigError, DeviceMemoryError) as e:
            if not self._evict_peers():
                raise
            logger.info("magi offload: a graph does not fit next to what the model's other graphs hold on %s (%s); "
                        "they hold nothing until their next call, which plans them again next to this one",
                        self.executor.device, e)
            return self._plan_next_to_peers(args)

    def _evict_peers(self) -> bool:
        """Take the device memory of the model's other planned graphs back: each drops its resident copies and copy
        buffer (after the work queued on them) and plans again at its next call, next to this graph's plan, which
        keeps the room it needs to stream everything (:meth:`_stream_floor`). A prefill that filled the budget
        first no longer starves the decoding step. False where no graph gave anything back, or this graph took
        memory back :data:`_MAX_EVICTIONS` times already. Callers hold the plan lock."""
        if self._evictions >= _MAX_EVICTIONS:
            return False
        evicted = False
        for r in self._peers_on_device():
            if not r._planned or r.executor.plan is None:
                continue
            if not r.executor.suspend():  # a transfer that must keep step with other ranks keeps its plan
                continue
            r._replan = True
            r.phase = "yielded"
            r.resident_hosts = {}
            r.predicted_peak_bytes = None
            evicted = True
        self._evictions += evicted
        return evicted

    def _stream_floor(self) -> int:
        """Device bytes this graph needs at least to run: its look-ahead plan with nothing resident."""
        return self._footprint(self.warmup_plan())

    def _footprint(self, plan: Plan) -> int:
        """Device bytes ``plan``'s streamed weights take: the copy buffer it needs, or (a transfer that allocates per
        copy) the plan's peak."""
        _, buffer = self.executor.footprint(plan)
        return buffer or self._plan_peak(plan)

    def _plan_next_to_peers(self, args: Sequence[Any]) -> Plan:
        """The static plan for what the config asks and the device can spare, next to the model's other graphs.

        No ratio and no budget: the fastest plan within the device's room, then the least memory that keeps its
        step (:meth:`_least_memory`). A share (``"80%"``) becomes bytes of the device's total. A ratio whose plan
        holds more than the room degrades to the fastest plan that fits it, with a warning.
        """
        assert self.profiles is not None and self.bandwidth_Bps is not None
        config = self.config
        room = self._room(with_peers=True)
        self.device_budget_bytes = None
        if config.fits_card:
            if room is None:  # the device's size is unknown: stream everything
                return self._fit_config(config.replace(gpu_resident_weight_ratio=0.0), args)
            if room.spare <= 0:
                raise self._no_room(room, None)
            self.device_budget_bytes = room.spare
            try:
                plan = self._fit_config(config.replace(device_memory_budget_bytes=room.spare), args)
            except ConfigError as e:
                raise self._no_room(room, e) from e
            return self._least_memory(plan, config, room.spare, args)
        if isinstance(config.device_memory_budget_bytes, str):
            config = config.replace(device_memory_budget_bytes=config.budget_bytes(room.total if room else None))
        self.device_budget_bytes = config.budget_bytes(None)
        if self.device_budget_bytes is not None and room is not None and self.device_budget_bytes > room.spare:
            logger.warning(
                "magi offload: OffloadConfig.device_memory_budget_bytes=%d is more than %s can spare (%s); "
                "device memory may run out", self.device_budget_bytes, self.executor.device, room.describe())
        plan = self._fit_config(config, args)
        if room is None or config.gpu_resident_weight_ratio is None or self.device_budget_bytes is not None:
            return plan
        holds = self._holds(plan, args, self._peer_held())
        if holds <= room.spare:
            return plan
        logger.warning(
            "magi offload: OffloadConfig.gpu_resident_weight_ratio=%g holds %.3f GiB on %s, which can spare %s; "
            "planning the fastest plan that fits instead (set no ratio to fit the card without this warning)",
            config.gpu_resident_weight_ratio, holds / 2**30, self.executor.device, room.describe())
        self.device_budget_bytes = room.spare
        try:
            return self._fit_config(
                config.replace(gpu_resident_weight_ratio=None, device_memory_budget_bytes=room.spare), args)
        except ConfigError as e:
            raise self._no_room(room, e) from e

    def _fit_config(self, config: OffloadConfig, args: Sequence[Any]) -> Plan:
        """The plan :meth:`_fit` chooses for ``config`` next to the model's other runtimes (nothing installed)."""
        assert self.profiles is not None and self.bandwidth_Bps is not None
        profiles, cfg, shared, held = self._share_with_peers(self.profiles, args, config)
        return self._fit(profiles, self.bandwidth_Bps, cfg, shared, held, args)

    def _least_memory(self, fastest: Plan, config: OffloadConfig, spare: int, args: Sequence[Any]) -> Plan:
        """The plan holding less device memory whose predicted step is within :data:`_SAME_STEP` of ``fastest``'s:
        fitting the card never takes memory a step does not use.

        A policy that notes what its plan needs resident to reach its step (``needed_resident_bytes``; HEURISTIC
        does, the rest of its residency only fills the budget) is planned again with the budget less the filler
        (plus room for two units in flight; then less half of it, if that was too slow); a policy that does not
        keeps ``fastest``.
        """
        needed = fastest.notes.get("needed_resident_bytes")
        resident = fastest.notes.get("resident_bytes", 0.0)
        if needed is None or needed >= resident:
            return fastest
        held = self._peer_held()
        target = fastest.predicted_step_ms * (1 + _SAME_STEP) + 1e-9
        full = self._holds(fastest, args, held)
        filler = int(resident - needed)
        # units no longer resident stream: room for two of them in flight
        room = 2 * max((u.nbytes for u in self.executor.units), default=0)
        for budget in (full - filler + room, full - filler // 2):
            # fewer resident weights can need a larger copy buffer: a plan is taken only when it holds less than
            # the fastest one, within what the device can spare
            budget = min(budget, spare, full - 1)
            if budget <= 0:
                continue
            try:
                plan = self._fit_config(config.replace(device_memory_budget_bytes=budget), args)
            except ConfigError:
                continue
            holds = self._holds(plan, args, held)
            if plan.predicted_step_ms <= target and holds < full:
                logger.info("magi offload: the fastest plan within %d bytes holds %d; %d hold the same step",
                            spare, full, holds)
                return plan
        return fastest

    def _peer_held(self) -> dict[tuple[int, int], int]:
        held: dict[tuple[int, int], int] = {}
        for r in self._peers_on_device():
            if r._planned:
                held.update(r.resident_hosts)
        return held

    def _holds(self, plan: Plan, args: Sequence[Any], held: dict[tuple[int, int], int]) -> int:
        """Device bytes the plan would add: its new resident weights and the copy buffer (a buffer shared
        with the peers: the larger of their plans' need and this one's)."""
        actions, buffer = self.executor.footprint(plan)
        new = {_key(args[i]): int(args[i].nbytes) for i in actions.resident if _key(args[i]) not in held}
        streamed = buffer or self._plan_peak(plan, streamed_only=True)
        return sum(new.values()) + max(streamed, self._peer_buffer)

    def _no_room(self, room: DeviceRoom, cause: ConfigError | None) -> DeviceMemoryError:
        units = self.executor.units
        largest = max(units, key=lambda u: u.nbytes) if units else None
        what = (f"; its largest unit {largest.label or largest.attr!r} holds {largest.nbytes} bytes"
                if largest is not None else "")
        return DeviceMemoryError(
            f"this model's weights do not fit what {self.executor.device} can spare: {room.describe()}{what}"
            + (f" ({cause})" if cause is not None else "")
            + ". Split units further with OffloadConfig(max_unit_bytes=...), lower the activations (a smaller batch, "
            "resolution or sequence), free device memory, or use a larger device"
        )

    def _fit(self, profiles: list[UnitProfile], bandwidth_Bps: float, config: OffloadConfig, shared: frozenset[int],
             held: dict[tuple[int, int], int], args: Sequence[Any]) -> Plan:
        """Plan and install; under ``device_memory_budget_bytes``, the plan whose real footprint fits: its new
        resident weights plus the copy buffer its batches need (fixed places can need a unit more than the plan's
        own peak, e.g. when an odd number of batches cycle through two places), found by planning with less.

        Candidates are measured, not installed (:meth:`OffloadExecutor.footprint`): the planner's budget first
        drops by what the plan held beyond its prediction, then is bisected back up between the largest budget
        that fitted and the smallest that did not; the fitting plan with the shortest predicted step is installed.
        """
        limit = config.budget_bytes(None)
        if limit is None:
            return self._plan(profiles, bandwidth_Bps, config, shared)

        def holds(plan: Plan) -> int:
            return self._holds(plan, args, held)

        streamed_plans: list[Plan] | None = None

        def streaming() -> list[Plan]:
            """Plans keeping nothing resident but what the peers hold: the policy's own (no budget: its copies
            as far ahead as pays), then the look-ahead plan (the fewest copies in flight); planned once."""
            nonlocal streamed_plans
            if streamed_plans is None:
                streamed_plans = []
                for cfg in (config.replace(device_memory_budget_bytes=None, gpu_resident_weight_ratio=0.0),
                            config.replace(policy=Policy.BASE, device_memory_budget_bytes=None,
                                           gpu_resident_weight_ratio=0.0)):
                    with contextlib.suppress(ConfigError):
                        streamed_plans.append(self._plan(profiles, bandwidth_Bps, cfg, shared))
            return streamed_plans

        def stream_fit() -> Plan | None:
            """The first streaming plan that fits the limit."""
            return next((p for p in streaming() if holds(p) <= limit), None)

        def too_small(cause: ConfigError | None) -> ConfigError:
            """The error for a limit nothing fits, naming what streaming every weight really holds at least (its
            copy buffer included, which the planner's own minimum leaves out)."""
            plans = streaming()
            if not plans:  # not even streaming plans: the planner's own reason
                return cause or ConfigError(f"no plan streams this graph's weights on {self.executor.device}")
            # the planner's peak of weights in flight, or the copy buffer they cycle through where larger
            need = min(max(int(p.notes.get("peak_device_bytes", 0)), holds(p)) for p in plans)
            return ConfigError(
                f"OffloadConfig.device_memory_budget_bytes={self.config.device_memory_budget_bytes} is too small "
                f"for this graph on {self.executor.device} ({limit} bytes left for it): streaming every weight "
                f"holds at least {need} bytes on the device, the units' weights in flight and the copy buffer they "
                f"cycle through; raise it to at least {need} (plus activations), or split units further with "
                "max_unit_bytes" + (f". {self._peer_note}" if self._peer_note else "")
            )

        fits: list[Plan] = []
        # ok: the largest planning budget known to fit or to be too small to plan at all; failed: the smallest
        # whose plan held more than the limit
        budget, ok, failed, extra, used = limit, 0, None, 0, 0
        too_small_error: ConfigError | None = None
        for _ in range(_FIT_ROUNDS):
            try:
                plan = self._plan(profiles, bandwidth_Bps, config.replace(device_memory_budget_bytes=budget), shared)
            except ConfigError as e:
                if budget >= limit or failed is None:
                    # the planner's peak counts copies for the next step a fixed buffer may hold in place: what
                    # streaming everything really holds decides
                    streamed = stream_fit()
                    if streamed is None:
                        raise too_small(e) from e
                    fits.append(streamed)
                    break
                too_small_error, ok = e, budget  # a shrink went below what streaming needs: bisect back up
            else:
                used = holds(plan)
                if used <= limit:
                    fits.append(plan)
                    ok = budget
                else:
                    failed = budget
                    predicted = plan.notes.get("peak_device_bytes")
                    extra = max(extra, used - int(predicted) if predicted is not None else used - limit)
            if failed is None or failed - ok <= limit * _FIT_RESOLUTION:
                break
            # less by what the plans held beyond their prediction (at least this one's excess), then bisect up
            tried = budget
            budget = (ok + failed) // 2 if fits or ok else min(limit - extra, budget - (used - limit))
            if budget <= 0:
                break
            logger.info("magi offload: planned for %d bytes, the plan holds %d with its copy buffer (budget %d); "
                        "planning for %d", tried, used, limit, budget)
        if not fits:
            # the rounds ran out between too small to plan and too large to fit: stream all but what the peers hold
            streamed = stream_fit()
            if streamed is not None:
                fits.append(streamed)
        if not fits:
            raise too_small(too_small_error)
        # the fastest; among plans as fast, the one copying least per step
        return min(fits, key=lambda p: (p.predicted_step_ms, -p.notes.get("resident_bytes", 0.0)))

    def _plan(self, profiles: list[UnitProfile], bandwidth_Bps: float, config: OffloadConfig,
              shared: frozenset[int]) -> Plan:
        """The planner's plan, with the units the peers keep resident resident here too."""
        try:
            plan = self._planner(profiles, bandwidth_Bps, config)
        except ConfigError as e:
            if not self._peer_note:
                raise
            raise ConfigError(f"{e}. {self._peer_note}") from e
        if shared:
            plan = dataclasses.replace(plan, resident=plan.resident | shared)
            plan.validate(self.profiles or profiles)
        return plan

    def _share_with_peers(
        self, profiles: list[UnitProfile], args: Sequence[Any], config: OffloadConfig
    ) -> tuple[list[UnitProfile], OffloadConfig, frozenset[int], dict[tuple[int, int], int]]:
        """Profiles and config to plan with next to the model's other planned runtimes on this device, and the
        units whose weights those keep resident already (resident here too, at no cost: planned as weightless),
        and the host tensors those keep resident (with their bytes).

        The resident cap of ``gpu_resident_weight_ratio`` shrinks by this graph's weights the others keep (planned as
        :attr:`~magi_core.config.OffloadConfig.planned_resident_share` of the rest; the ratio keeps its meaning);
        ``device_memory_budget_bytes`` by everything the others hold (resident weights, copy buffers), except the
        copy buffer this runtime shares with them, whose room it plans with as its own (:meth:`_fit` counts it).
        """
        on_device = self._peers_on_device()
        peers = [r for r in on_device if r._planned]
        # copy buffers: one shared by the runtimes whose transfers share it (its size: their largest plan's, a
        # graph still warming up included: its buffer stays allocated next to this plan's resident weights)
        shared_buf = getattr(self.executor.transfer, "shared", None)
        same = [r for r in on_device if shared_buf is not None and getattr(r.executor.transfer, "shared", None)
                is shared_buf]
        # copies allocated per fetch live only during their graph's step, and steps of one model never overlap:
        # like a shared buffer, the largest need counts, not the sum
        transient = [r for r in on_device if r not in same and r.executor.transfer.allocates]
        self._peer_buffer = max((_needs_bytes(r) for r in (*same, *transient)), default=0)
        buffers = sum(_needs_bytes(r) for r in on_device if r not in same and r not in transient)
        if not peers and not buffers:
            return profiles, config, frozenset(), {}
        held: dict[tuple[int, int], int] = {}
        for r in peers:
            held.update(r.resident_hosts)
        units = self.executor.units
        owner = weight_owners(units)
        owned: dict[int, list[int]] = {}
        mine: dict[tuple[int, int], int] = {}
        for u in units:
            for w in u.weights:
                mine[_key(args[w.input_index])] = w.nbytes
                if owner[w.input_index] == u.index:
                    owned.setdefault(u.index, []).append(w.input_index)
        shared = frozenset(u for u, ws in owned.items()
                           if profiles[u].weight_bytes > 0 and all(_key(args[i]) in held for i in ws))
        planned = [dataclasses.replace(p, weight_bytes=0) if p.index in shared else p for p in profiles]
        cfg = config
        budget = cfg.budget_bytes(None)
        if budget is not None:
            others = sum(held.values()) + buffers
            self._peer_note = (
                f"{len(peers)} other compiled graph(s) of this model (other input shapes or graph breaks) already "
                f"hold {others + self._peer_buffer} bytes of the budget ({budget}) on {self.executor.device}, "
                f"{self._peer_buffer} of them in the copy buffer they share with it: raise the budget, call the "
                "model with fewer input shapes (pad them, or torch.compile(dynamic=True) so one graph serves them), "
                "or release the model and offload again"
            )
            if others >= budget and any(p.weight_bytes for p in planned):
                raise ConfigError(f"OffloadConfig.device_memory_budget_bytes={budget} is spent: {self._peer_note}")
            cfg = cfg.replace(device_memory_budget_bytes=max(1, budget - others))  # 1: nothing left to place
        else:
            total = sum(p.weight_bytes for p in profiles)
            left = sum(p.weight_bytes for p in planned)
            cap = max(0.0, cfg.resident_ratio * total - sum(mine[k] for k in mine if k in held))
            cfg = cfg.planning_rest(cap / left if left else 0.0)  # the ratio itself stays a share of all weights
        logger.info("magi offload: %d unit(s) already resident for %d other graph(s) of this model; planning with %s",
                    len(shared), len(peers), f"a budget of {cfg.device_memory_budget_bytes} bytes" if budget is not None
                    else f"{cfg.planned_resident_share:.4f} of the rest resident")
        return planned, cfg, shared, held

    def close(self) -> None:
        """Release the executor's device weights."""
        self.executor.close()


def _key(t: torch.Tensor) -> tuple[int, int]:
    """Which host tensor (object and data) a weight argument is: what resident copies are shared by."""
    return id(t), t.data_ptr()


def _buffer_bytes(runtime: OffloadRuntime) -> int:
    """Bytes of the copy buffer a runtime's installed plan needs (0 for a transfer that allocates per copy)."""
    return int(getattr(runtime.executor.transfer, "buffer_bytes", 0))


def _needs_bytes(runtime: OffloadRuntime) -> int:
    """Device bytes a runtime's copies need: its copy buffer, or the weights in flight of a transfer that allocates
    per copy; or what it needs at least once it plans again, where it gave its memory back to another graph."""
    if runtime.phase == "yielded":
        return runtime._stream_floor()
    if runtime.executor.transfer.allocates:
        return OffloadRuntime._plan_peak(runtime.executor.plan, streamed_only=True)
    return _buffer_bytes(runtime)
