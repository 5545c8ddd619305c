"""A discrete-event model of one step under a :class:`~magi_core.plan.contract.Plan` (no device needed).

It follows the timing model of :mod:`magi_core.plan.contract`: one compute stream, one serial copy stream,
copies issued at unit launch points. Device bytes are resident weights plus streamed weights from the
issue of their copy until the end of their last use (frees at an instant happen before new copies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from magi_core.plan.contract import STEP_START, Plan, UnitProfile


@dataclass(frozen=True)
class SimResult:
    """Predicted timings of one step (ms from the step start) and the peak weight bytes on the device."""

    step_ms: float
    stall_ms: float
    peak_device_bytes: int
    start_ms: tuple[float, ...]
    end_ms: tuple[float, ...]
    copy_start_ms: dict[int, float]
    copy_end_ms: dict[int, float]

    @property
    def unit_stall_ms(self) -> tuple[float, ...]:
        """Per unit: how long it waited for its weights after the previous unit finished."""
        prev = (0.0, *self.end_ms[:-1])
        return tuple(max(0.0, s - e) for s, e in zip(self.start_ms, prev, strict=True))


def transfer_ms(nbytes: int, bandwidth_Bps: float) -> float:
    """Milliseconds to copy ``nbytes`` at ``bandwidth_Bps`` bytes per second."""
    if not bandwidth_Bps > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth_Bps}")
    return 0.0 if nbytes == 0 or math.isinf(bandwidth_Bps) else nbytes / bandwidth_Bps * 1e3


def simulate(plan: Plan, profiles: Sequence[UnitProfile], bandwidth_Bps: float, steady: bool = True) -> SimResult:
    """Model one step of ``plan`` at ``bandwidth_Bps``.

    ``steady=True``: the previous step ran the same plan, so ``plan.next_step`` copies were issued before its
    unit ``next_step_at`` (the last by default), starting once the copy stream was free there; their start
    relative to this step comes from the previous pass of the same step, repeated until the step time stops
    changing (the periodic steady state: one pass from a cold start can come out shorter than the copies of
    a step take, when the carried copies start early and the step's own copies end late).
    ``steady=False``: a cold step, all of ``prefetch_at[-1]`` is issued at the start. Either way the step
    issues ``next_step`` copies for the following step, and those bytes count towards the peak.
    """
    plan.validate(profiles)
    n = len(profiles)
    if n == 0:
        return SimResult(0.0, 0.0, 0, (), (), {}, {})
    tms = [transfer_ms(p.weight_bytes, bandwidth_Bps) for p in profiles]
    at = plan.carry_position(n)
    if not (steady and plan.next_step):
        return _run(plan, profiles, tms, at, None).result
    carried = (-sum(p.compute_ms for p in profiles[at:]),) * 2
    run = _run(plan, profiles, tms, at, carried)
    for _ in range(_STEADY_PASSES):
        step = run.result.step_ms
        regular_end = max((e for j, e in run.result.copy_end_ms.items() if j not in plan.next_step),
                          default=-math.inf)
        t0 = run.launch_ms[at] - step
        following = (t0, max(t0, regular_end - step))  # what this step hands the next one
        if all(abs(a - b) <= _STEADY_TOLERANCE_MS for a, b in zip(following, carried, strict=True)):
            break  # the step it was given is the step it hands on: the steady state
        carried = following
        run = _run(plan, profiles, tms, at, carried)
    return run.result


#: Passes of the steady-state iteration (it settles in a few; each pass is one walk over the units).
_STEADY_PASSES = 64
#: Change of the carried copies' issue and start times below which the steady state counts as reached.
_STEADY_TOLERANCE_MS = 1e-6


@dataclass(frozen=True)
class _Run:
    result: SimResult
    launch_ms: tuple[float, ...]


def _run(
    plan: Plan, profiles: Sequence[UnitProfile], tms: Sequence[float], at: int, carried: tuple[float, float] | None
) -> _Run:
    """One pass; ``carried``: (issue time, earliest copy start) of the carried copies, None for a cold step."""
    n = len(profiles)
    resident_bytes = sum(profiles[u].weight_bytes for u in plan.resident)
    events: list[tuple[float, int, int]] = []  # (time, order: 0 free / 1 alloc, +-bytes)
    copy_start: dict[int, float] = {}
    copy_end: dict[int, float] = {}
    copy_free = -math.inf

    def issue(j: int, when: float, copy_from: float) -> None:
        nonlocal copy_free
        start = max(copy_from, copy_free)
        copy_start[j], copy_end[j] = start, start + tms[j]
        copy_free = copy_end[j]
        events.append((when, 1, profiles[j].weight_bytes))

    in_flight: set[int] = set()
    if carried is not None:
        for j in plan.next_step:
            issue(j, carried[0], carried[1])
            in_flight.add(j)
    start_ms: list[float] = []
    end_ms: list[float] = []
    launch_ms: list[float] = []
    frees: dict[int, list[int]] = {}
    for j in plan.streamed():
        frees.setdefault(profiles[j].freed_after, []).append(profiles[j].weight_bytes)
    prev_end = 0.0
    for i in range(n):
        launch = prev_end
        launch_ms.append(launch)
        if i == 0:
            for j in plan.prefetch_at[STEP_START]:
                if j not in in_flight:
                    issue(j, launch, launch)
        for j in plan.prefetch_at[i]:
            issue(j, launch, launch)
        if i == at:
            for j in plan.next_step:  # for the next step: memory only, they queue behind this step's copies
                events.append((launch, 1, profiles[j].weight_bytes))
        start = max(launch, copy_end[i]) if i in copy_end else launch
        end = start + profiles[i].compute_ms
        start_ms.append(start)
        end_ms.append(end)
        for nbytes in frees.get(i, ()):
            events.append((end, 0, -nbytes))
        prev_end = end
    peak = alive = 0
    for _, _, delta in sorted(events):
        alive += delta
        peak = max(peak, alive)
    step = end_ms[-1]
    result = SimResult(
        step_ms=step,
        stall_ms=max(0.0, step - sum(p.compute_ms for p in profiles)),
        peak_device_bytes=resident_bytes + peak,
        start_ms=tuple(start_ms),
        end_ms=tuple(end_ms),
        copy_start_ms=copy_start,
        copy_end_ms=copy_end,
    )
    return _Run(result, tuple(launch_ms))
