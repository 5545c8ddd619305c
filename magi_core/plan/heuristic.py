"""HEURISTIC: latest copy triggers that still reach the best step time, residency where it removes most stall.

For a resident set, the earliest-issue schedule (every streamed copy queued at once, the leading ones
during the previous step's last unit) gives the shortest possible step on a serial copy stream. Walking
the streamed units backwards from that schedule, each copy gets the latest start that still lands
``prefetch_margin_ms`` before its unit starts (or as early as that schedule manages, when the link is
the bottleneck) and before the next copy must start; its trigger is the last launch point not later
than that start. So the step time equals the shortest possible, and weights arrive as late as possible,
which keeps the streamed working set small. Look-ahead plans are never faster for the same residency.

Memory: shortest-step triggers may put several copies ahead of the running unit (e.g. during a heavy unit);
``Plan.notes["peak_device_bytes"]`` says how much. Copies ahead hold memory, so the plan kept is the one with
the fewest streamed units in flight that is as fast (:func:`fewest_copies_ahead`: in a transfer-bound step that
is look-ahead 1, two units on the device). Under ``device_memory_budget_bytes`` a plan that does not
fit is rebuilt with copies at most ``lookahead`` streamed units ahead (same step time as look-ahead, later
triggers), before residency is reduced; then a few units less resident are tried too, and the plan predicted
fastest is kept (less resident can leave room for copies to run ahead of a balanced step).

Where the resident set leaves streamed blocks side by side (the plan stalls, or hides its copies only by queueing
them several units ahead), sets with the streamed blocks spread along the step are planned too
(:mod:`magi_core.plan.spread`) and kept when faster, or as fast in less memory.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from magi_core.plan.common import (
    assemble,
    fill,
    least_compute_per_byte,
    lookahead_triggers,
    next_step_eligible,
    plan_with_limits,
    planning_bandwidth,
    streamed_units,
)
from magi_core.plan.contract import STEP_START, Plan, UnitProfile
from magi_core.plan.lookahead import lookahead_plan
from magi_core.plan.simulate import SimResult, simulate, transfer_ms
from magi_core.plan.spread import SLACKS, proportional_residency, spread_residencies

if TYPE_CHECKING:
    from magi_core.config import OffloadConfig

#: Copies taking at least this share of the compute time (at the measured rate) keep the copy stream busy.
BUSY_SHARE = 0.8

#: Position meaning "issued during the previous step's last unit" (``Plan.next_step``), internal only.
_PREVIOUS_STEP = -2


@dataclass(frozen=True)
class _Timeline:
    start: list[float]
    end: list[float]
    copy_end: dict[int, float]
    streamed: list[int]
    n_early: int


def _earliest(profiles: Sequence[UnitProfile], resident: frozenset[int], tms: Sequence[float]) -> _Timeline:
    """Steady-state timeline when every streamed copy is issued as early as a plan allows."""
    n = len(profiles)
    streamed = streamed_units(profiles, resident)
    n_early = next_step_eligible(profiles, streamed)
    before = -profiles[n - 1].compute_ms if n else 0.0
    copy_free = -math.inf
    copy_end: dict[int, float] = {}
    for m, j in enumerate(streamed):
        copy_free = max(before if m < n_early else 0.0, copy_free) + tms[j]
        copy_end[j] = copy_free
    start: list[float] = []
    end: list[float] = []
    prev = 0.0
    for i, p in enumerate(profiles):
        s = max(prev, copy_end[i]) if i in copy_end else prev
        start.append(s)
        prev = s + p.compute_ms
        end.append(prev)
    return _Timeline(start, end, copy_end, streamed, n_early)


def _windowed(
    profiles: Sequence[UnitProfile], resident: frozenset[int], bandwidth_Bps: float, window: int
) -> _Timeline:
    """Steady-state timeline when no copy may be issued more than ``window`` streamed units ahead."""
    prefetch_at, next_step = lookahead_triggers(profiles, resident, window)
    draft = Plan("WINDOW", resident, prefetch_at, next_step)
    sim = simulate(draft, profiles, bandwidth_Bps)
    return _Timeline(
        list(sim.start_ms), list(sim.end_ms), sim.copy_end_ms, streamed_units(profiles, resident), len(next_step)
    )


def best_step_ms(profiles: Sequence[UnitProfile], resident: frozenset[int], bandwidth_Bps: float) -> float:
    """The shortest steady-state step a plan with this resident set reaches at ``bandwidth_Bps`` when the next
    step's copies go out before the last unit (:func:`_earlier_carry` may then shorten it further)."""
    if not profiles:
        return 0.0
    tms = [transfer_ms(p.weight_bytes, bandwidth_Bps) for p in profiles]
    return _earliest(profiles, resident, tms).end[-1]


