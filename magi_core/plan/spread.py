"""Streamed units of a repeated stack spread along the step, so each copy hides behind the compute before it.

A residency rule that ranks units by compute per byte leaves the streamed units of a stack of equal blocks
wherever its ranking ends: often side by side at the end of the step. Copies in flight are few under a
budget (the copy buffer holds one or two units), so side-by-side streamed blocks wait for each other's copies
while most of the step's compute ran with the link idle. Keeping the same number of each size of unit
resident but streaming blocks spread evenly along the step's compute time gives every copy the compute of the
resident blocks before it, at the same resident bytes. Where stacks of different sizes share the step (a
dual-stream DiT's double and single blocks), keeping the counts per size can leave one stack streaming more than its
compute hides; :func:`proportional_residency` instead streams bytes in step with compute time, across sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from magi_core.plan.contract import UnitProfile

#: How far (in units of the unit's own bytes) :func:`proportional_residency` may run ahead of its line.
SLACKS = (0.5, 1.0)

#: Offsets of the evenly spaced positions within their spacing (a streamed block every ``span / k``) that
#: :func:`spread_residencies` tries: which one suits a step depends on the compute before the stack.
PHASES = (1.0, 0.5, 0.25, 0.75)


def spread_residencies(
    profiles: Sequence[UnitProfile], resident: frozenset[int], keep: Iterable[int] = (),
) -> list[frozenset[int]]:
    """Resident sets holding what ``resident`` holds, with each group of same-size units streamed at evenly
    spaced points of the step's compute time (one set per phase of :data:`PHASES`, those equal to ``resident``
    left out).

    Units of equal ``weight_bytes`` are interchangeable for memory: a group of at least two of them, some
    resident and some streamed, streams the same number at the positions nearest to ``start + span * (m +
    phase) / k`` (``m`` = 0 .. k-1, ``span`` the group's compute time from its first unit's start to its last
    unit's start; unit indices where no compute was profiled). Units in ``keep`` stay as they are.
    """
    kept = frozenset(keep)
    starts: list[float] = []
    t = 0.0
    for p in profiles:
        starts.append(t)
        t += p.compute_ms
    groups: dict[int, list[int]] = {}
    for p in profiles:
        if p.weight_bytes > 0 and p.index not in kept:
            groups.setdefault(p.weight_bytes, []).append(p.index)
    mixed = [g for g in groups.values() if len(g) >= 2 and 0 < sum(u not in resident for u in g) < len(g)]
    out: list[frozenset[int]] = []
    for phase in PHASES:
        alt = set(resident)
        for group in mixed:
            streamed = _spread(group, sum(u not in resident for u in group), starts, phase)
            alt.difference_update(group)
            alt.update(u for u in group if u not in streamed)
        candidate = frozenset(alt)
        if candidate != resident and candidate not in out:
            out.append(candidate)
    return out


def _spread(group: list[int], k: int, starts: Sequence[float], phase: float) -> set[int]:
    """``k`` members of ``group`` (in execution order) nearest to evenly spaced points of its compute time."""
    lo, hi = starts[group[0]], starts[group[-1]]  # phase 1 puts the last point on the group's last unit
    if hi > lo:
        pos = {u: starts[u] for u in group}
    else:  # nothing profiled: the units' order stands in for time
        pos = {u: float(r) for r, u in enumerate(group)}
        lo, hi = 0.0, float(len(group) - 1)
    chosen: set[int] = set()
    for m in range(k):
        target = lo + (hi - lo) * (m + phase) / k
        free = [u for u in group if u not in chosen]
        chosen.add(min(free, key=lambda u: (abs(pos[u] - target), u)))
    return chosen


def proportional_residency(profiles: Sequence[UnitProfile], cap: int, slack: float) -> frozenset[int]:
    """A resident set of at most ``cap`` bytes whose streamed bytes follow the step's compute time: walking the units
    in order, a unit streams when the bytes streamed so far, its own included, stay within the share of the bytes
    that must stream (all less ``cap``) that the compute up to its end reaches, plus ``slack`` times its own bytes;
    what is still short at the end streams from the last units back."""
    total = sum(p.weight_bytes for p in profiles)
    must = total - cap
    compute = sum(p.compute_ms for p in profiles)
    streamed: set[int] = set()
    done, t = 0, 0.0
    for r, p in enumerate(profiles):
        t += p.compute_ms
        share = t / compute if compute > 0 else (r + 1) / len(profiles)
        if p.weight_bytes and done < must and done + p.weight_bytes <= must * share + slack * p.weight_bytes:
            streamed.add(p.index)
            done += p.weight_bytes
    for p in reversed(profiles):
        if done >= must:
            break
        if p.weight_bytes and p.index not in streamed:
            streamed.add(p.index)
            done += p.weight_bytes
    return frozenset(p.index for p in profiles if p.weight_bytes and p.index not in streamed)
