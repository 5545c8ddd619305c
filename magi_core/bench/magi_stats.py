"""What the benchmark reads from an offloaded model's handle: units, resident / streamed bytes, plan, host weights."""

from __future__ import annotations

from typing import Any

from torch import nn

from magi_core.api import handle
from magi_core.api import release as api_release


def step_info(model: nn.Module) -> dict[str, Any]:
    """Units, resident / streamed bytes per step, plan and bandwidth of the model's newest runtime (empty if none)."""
    h = handle(model)
    live = h.runtimes
    if not live:
        return {}
    rt = live[-1]
    s = h.stats()[-1]
    info: dict[str, Any] = {"units": s.units, "magi_phase": s.phase, "compile_count": h.compile_count}
    if s.resident_bytes is not None and s.streamed_bytes_per_step is not None:
        info["resident_bytes"] = s.resident_bytes
        info["streamed_bytes"] = s.streamed_bytes_per_step
    plan = rt.plan
    if plan is not None:
        info["plan_policy"] = str(plan.policy)
        info["plan_resident_units"] = len(plan.resident)
        info["predicted_step_ms"] = plan.predicted_step_ms
        info["predicted_stall_ms"] = plan.predicted_stall_ms
    if s.bandwidth_GBps is not None:
        info["runtime_bandwidth_GBps"] = s.bandwidth_GBps
    return info


def static_info(model: nn.Module) -> dict[str, Any]:
    """Figures known once set up: pinned and weight bytes of the host arena and its setup timings."""
    hw = handle(model).host
    if hw is None:
        return {}
    info: dict[str, Any] = {"pinned_bytes": int(hw.pinned_bytes), "host_weight_bytes": int(hw.weight_bytes)}
    timings = hw.report.get("timings")
    if isinstance(timings, dict):
        info["host_timings_s"] = {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}
    return info


def release(model: nn.Module) -> None:
    """Free everything offloading made for the model, so no registered range or mapping is left behind."""
    api_release(model)
