"""Pure planning: turn per-unit profiles and the measured bandwidth into a :class:`~magi_core.plan.contract.Plan`.

Policies: BASE and COST_EFFECTIVE (:mod:`.lookahead`), HEURISTIC (:mod:`.heuristic`), and any added through
:func:`register_policy` or the ``magi.policies`` entry-point group. :func:`simulate` predicts a plan's
step time, stall and peak device bytes. No device is touched here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from magi_core.plan.common import planning_bandwidth, ratio_cap
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plan.heuristic import (
    HeuristicScheduler,
    best_step_ms,
    heuristic_plan,
    stall_removing_residency,
)
from magi_core.plan.lookahead import BaseScheduler, CostEffectiveScheduler, lookahead_plan
from magi_core.plan.registry import (
    POLICY_ENTRY_POINT_GROUP,
    Scheduler,
    SchedulerFactory,
    get_scheduler,
    known_policies,
    register_policy,
    reload_policies,
    unregister_policy,
)
from magi_core.plan.simulate import SimResult, simulate, transfer_ms

if TYPE_CHECKING:
    from magi_core.config import OffloadConfig


def build_plan(profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
    """Plan with ``config.policy`` from profiles (execution order) and the *measured* bandwidth in bytes/s.

    The scheduler applies ``config.bandwidth_safety_factor``; the returned plan is validated.
    """
    plan = get_scheduler(str(config.policy)).plan(list(profiles), bandwidth_Bps, config)
    plan.validate(profiles)
    return plan


#: Alias of :func:`build_plan`.
make_plan = build_plan


__all__ = [
    "POLICY_ENTRY_POINT_GROUP",
    "BaseScheduler",
    "CostEffectiveScheduler",
    "HeuristicScheduler",
    "Scheduler",
    "SchedulerFactory",
    "SimResult",
    "best_step_ms",
    "get_scheduler",
    "heuristic_plan",
    "known_policies",
    "lookahead_plan",
    "build_plan",
    "make_plan",
    "planning_bandwidth",
    "ratio_cap",
    "register_policy",
    "reload_policies",
    "simulate",
    "stall_removing_residency",
    "transfer_ms",
    "unregister_policy",
]
