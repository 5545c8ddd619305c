"""The warm-up state machine around an :class:`~magi_core.execute.executor.OffloadExecutor`.

With ``warmup_calls = w`` (config): calls ``1 .. w-1`` run a simple look-ahead plan (BASE, nothing
resident); call ``w`` runs the same plan while a unit timer records each unit's compute on the compute
stream (events only, no barrier per unit); call ``w + 1`` reads the timings, measures the host-to-device
bandwidth (once per process, cached; rank 0's figure under torch.distributed) and installs the policy's
static plan, which every later call follows. ``w = 0`` plans on the first call from weight sizes alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from magi_core.config import OffloadConfig, Policy
from magi_core.execute.actions import unit_profiles
from magi_core.execute.executor import OffloadExecutor
from magi_core.execute.profiler import UnitTimer, broadcast_profiles, measure_h2d_bandwidth
from magi_core.plan import build_plan
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

Planner = Callable[[Sequence[UnitProfile], float, OffloadConfig], Plan]
BandwidthFn = Callable[[], float]

_bw_lock = threading.Lock()
_bw_cache: dict[tuple[str, int], float] = {}


def cached_bandwidth(backend: Backend, device: torch.device, config: OffloadConfig) -> float:
    """Host-to-device bandwidth in bytes/s, measured once per process and device (broadcast from rank 0)."""
    nbytes = config.probe_bytes(backend.is_accelerator)
    key = (str(device), nbytes)
    with _bw_lock:
        if key not in _bw_cache:
            _bw_cache[key] = float(measure_h2d_bandwidth(nbytes=nbytes, backend=backend, device=device))
            logger.info("magi offload: host-to-device bandwidth %.2f GB/s (%d B probe)", _bw_cache[key] / 1e9, nbytes)
        return _bw_cache[key]


def default_planner(profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
    """The registered scheduler for ``config.policy``."""
    return build_plan(list(profiles), bandwidth_Bps, config)


class OffloadLifecycle:
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
        if config.warmup_calls > 0:
            executor.set_plan(self.warmup_plan())

    def _default_timer(self, n_units: int) -> Any:
        return UnitTimer(n_units, backend=self.executor.backend)

    def warmup_plan(self) -> Plan:
        """BASE look-ahead with nothing resident (weights in profile order, compute unknown)."""
        cfg = self.config.replace(policy=Policy.BASE, gpu_resident_weight_ratio=0.0, device_memory_budget_bytes=None)
        profiles = unit_profiles(self.executor.units, None, self.executor.transfer.nbytes)
        return self._planner(profiles, 1e9, cfg)

    @property
    def plan(self) -> Plan | None:
        """The plan the executor follows now."""
        return self.executor.plan

    def __call__(self, *args: Any) -> Any:
        """Run one step (the static-plan fast path after warm-up)."""
        if self._planned:
            return self.executor.run(args, None)
        with self._warmup_lock:
            if self._planned:  # planned while this call waited
                return self.executor.run(args, None)
            return self._warmup_call(args)

    def _warmup_call(self, args: Sequence[Any]) -> Any:
        self.calls += 1
        w = self.config.warmup_calls
        if self.calls > w:
            self._install_static_plan()
            return self.executor.run(args, None)
        if self.calls == w:
            self.phase = "profile"
            self._timer = self._timer_factory(self.executor.n_units)
            return self.executor.run(args, self._timer)
        return self.executor.run(args, None)

    def _install_static_plan(self) -> None:
        compute_ms = None
        if self._timer is not None:
            compute_ms = broadcast_profiles([float(x) for x in self._timer.elapsed_ms()])
            self._timer = None
        self.profiles = unit_profiles(self.executor.units, compute_ms, self.executor.transfer.nbytes)
        self.bandwidth_Bps = self.executor.transfer.rate(self._bandwidth())
        plan = self._planner(self.profiles, self.bandwidth_Bps, self.config)
        actions = self.executor.set_plan(plan)
        self.phase = "planned"
        self._planned = True
        logger.info(
            "magi offload: %s plan for %d units: %d/%d weight bytes resident, %d streamed per step, "
            "predicted step %.3f ms (stall %.3f ms)",
            plan.policy, self.executor.n_units, actions.resident_bytes, actions.resident_bytes + actions.streamed_bytes,
            actions.streamed_bytes, plan.predicted_step_ms, plan.predicted_stall_ms,
        )

    def close(self) -> None:
        """Release the executor's device weights."""
        self.executor.close()