def heuristic_plan(
    profiles: Sequence[UnitProfile], resident: frozenset[int], bandwidth_Bps: float, margin_ms: float,
    policy: str = "HEURISTIC", window: int | None = None, fast_bandwidth_Bps: float | None = None,
    carry_search: bool = True, busy_rule: bool = True,
) -> Plan:
    """Latest-trigger plan for a given resident set (``bandwidth_Bps`` already includes the safety factor).

    ``window``: None lets a copy be issued as many streamed units ahead as removes stall; an int ``w`` never
    issues one earlier than the look-ahead-``w`` plan would (at most ``w + 1`` streamed units on the device),
    and then matches that plan's step time with triggers as late as possible.

    ``fast_bandwidth_Bps`` (the measured rate, before the safety factor): when copies take at least
    :data:`BUSY_SHARE` of the compute time at that rate, the copy stream is (nearly) the bottleneck, and a
    copy triggered at the launch its planned start allows would leave the stream idle whenever copies run
    faster than planned (units then wait for compute, and launches come later than the previous copy's end):
    each copy is then triggered no later than the previous one ends at the fast rate.

    The rule holds more copies in flight, so it is kept only where the step it gives at the measured rate is
    :data:`_FAST_GAIN` shorter than the plan without it (``busy_rule=False``); on a step that is copy-bound at
    both rates, for example, the stream is busy either way.

    ``carry_search``: False returns the latest-trigger plan without trying earlier next-step copies
    (:func:`_earlier_carry`).
    """
    if busy_rule and fast_bandwidth_Bps is not None and window is None and profiles:
        streamed = streamed_units(profiles, resident)
        compute_ms = sum(p.compute_ms for p in profiles)
        copy_ms = sum(transfer_ms(profiles[j].weight_bytes, fast_bandwidth_Bps) for j in streamed)
        floor = max(compute_ms, copy_ms)  # no step is shorter (see _fast_floor)
        if streamed and copy_ms >= BUSY_SHARE * compute_ms:
            plain = _trigger_plan(profiles, resident, bandwidth_Bps, margin_ms, policy, window, fast_bandwidth_Bps,
                                  carry_search, busy=False)
            plain_fast = simulate(plain, profiles, fast_bandwidth_Bps).step_ms
            if plain_fast <= floor * (1 + _FAST_GAIN):
                return plain  # at the bound already: the rule cannot pay for its copies in flight
            plan = _trigger_plan(profiles, resident, bandwidth_Bps, margin_ms, policy, window, fast_bandwidth_Bps,
                                 carry_search, busy=True)
            if (_no_longer(plain.predicted_step_ms, plan.predicted_step_ms)
                    and simulate(plan, profiles, fast_bandwidth_Bps).step_ms > plain_fast * (1 - _FAST_GAIN)):
                return plain
            return plan
    return _trigger_plan(profiles, resident, bandwidth_Bps, margin_ms, policy, window, fast_bandwidth_Bps,
                         carry_search, busy=False)


def _fast_floor(profiles: Sequence[UnitProfile], streamed: Sequence[int], fast_bandwidth_Bps: float) -> float:
    """No step is shorter than its compute or than its copies at the measured rate."""
    return max(sum(p.compute_ms for p in profiles),
               sum(transfer_ms(profiles[j].weight_bytes, fast_bandwidth_Bps) for j in streamed))


