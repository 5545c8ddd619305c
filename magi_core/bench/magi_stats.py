"""What the benchmark reads from magi-core's offload runtime: units, resident / streamed bytes, plan, host weights."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)


class RuntimeWatch:
    """Finds the offload runtimes (one per Dynamo graph) compiled after this watch was created."""

    def __init__(self) -> None:
        self._before = {id(r) for r in _live()}

    def newest(self) -> Any | None:
        """The most recently compiled runtime since the watch started (the one serving the last shape), or None."""
        fresh = [r for r in _live() if id(r) not in self._before]
        return fresh[-1] if fresh else None

    def step_info(self) -> dict[str, Any]:
        """Units, resident / streamed bytes per step, plan and bandwidth of the newest runtime (empty if none)."""
        rt = self.newest()
        if rt is None:
            return {}
        ex = rt.executor
        info: dict[str, Any] = {"units": ex.n_units, "magi_phase": rt.phase}
        actions = getattr(ex, "actions", None)
        if actions is not None:
            info["resident_bytes"] = int(actions.resident_bytes)
            info["streamed_bytes"] = int(actions.streamed_bytes)
        plan = rt.plan
        if plan is not None:
            info["plan_policy"] = str(plan.policy)
            info["plan_resident_units"] = len(plan.resident)
            info["predicted_step_ms"] = plan.predicted_step_ms
            info["predicted_stall_ms"] = plan.predicted_stall_ms
        if rt.bandwidth_Bps is not None:
            info["runtime_bandwidth_GBps"] = rt.bandwidth_Bps / 1e9
        return info


def _live() -> list[Any]:
    from magi_core.runtime.compile_backend import live_runtimes

    return live_runtimes()


def host_weights(model: nn.Module) -> Any | None:
    """The :class:`~magi_core.host.HostWeights` that ``magi_core.offload`` attached to ``model``, or None."""
    from magi_core.runtime.api import host_weights as api_host_weights

    return api_host_weights(model)


def static_info(model: nn.Module) -> dict[str, Any]:
    """Figures known once set up: pinned and weight bytes of the host arena and its setup timings."""
    hw = host_weights(model)
    if hw is None:
        return {}
    info: dict[str, Any] = {"pinned_bytes": int(hw.pinned_bytes), "host_weight_bytes": int(hw.weight_bytes)}
    timings = hw.report.get("timings") if isinstance(getattr(hw, "report", None), dict) else None
    if isinstance(timings, dict):
        info["host_timings_s"] = {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}
    return info


def release(model: nn.Module) -> None:
    """Unpin and unmap the model's host weights so no registered range or mapping is left behind."""
    from magi_core.runtime.api import release as api_release

    api_release(model)
