"""Inputs and output of the schedulers: per-unit profiles in, a static transfer plan out."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitProfile:
    """What a scheduler knows of one unit: weight bytes it must have and its compute time."""

    index: int
    weight_bytes: int
    compute_ms: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A static per-step transfer plan.

    ``resident``: units whose weights are copied once and stay on the device.
    ``prefetch_at[i]``: units whose weight copies are issued on the copy stream just before unit i
    is launched on the compute stream (so they overlap unit i). ``prefetch_at[-1]`` is issued at the
    start of a step before anything was prefetched; in steady state ``next_step`` units are issued
    during the last unit of the previous step instead.
    """

    policy: str
    resident: frozenset[int]
    prefetch_at: dict[int, tuple[int, ...]]
    next_step: tuple[int, ...] = ()
    predicted_stall_ms: float = 0.0
    predicted_step_ms: float = 0.0
    notes: dict[str, float] = field(default_factory=dict)

    def offloaded(self, n_units: int) -> list[int]:
        """Units (in order) whose weights are streamed each step."""
        return [i for i in range(n_units) if i not in self.resident]
