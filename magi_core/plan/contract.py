"""Inputs and output of the schedulers: per-unit profiles in, a static transfer plan out.

Timing model shared by every scheduler, :func:`magi_core.plan.simulate` and the executor
(one compute stream, one serial copy stream, copies run in the order they are issued):

* Unit ``i`` is *launched* when the compute stream has finished unit ``i - 1`` (step start for unit 0).
  Copies listed in ``Plan.prefetch_at[i]`` are issued at that launch point, in list order; the copy
  stream starts each one when it is free. (The executor makes the copy stream wait on an event recorded
  on the compute stream just before launching unit ``i``, so the trigger holds in device time even
  while the host runs ahead; an executor that lets copies start earlier only removes stall, at the cost
  of more device memory than predicted.)
* Unit ``i`` starts when unit ``i - 1`` finished and its streamed weights arrived (the compute stream
  waits on that copy's event only), and runs for ``compute_ms``.
* A streamed unit's weights occupy device memory from the issue of their copy until the end of unit
  ``last_use``; resident weights occupy it all the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: Position in ``Plan.prefetch_at`` for copies issued at the start of a step, before unit 0 is launched.
STEP_START = -1


@dataclass(frozen=True)
class UnitProfile:
    """What a scheduler knows of one unit: weight bytes it must have and its compute time.

    ``index``: the unit's position in execution order (0-based, profiles are given in this order).
    ``weight_bytes``: bytes copied to the device before the unit can run when it is not resident. A weight
    read by several units (tied weights) is attributed to its first user only: counted and copied there,
    and kept alive until ``last_use``. ``compute_ms``: profiled compute time on the compute stream
    (waiting for weights excluded). ``last_use``: the last unit that reads this unit's streamed weights
    (default: the unit itself).
    """

    index: int
    weight_bytes: int
    compute_ms: float = 0.0
    last_use: int | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"UnitProfile.index must be >= 0, got {self.index}")
        if self.weight_bytes < 0:
            raise ValueError(f"UnitProfile.weight_bytes must be >= 0, got {self.weight_bytes} (unit {self.index})")
        if not self.compute_ms >= 0.0:
            raise ValueError(f"UnitProfile.compute_ms must be >= 0, got {self.compute_ms} (unit {self.index})")
        if self.last_use is not None and self.last_use < self.index:
            raise ValueError(
                f"UnitProfile.last_use must be >= index, got last_use={self.last_use} for unit {self.index}"
            )

    @property
    def freed_after(self) -> int:
        """The unit after whose end this unit's streamed weights are freed."""
        return self.index if self.last_use is None else self.last_use


def make_profiles(
    weight_bytes: Sequence[int],
    compute_ms: Sequence[float] | None = None,
    last_use: Sequence[int | None] | None = None,
) -> list[UnitProfile]:
    """Build profiles in execution order from parallel lists (compute 0 ms when none is given)."""
    n = len(weight_bytes)
    if compute_ms is not None and len(compute_ms) != n:
        raise ValueError(f"compute_ms has {len(compute_ms)} entries, weight_bytes has {n}; give one per unit")
    if last_use is not None and len(last_use) != n:
        raise ValueError(f"last_use has {len(last_use)} entries, weight_bytes has {n}; give one per unit")
    return [
        UnitProfile(
            index=i,
            weight_bytes=int(weight_bytes[i]),
            compute_ms=float(compute_ms[i]) if compute_ms is not None else 0.0,
            last_use=last_use[i] if last_use is not None else None,
        )
        for i in range(n)
    ]


def check_profiles(profiles: Sequence[UnitProfile]) -> None:
    """Raise ValueError unless ``profiles[i].index == i`` for every unit and ``last_use`` is in range."""
    n = len(profiles)
    for i, p in enumerate(profiles):
        if p.index != i:
            raise ValueError(f"profiles must be in execution order with index == position; position {i} has {p.index}")
        if p.last_use is not None and p.last_use >= n:
            raise ValueError(f"unit {i}: last_use={p.last_use} is past the last unit ({n - 1})")


