"""BASE and COST_EFFECTIVE: look-ahead prefetch, differing only in which units stay resident."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from magi_core.plan.common import (
    assemble,
    fill,
    least_compute_per_byte,
    lookahead_triggers,
    plan_with_limits,
    planning_bandwidth,
)
from magi_core.plan.contract import Plan, UnitProfile

if TYPE_CHECKING:
    from magi_core.config import OffloadConfig


def lookahead_plan(
    policy: str, profiles: Sequence[UnitProfile], resident: frozenset[int], lookahead: int, bandwidth_Bps: float
) -> Plan:
    """A look-ahead plan for a given resident set (``bandwidth_Bps`` already includes the safety factor)."""
    prefetch_at, next_step = lookahead_triggers(profiles, resident, lookahead)
    return assemble(policy, profiles, resident, prefetch_at, next_step, bandwidth_Bps, {"lookahead": float(lookahead)})


class BaseScheduler:
    """BASE: keep the first units (in execution order) that fit the resident budget, prefetch the rest
    ``lookahead`` streamed units ahead. At ratio 0 nothing is resident. Compute times are not needed."""

    name = "BASE"

    def plan(self, profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
        """Plan from ``profiles`` at the measured ``bandwidth_Bps`` (safety factor applied here)."""
        bw = planning_bandwidth(bandwidth_Bps, config)
        order = [p.index for p in profiles]
        def build(cap: int) -> Plan:
            return lookahead_plan(self.name, profiles, fill(order, profiles, cap), config.lookahead, bw)

        return plan_with_limits(profiles, config, build)


class CostEffectiveScheduler:
    """COST_EFFECTIVE: keep resident the units with the least compute per weight byte (their copies are the
    hardest to hide) up to the resident budget; prefetch the rest ``lookahead`` streamed units ahead."""

    name = "COST_EFFECTIVE"

    def plan(self, profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
        """Plan from ``profiles`` at the measured ``bandwidth_Bps`` (safety factor applied here)."""
        bw = planning_bandwidth(bandwidth_Bps, config)
        order = least_compute_per_byte(profiles)
        def build(cap: int) -> Plan:
            return lookahead_plan(self.name, profiles, fill(order, profiles, cap), config.lookahead, bw)

        return plan_with_limits(profiles, config, build)
