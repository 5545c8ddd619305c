"""Pieces every built-in scheduler uses: residency caps, look-ahead triggers, plan assembly, budget fitting."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from magi_core.errors import ConfigError
from magi_core.plan.contract import STEP_START, Plan, UnitProfile, check_profiles
from magi_core.plan.simulate import simulate

if TYPE_CHECKING:
    from magi_core.config import OffloadConfig

logger = logging.getLogger(__name__)
_MAX_FIT_ROUNDS = 64


def planning_bandwidth(bandwidth_Bps: float, config: OffloadConfig) -> float:
    """The bandwidth schedulers plan with: the measured figure times ``config.bandwidth_safety_factor``."""
    if not (isinstance(bandwidth_Bps, (int, float)) and bandwidth_Bps > 0):
        raise ValueError(f"measured bandwidth must be > 0 bytes/s, got {bandwidth_Bps!r}; rerun the bandwidth probe")
    return float(bandwidth_Bps) * config.bandwidth_safety_factor


def ratio_cap(profiles: Sequence[UnitProfile], ratio: float) -> int:
    """Resident byte cap for a share of the weights planned (``config.planned_resident_share``):
    ``floor(ratio * all weight bytes of profiles)``."""
    return math.floor(ratio * sum(p.weight_bytes for p in profiles))


def fill(order: Iterable[int], profiles: Sequence[UnitProfile], cap: int, chosen: Iterable[int] = ()) -> frozenset[int]:
    """Add units in ``order`` (skipping those without weights or that no longer fit) while the bytes fit ``cap``."""
    kept = set(chosen)
    used = sum(profiles[u].weight_bytes for u in kept)
    for u in order:
        nbytes = profiles[u].weight_bytes
        if u in kept or nbytes == 0 or used + nbytes > cap:
            continue
        kept.add(u)
        used += nbytes
    return frozenset(kept)


def least_compute_per_byte(profiles: Sequence[UnitProfile]) -> list[int]:
    """Units with weights, least compute per weight byte first (ties: more bytes first, then lower index)."""
    units = [p for p in profiles if p.weight_bytes > 0]
    return [p.index for p in sorted(units, key=lambda p: (p.compute_ms / p.weight_bytes, -p.weight_bytes, p.index))]


def streamed_units(profiles: Sequence[UnitProfile], resident: frozenset[int]) -> list[int]:
    """Non-resident units with weights, in execution order."""
    return [p.index for p in profiles if p.weight_bytes > 0 and p.index not in resident]


def next_step_eligible(profiles: Sequence[UnitProfile], units: Sequence[int]) -> int:
    """How many leading ``units`` may be prefetched during the previous step's last unit (not in use there)."""
    n = len(profiles)
    k = 0
    while k < len(units) and profiles[units[k]].freed_after < n - 1:
        k += 1
    return k


def lookahead_triggers(
    profiles: Sequence[UnitProfile], resident: frozenset[int], lookahead: int
) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
    """``prefetch_at`` and ``next_step`` for look-ahead prefetch of the next ``lookahead`` streamed units.

    Streamed unit ``o[m]`` is issued when ``o[m - lookahead]`` is launched; the first ``lookahead`` at step
    start, and in steady state during the previous step's last unit.
    """
    order = streamed_units(profiles, resident)
    at: dict[int, list[int]] = {i: [] for i in range(-1, len(profiles))}
    for m, j in enumerate(order):
        at[order[m - lookahead] if m >= lookahead else STEP_START].append(j)
    head = order[:lookahead]
    next_step = tuple(head[: next_step_eligible(profiles, head)])
    return {i: tuple(v) for i, v in at.items()}, next_step


def assemble(
    policy: str,
    profiles: Sequence[UnitProfile],
    resident: frozenset[int],
    prefetch_at: dict[int, tuple[int, ...]],
    next_step: tuple[int, ...],
    bandwidth_Bps: float,
    notes: dict[str, float] | None = None,
    next_step_at: int = -1,
) -> Plan:
    """Build a :class:`Plan` and fill its predictions from :func:`simulate` at ``bandwidth_Bps`` (steady state)."""
    draft = Plan(policy=policy, resident=resident, prefetch_at=prefetch_at, next_step=next_step,
                 next_step_at=next_step_at)
    sim = simulate(draft, profiles, bandwidth_Bps)
    resident_bytes = sum(profiles[u].weight_bytes for u in resident)
    all_notes = {
        "bandwidth_Bps": bandwidth_Bps,
        "resident_bytes": float(resident_bytes),
        "streamed_bytes": float(sum(p.weight_bytes for p in profiles) - resident_bytes),
        "peak_device_bytes": float(sim.peak_device_bytes),
        **(notes or {}),
    }
    return Plan(
        policy=policy,
        resident=resident,
        prefetch_at=prefetch_at,
        next_step=next_step,
        next_step_at=next_step_at,
        predicted_stall_ms=sim.stall_ms,
        predicted_step_ms=sim.step_ms,
        notes=all_notes,
    )


def plan_with_limits(
    profiles: Sequence[UnitProfile],
    config: OffloadConfig,
    build: Callable[[int], Plan],
    fallback: Callable[[], Plan] | None = None,
) -> Plan:
    """Run ``build(resident_cap)`` under the config's ratio, or fit ``device_memory_budget_bytes``.

    With a budget, the resident cap starts at the budget and, while the plan's predicted peak does not fit,
    drops to the plan's resident bytes less the excess (a cap between two units' sizes would change nothing:
    shrinking the cap itself by a small excess could take hundreds of rounds); if even nothing resident does
    not fit, ``fallback()`` (if any) is tried, then :class:`ConfigError` says how much the budget must be.
    """
    check_profiles(profiles)
    budget = config.device_memory_budget_bytes
    if isinstance(budget, str):
        raise ConfigError(
            f"OffloadConfig.device_memory_budget_bytes={budget!r} is a share of the device's memory: plan with it "
            "in bytes (config.replace(device_memory_budget_bytes=config.budget_bytes(device_total)))"
        )
    if budget is None:
        cap = ratio_cap(profiles, config.planned_resident_share)
        plan = build(cap)
        plan.notes["resident_budget_bytes"] = float(cap)
        return plan
    total = sum(p.weight_bytes for p in profiles)
    smallest = min((p.weight_bytes for p in profiles if p.weight_bytes > 0), default=1)
    cap = min(budget, total)
    tried: set[int] = set()
    while cap not in tried:
        tried.add(cap)
        plan = build(cap)
        peak = int(plan.notes["peak_device_bytes"])
        if peak <= budget:
            plan.notes["resident_budget_bytes"] = float(cap)
            return plan
        held = sum(profiles[u].weight_bytes for u in plan.resident)
        cap = 0 if len(tried) >= _MAX_FIT_ROUNDS else max(0, min(cap, held) - max(peak - budget, smallest))
    candidates = [plan] + ([fallback()] if fallback is not None else [])
    fits = [p for p in candidates if p.notes["peak_device_bytes"] <= budget]
    if fits:
        fits[0].notes["resident_budget_bytes"] = 0.0
        return fits[0]
    need = int(min(p.notes["peak_device_bytes"] for p in candidates))
    raise ConfigError(
        f"OffloadConfig.device_memory_budget_bytes={budget} is too small: streaming with nothing resident needs "
        f"{need} bytes of weights on the device; raise the budget to at least {need} (plus activations), or "
        "split units further with max_unit_bytes"
    )