@dataclass(frozen=True)
class Plan:
    """A static per-step transfer plan; the executor follows it literally (see the module docstring).

    ``resident``: units whose weights are copied once (on the first call) and stay on the device; they
    are never in ``prefetch_at`` or ``next_step``. Units without weights are in neither.

    ``prefetch_at[i]`` for ``i`` in ``-1 .. n-1`` (every key present, empty tuples where nothing is
    issued): units whose weight copies are issued on the copy stream, in this order, just before unit
    ``i`` is launched on the compute stream, so they overlap unit ``i`` (and later units). Every streamed
    unit ``j`` appears exactly once over all of ``prefetch_at``, at a position ``-1 <= i <= j``, and the
    concatenation of ``prefetch_at[-1], prefetch_at[0], ...`` lists streamed units in ascending order.
    ``prefetch_at[-1]`` (:data:`STEP_START`) is issued at the start of a step, before unit 0.

    ``next_step``: a leading part of ``prefetch_at[-1]``. In steady state (when the previous call ran this
    plan with the same weights), these copies are issued for the *next* step just before unit
    ``next_step_at`` is launched (-1: the last unit ``n-1``), after ``prefetch_at[next_step_at]``; no copy of
    the step itself is issued later than that (the copy stream is serial: it would wait behind them), and
    each carried unit's own use ends before it. At the start of a step the executor then issues only the
    units of ``prefetch_at[-1]`` not already in flight. On a cold step (the first call with this plan) all
    of ``prefetch_at[-1]`` is issued at step start.

    ``predicted_step_ms`` / ``predicted_stall_ms``: steady-state step time and time the compute stream
    waits for weights, from :func:`~magi_core.plan.simulate` at the planning bandwidth.
    ``notes`` (numbers only): ``bandwidth_Bps`` (planning bandwidth, safety factor applied),
    ``resident_bytes``, ``streamed_bytes`` (per step), ``peak_device_bytes`` (predicted weights on the
    device at peak, activations excluded), ``resident_budget_bytes``.
    """

    policy: str
    resident: frozenset[int]
    prefetch_at: dict[int, tuple[int, ...]]
    next_step: tuple[int, ...] = ()
    predicted_stall_ms: float = 0.0
    #: Unit before whose launch the ``next_step`` copies are issued (-1: the last unit).
    next_step_at: int = -1
    predicted_step_ms: float = 0.0
    notes: dict[str, float] = field(default_factory=dict)

    def offloaded(self, n_units: int) -> list[int]:
        """Units (in order) that are not resident (this includes units without weights)."""
        return [i for i in range(n_units) if i not in self.resident]

    def streamed(self) -> list[int]:
        """Units (in order) whose weights are copied every step."""
        return [j for i in sorted(self.prefetch_at) for j in self.prefetch_at[i]]

    def trigger_of(self) -> dict[int, int]:
        """Map each streamed unit to the position in ``prefetch_at`` where its copy is issued."""
        return {j: i for i, units in self.prefetch_at.items() for j in units}

    def validate(self, profiles: Sequence[UnitProfile]) -> None:
        """Raise ValueError when this plan breaks an invariant documented on :class:`Plan`."""
        check_profiles(profiles)
        n = len(profiles)
        if set(self.prefetch_at) != set(range(-1, n)):
            raise ValueError(f"prefetch_at must have exactly the keys -1..{n - 1}, got {sorted(self.prefetch_at)}")
        bad = [u for u in self.resident if not 0 <= u < n or profiles[u].weight_bytes == 0]
        if bad:
            raise ValueError(f"resident units {sorted(bad)} are out of range or have no weights")
        order = self.streamed()
        expected = [p.index for p in profiles if p.weight_bytes > 0 and p.index not in self.resident]
        if order != expected:
            raise ValueError(
                f"streamed units must be each non-resident unit with weights, ascending: {order} vs {expected}"
            )
        for j, i in self.trigger_of().items():
            if not -1 <= i <= j:
                raise ValueError(f"unit {j} is prefetched at position {i}; must be between -1 and {j}")
        start = self.prefetch_at[STEP_START]
        if tuple(start[: len(self.next_step)]) != tuple(self.next_step):
            raise ValueError(f"next_step {self.next_step} must be a leading part of prefetch_at[-1] {start}")
        at = self.carry_position(n)
        if n and not 0 <= at <= n - 1:
            raise ValueError(f"next_step_at={self.next_step_at} is not a unit position (-1 or 0..{n - 1})")
        for j in self.next_step:
            if profiles[j].freed_after >= at:
                where = "the last unit" if at == n - 1 else f"unit {at}"
                raise ValueError(f"unit {j} is still in use during {where}; it cannot be in next_step")
        if self.next_step:
            late = [i for i in range(at + 1, n) if self.prefetch_at[i]]
            if late:
                raise ValueError(f"copies issued at positions {late}, after the next step's copies (at {at})")

    def carry_position(self, n_units: int) -> int:
        """The unit before whose launch ``next_step`` copies are issued."""
        return n_units - 1 if self.next_step_at == -1 else self.next_step_at