def _trigger_plan(
    profiles: Sequence[UnitProfile], resident: frozenset[int], bandwidth_Bps: float, margin_ms: float,
    policy: str, window: int | None, fast_bandwidth_Bps: float | None, carry_search: bool, busy: bool,
) -> Plan:
    """:func:`heuristic_plan` with the busy-stream rule on or off (``busy``)."""
    n = len(profiles)
    tms = [transfer_ms(p.weight_bytes, bandwidth_Bps) for p in profiles]
    at: dict[int, list[int]] = {i: [] for i in range(-1, n)}
    next_step: list[int] = []
    if n:
        if window is None:
            tl = _earliest(profiles, resident, tms)
        else:
            tl = _windowed(profiles, resident, bandwidth_Bps, window)
        # latest copy starts, walking backwards: finish by the deadline and before the next copy starts
        latest_start: dict[int, float] = {}
        next_start = math.inf
        for j in reversed(tl.streamed):
            deadline = max(tl.start[j] - margin_ms, tl.copy_end[j])
            latest_start[j] = min(deadline, next_start) - tms[j]
            next_start = latest_start[j]
        if busy and fast_bandwidth_Bps is not None and window is None and tl.streamed:
            tf = _earliest(profiles, resident, [transfer_ms(p.weight_bytes, fast_bandwidth_Bps) for p in profiles])
            for prev, j in zip(tl.streamed, tl.streamed[1:], strict=False):
                latest_start[j] = min(latest_start[j], tf.copy_end[prev])
        # launch time of each position: previous step's last unit, step start, then unit i at end of i-1
        launch = {_PREVIOUS_STEP: -profiles[n - 1].compute_ms, STEP_START: 0.0}
        for i in range(n):
            launch[i] = tl.end[i - 1] if i > 0 else 0.0
        pos = _PREVIOUS_STEP
        for m, j in enumerate(tl.streamed):
            if m >= tl.n_early:
                pos = max(pos, STEP_START)
            limit = latest_start[j] + 1e-9 * max(1.0, abs(latest_start[j]))
            while pos + 1 <= j - 1 and launch[pos + 1] <= limit:
                pos += 1
            if pos == _PREVIOUS_STEP:
                next_step.append(j)
                at[STEP_START].append(j)
            else:
                at[pos].append(j)
    prefetch_at = {i: tuple(v) for i, v in at.items()}
    plan = assemble(policy, profiles, resident, prefetch_at, tuple(next_step), bandwidth_Bps, {"margin_ms": margin_ms})
    if window is None and n > 1 and carry_search:
        plan = _earlier_carry(plan, profiles, bandwidth_Bps, margin_ms, fast_bandwidth_Bps)
    return plan


#: How many more leading units than the latest-trigger plan carries :func:`_earlier_carry` tries to carry.
_EXTRA_CARRIED = 3
#: A carry position that only the measured rate prefers must shorten the step at that rate by this share ...
_FAST_GAIN = 0.005
#: ... and hold at most this multiple of the latest-trigger plan's peak device bytes.
_FAST_PEAK_GROWTH = 1.5


def _earlier_carry(plan: Plan, profiles: Sequence[UnitProfile], bandwidth_Bps: float, margin_ms: float,
                   fast_bandwidth_Bps: float | None = None) -> Plan:
    """The plan whose next-step copies start earlier in the step, when that shortens the steady step.

    Copies for the next step are issued before the last unit by default; when that unit computes less than
    they take to copy (an LM head after a large embedding), the next step's first unit waits. Trying every
    earlier issue position (copies of this step that were triggered later move there, ahead of them) and a
    few more carried units, keep the shortest predicted step; among equal ones the shortest step at
    ``fast_bandwidth_Bps`` (the measured rate: at the planning rate, which has the safety factor, a step whose
    copies and compute are close looks copy-bound, so every carry position predicts the same step and only
    the measured rate tells them apart) when it is :data:`_FAST_GAIN` shorter there and holds at most
    :data:`_FAST_PEAK_GROWTH` times the device bytes, then the latest position and the fewest carried units
    (least memory held across the boundary).
    """
    n = len(profiles)
    streamed = plan.streamed()
    best = plan

    def fast_step(p: Plan) -> float:
        return simulate(p, profiles, fast_bandwidth_Bps).step_ms if fast_bandwidth_Bps else 0.0

    best_fast = fast_step(plan)
    # no carry makes the step shorter than its compute or its copies at the measured rate: once the best is
    # within _FAST_GAIN of that, the measured rate has nothing left to choose
    floor = _fast_floor(profiles, streamed, fast_bandwidth_Bps) if fast_bandwidth_Bps else math.inf
    base_peak = plan.notes["peak_device_bytes"]
    base_k = len(plan.next_step)
    for k in range(base_k, min(len(streamed), base_k + _EXTRA_CARRIED) + 1):
        carried = tuple(streamed[:k])
        if not carried:
            continue
        latest_use = max(profiles[j].freed_after for j in carried)
        for p in range(n - 1, latest_use, -1):
            at: dict[int, list[int]] = {i: [j for j in v if j not in carried] for i, v in plan.prefetch_at.items()}
            at[STEP_START] = [*carried, *at[STEP_START]]
            for i in range(p + 1, n):  # this step's copies go out before the next step's
                at[p] += at[i]
                at[i] = []
            draft = Plan(plan.policy, plan.resident, {i: tuple(v) for i, v in at.items()}, carried, next_step_at=p)
            try:
                step = simulate(draft, profiles, bandwidth_Bps).step_ms
            except ValueError:
                continue
            shorter = _shorter(step, best.predicted_step_ms)
            if shorter or (fast_bandwidth_Bps and best_fast > floor * (1 + _FAST_GAIN)
                           and _no_longer(step, best.predicted_step_ms)
                           and fast_step(draft) < best_fast * (1 - _FAST_GAIN)):
                candidate = assemble(plan.policy, profiles, plan.resident, draft.prefetch_at, carried, bandwidth_Bps,
                                     {"margin_ms": margin_ms}, next_step_at=p)
                if not shorter and candidate.notes["peak_device_bytes"] > _FAST_PEAK_GROWTH * base_peak:
                    continue
                best = candidate
                best_fast = fast_step(best)
    return best


