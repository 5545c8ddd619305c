"""Pure planning: turn per-unit profiles and the measured bandwidth into a :class:`Plan`. No device is touched.

Table of contents:

* :func:`build_plan` plans with ``config.policy``; :func:`simulate` predicts a plan's step time, stall and
  peak device bytes (:class:`SimResult`).
* :class:`Plan` (what the executor runs) and :class:`UnitProfile` (what it plans from): :mod:`.contract`.
* Policies: BASE and COST_EFFECTIVE (:class:`BaseScheduler`, :class:`CostEffectiveScheduler`,
  :mod:`.lookahead`), HEURISTIC (:class:`HeuristicScheduler`, :mod:`.heuristic`), and any
  :class:`Scheduler` added with :func:`register_policy` or the ``magi.policies`` entry-point group
  (:mod:`.registry`); :func:`check_policy` and :func:`known_policies` tell which names can be used.

Helpers (planning bandwidth, resident-share caps, the look-ahead and heuristic plan builders, entry-point
reloading) are imported from their modules: :mod:`.common`, :mod:`.lookahead`, :mod:`.heuristic`,
:mod:`.registry`, :mod:`.simulate`.
"""

from __future__ import annotations

from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plan.heuristic import HeuristicScheduler
from magi_core.plan.lookahead import BaseScheduler, CostEffectiveScheduler
from magi_core.plan.registry import (
    Scheduler,
    build_plan,
    check_policy,
    known_policies,
    register_policy,
    unregister_policy,
)
from magi_core.plan.simulate import SimResult, simulate

__all__ = [
    "BaseScheduler",
    "CostEffectiveScheduler",
    "HeuristicScheduler",
    "Plan",
    "Scheduler",
    "SimResult",
    "UnitProfile",
    "build_plan",
    "check_policy",
    "known_policies",
    "register_policy",
    "simulate",
    "unregister_policy",
]
