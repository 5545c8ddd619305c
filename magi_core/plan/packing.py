"""Static placement of copy batches in one device buffer: byte offsets that never overlap while both are alive.

A step's copy batches have known sizes and known lifetimes (from the unit before which each is copied to the
last unit that uses one of its weights; a batch carried to the next step lives across the step boundary).
Placing them once lets a transfer copy every batch into a fixed place, with views made once, and no
allocator call per step. Placement is greedy, largest batch first, at the lowest offset where it overlaps no
already placed batch that is alive at the same time (the usual offline strategy for static memory plans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: A lifetime: inclusive ``(first, last)`` time points; a batch may be alive in several (across a step boundary).
Lifetime = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Packing:
    """Where each batch lives in the buffer, the buffer's size, and which batches share bytes."""

    offsets: tuple[int, ...]
    total: int
    #: Per batch: the other batches whose bytes overlap its own (alive at different times by construction).
    shares_with: tuple[tuple[int, ...], ...]


def overlaps(a: Lifetime, b: Lifetime) -> bool:
    """True when two lifetimes share a time point."""
    return any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in a for lo2, hi2 in b)


def pack(sizes: Sequence[int], lifetimes: Sequence[Lifetime], alignment: int = 512) -> Packing:
    """Offsets (multiples of ``alignment``) so that batches alive at the same time never share a byte."""
    if len(sizes) != len(lifetimes):
        raise ValueError(f"pack: {len(sizes)} sizes for {len(lifetimes)} lifetimes")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"pack: alignment {alignment} is not a power of two")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    offsets = [0] * len(sizes)
    placed: list[int] = []
    for i in order:
        size = sizes[i]
        busy = sorted(
            (offsets[j], offsets[j] + sizes[j]) for j in placed if sizes[j] and overlaps(lifetimes[i], lifetimes[j])
        )
        at = 0
        for lo, hi in busy:
            if at + size <= lo:
                break
            at = max(at, -(-hi // alignment) * alignment)
        offsets[i] = at
        placed.append(i)
    total = max((offsets[i] + sizes[i] for i in range(len(sizes))), default=0)
    shares = tuple(
        tuple(
            j for j in range(len(sizes))
            if j != i and sizes[i] and sizes[j]
            and offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]
        )
        for i in range(len(sizes))
    )
    return Packing(tuple(offsets), -(-total // alignment) * alignment, shares)