def stall_removing_residency(
    profiles: Sequence[UnitProfile], cap: int, bandwidth_Bps: float
) -> frozenset[int]:
    """Greedy residency: repeatedly keep the unit whose residency shortens the best step most, within ``cap``
    bytes; when no unit shortens it any more, fill the rest of ``cap`` by least compute per byte."""
    return fill(least_compute_per_byte(profiles), profiles, cap, stall_removing_set(profiles, cap, bandwidth_Bps))


def stall_removing_set(profiles: Sequence[UnitProfile], cap: int, bandwidth_Bps: float) -> frozenset[int]:
    """The units :func:`stall_removing_residency` keeps because they shorten the step (before it fills the rest).

    Gains are evaluated lazily: a unit's last computed gain (at first its own transfer time, which bounds
    it) is re-evaluated only when it tops the queue, so a round costs a few timelines, not one per unit.
    """
    order = least_compute_per_byte(profiles)
    if not profiles:
        return frozenset()
    rank = {u: r for r, u in enumerate(order)}
    tms = [transfer_ms(p.weight_bytes, bandwidth_Bps) for p in profiles]
    kept: frozenset[int] = frozenset()
    used = 0
    current = _earliest(profiles, kept, tms).end[-1]
    if current <= sum(p.compute_ms for p in profiles) * (1 + 1e-12) + 1e-12:
        return kept  # nothing stalls: residency cannot shorten the step
    # entries: (-gain, bytes, rank, unit, round the gain was computed in; -1 = upper bound only)
    heap = [(-tms[u], profiles[u].weight_bytes, rank[u], u, -1) for u in order if profiles[u].weight_bytes <= cap]
    heapq.heapify(heap)
    rnd = 0
    while heap:
        neg_gain, nbytes, r, u, when = heapq.heappop(heap)
        if used + nbytes > cap:
            continue  # it will never fit again: the budget only shrinks
        if when != rnd:
            gain = current - _earliest(profiles, kept | {u}, tms).end[-1]
            heapq.heappush(heap, (-gain, nbytes, r, u, rnd))
            continue
        if -neg_gain <= 1e-9 * max(1.0, current):
            break
        kept = kept | {u}
        used += nbytes
        current += neg_gain
        rnd += 1
    return kept


class HeuristicScheduler:
    """HEURISTIC: residency where it removes the largest predicted stall (then least compute per byte), and
    each streamed copy triggered at the latest launch point that keeps the shortest step (see module doc)."""

    name = "HEURISTIC"

    def plan(self, profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
        """Plan from profiled ``profiles`` at the measured ``bandwidth_Bps`` (safety factor applied here)."""
        bw = planning_bandwidth(bandwidth_Bps, config)
        margin = config.prefetch_margin_ms

        budget = config.budget_bytes(None)
        order = least_compute_per_byte(profiles)
        built: dict[frozenset[int], Plan] = {}  # caps that keep the same units plan the same

        def for_residency(resident: frozenset[int]) -> Plan:
            plan = built.get(resident)
            if plan is None:
                plan = heuristic_plan(profiles, resident, bw, margin, self.name, fast_bandwidth_Bps=bandwidth_Bps)
                plan = fewest_copies_ahead(plan, profiles, bw, margin, bandwidth_Bps)
                if budget is not None and plan.notes["peak_device_bytes"] > budget:
                    # too many copies ahead of the running unit for the budget: limit them to the look-ahead
                    plan = heuristic_plan(profiles, resident, bw, margin, self.name, window=config.lookahead)
                built[resident] = plan
            return plan

        screened: dict[frozenset[int], Plan] = {}

        def screen(resident: frozenset[int]) -> Plan:
            if resident not in screened:
                screened[resident] = heuristic_plan(profiles, resident, bw, margin, self.name, window=config.lookahead)
            return screened[resident]

        def build(cap: int) -> Plan:
            needed = stall_removing_set(profiles, cap, bw)
            plan = _spread_if_faster(for_residency(fill(order, profiles, cap, needed)), profiles, bw, bandwidth_Bps,
                                     budget, for_residency, screen)
            # what the step needs resident (the rest only fills the cap): a caller after the least memory plans
            # with that much
            notes = {**plan.notes, "needed_resident_bytes": float(sum(profiles[u].weight_bytes for u in needed))}
            return dataclasses.replace(plan, notes=notes)

        def fallback() -> Plan:
            return lookahead_plan(self.name, profiles, frozenset(), config.lookahead, bw)

        plan = plan_with_limits(profiles, config, build, fallback)
        return plan if budget is None else _trade_residency_for_copies(plan, profiles, budget, build)


def _shorter(a_ms: float, b_ms: float) -> bool:
    """``a_ms`` is shorter than ``b_ms`` by more than float noise."""
    return a_ms < b_ms * (1 - 1e-9) - 1e-9


def _no_longer(a_ms: float, b_ms: float) -> bool:
    """``a_ms`` is at most ``b_ms``, within float noise."""
    return a_ms <= b_ms * (1 + 1e-9) + 1e-9


def _spread_if_faster(
    plan: Plan, profiles: Sequence[UnitProfile], bandwidth_Bps: float, fast_bandwidth_Bps: float,
    budget: int | None, for_residency: Callable[[frozenset[int]], Plan], screen: Callable[[frozenset[int]], Plan],
) -> Plan:
    """``plan``, or a plan holding the same bytes resident with the streamed blocks of each size spread along the
    step (:func:`~magi_core.plan.spread.spread_residencies`), or at most as many with streamed bytes in step with
    compute (:func:`~magi_core.plan.spread.proportional_residency`), when that is faster, or as fast in less memory.

    Only a plan that stalls (a step at its compute or at its copies cannot get shorter) or holds more than two
    streamed units in flight is looked at. The spread sets are ranked by ``screen`` (a plan cheap to build: the
    look-ahead window's); the best, unless it screens slower than ``plan``'s own set, is planned in full
    (``for_residency``). It replaces ``plan`` when it holds no more than ``budget`` (without one: than ``plan``)
    and its predicted step is shorter, or as long and shorter at the measured rate by :data:`_FAST_GAIN`, or as
    long at both rates and holding less."""
    streamed = plan.streamed()
    if not streamed:
        return plan
    floor = max(sum(p.compute_ms for p in profiles),
                sum(transfer_ms(profiles[j].weight_bytes, bandwidth_Bps) for j in streamed))
    stalls = plan.predicted_step_ms > floor * (1 + _FAST_GAIN) + 1e-9
    two = sum(sorted((profiles[j].weight_bytes for j in streamed), reverse=True)[:2])
    peak = plan.notes["peak_device_bytes"]
    if not stalls and peak <= plan.notes["resident_bytes"] + two:
        return plan
    cap = int(plan.notes["resident_bytes"])
    sets = [*spread_residencies(profiles, plan.resident),
            *(proportional_residency(profiles, cap, slack) for slack in SLACKS)]
    ranked = sorted((screen(r).predicted_step_ms, i, r) for i, r in enumerate(dict.fromkeys(sets))
                    if r != plan.resident)
    if not ranked or not _no_longer(ranked[0][0], screen(plan.resident).predicted_step_ms):
        return plan
    candidate = for_residency(ranked[0][2])
    if candidate.notes["peak_device_bytes"] > (budget if budget is not None else peak):
        return plan
    if _shorter(candidate.predicted_step_ms, plan.predicted_step_ms):
        return candidate
    if not _no_longer(candidate.predicted_step_ms, plan.predicted_step_ms):
        return plan
    fast, fast_plan = (simulate(p, profiles, fast_bandwidth_Bps).step_ms for p in (candidate, plan))
    if fast < fast_plan * (1 - _FAST_GAIN):
        return candidate
    if fast <= fast_plan * (1 + _FAST_GAIN) and candidate.notes["peak_device_bytes"] < peak:
        return candidate
    return plan


#: Copy windows (streamed units in flight ahead of the running one) :func:`fewest_copies_ahead` tries.
_MAX_WINDOW = 4


def fewest_copies_ahead(
    plan: Plan, profiles: Sequence[UnitProfile], bandwidth_Bps: float, margin_ms: float,
    fast_bandwidth_Bps: float | None = None,
) -> Plan:
    """The plan with the fewest copies queued ahead of compute that is as fast as ``plan``.

    Copies queued further ahead hold device memory and only pay where they shorten the step: in a
    transfer-bound step the copy stream is the bottleneck, and look-ahead 1 already keeps it busy. The
    windows 1 .. :data:`_MAX_WINDOW` are tried in turn; the first whose step is within :data:`_FAST_GAIN` of
    ``plan``'s, at the planning rate and at the measured one, and holds less, replaces it.
    """
    streamed = plan.streamed()
    if len(streamed) < 2:
        return plan
    peak = plan.notes["peak_device_bytes"]
    fast = fast_bandwidth_Bps or bandwidth_Bps
    plan_fast = simulate(plan, profiles, fast).step_ms
    slack = _slack(simulate(plan, profiles, bandwidth_Bps), streamed)
    for window in range(1, min(_MAX_WINDOW, len(streamed)) + 1):
        candidate = heuristic_plan(profiles, plan.resident, bandwidth_Bps, margin_ms, plan.policy, window=window)
        if candidate.notes["peak_device_bytes"] >= peak:
            return plan  # wider windows hold at least as much
        # as fast at both rates, and every copy lands the margin early where the plan's did
        kept = _slack(simulate(candidate, profiles, bandwidth_Bps), streamed)
        if (candidate.predicted_step_ms <= plan.predicted_step_ms * (1 + _FAST_GAIN) + 1e-9
                and all(kept[j] >= min(slack[j], margin_ms) - 1e-9 for j in streamed)
                and simulate(candidate, profiles, fast).step_ms <= plan_fast * (1 + _FAST_GAIN) + 1e-9):
            candidate.notes["copy_window"] = float(window)
            return candidate
    return plan


def _slack(sim: SimResult, streamed: Sequence[int]) -> dict[int, float]:
    """Per streamed unit: how long before its start its copy ends."""
    return {j: sim.start_ms[j] - sim.copy_end_ms[j] for j in streamed}


#: Smaller resident caps (one largest unit less each) HEURISTIC tries under a budget (see below).
_TRADE_STEPS = 4


def _trade_residency_for_copies(
    plan: Plan, profiles: Sequence[UnitProfile], budget: int, build: Callable[[int], Plan]
) -> Plan:
    """Under a budget the largest resident set that fits can leave no room for copies ahead of compute (a
    balanced step stalls on every streamed unit); a unit or a few less resident frees the room for copies to run
    ahead. Try caps down to :data:`_TRADE_STEPS` largest units less; keep the plan predicted fastest (ties: the
    one with more resident)."""
    floor = sum(p.compute_ms for p in profiles)
    step = max((p.weight_bytes for p in profiles), default=0)
    cap = int(plan.notes.get("resident_budget_bytes", 0))
    best = plan
    for k in range(1, _TRADE_STEPS + 1):
        if best.predicted_step_ms <= floor * (1 + 1e-9) or step <= 0 or cap - k * step < 0:
            break
        candidate = build(cap - k * step)
        if candidate.notes["peak_device_bytes"] <= budget and candidate.predicted_step_ms < best.predicted_step_ms:
            candidate.notes["resident_budget_bytes"] = float(cap - k * step)
            best = candidate
    return best
