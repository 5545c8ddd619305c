"""The host ranges magi-core registered (pinned) in this process, for copies that must stay inside one of them.

An accelerator runtime resolves a copy's host pointer to the one registration holding it: a copy whose bytes
start in one registered range and run on into the next (two pieces of one arena, pinned apart) fails with
"invalid argument" on CUDA, even when the ranges are adjacent. Whoever copies a byte span of several tensors
(the unit transfer) splits it at :meth:`RegisteredRanges.bounds`. Registrations are per process, so the record
is one per process, kept by the backend facade's ``host_register`` / ``host_unregister``.
"""

from __future__ import annotations

import bisect
import threading


class RegisteredRanges:
    """The (ptr, nbytes) ranges registered through magi-core now, and a version that changes with them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # start -> sizes registered there (a covered sub-range may share it)
        self._bounds: tuple[int, ...] = ()
        #: Changes whenever a range is added or removed (callers that cache a split compare it).
        self.version = 0

    def add(self, ptr: int, nbytes: int) -> None:
        """Record the range [ptr, ptr+nbytes) as registered."""
        with self._lock:
            self._held.setdefault(ptr, []).append(nbytes)
            self._changed()

    def remove(self, ptr: int) -> None:
        """Forget the range last recorded at ``ptr`` (no-op when none is)."""
        with self._lock:
            sizes = self._held.get(ptr)
            if not sizes:
                return
            sizes.pop()
            if not sizes:
                del self._held[ptr]
            self._changed()

    def held(self) -> dict[int, int]:
        """A copy of the ranges held now, ``start -> nbytes`` (the largest where several share a start)."""
        with self._lock:
            return {p: max(ns) for p, ns in self._held.items()}

    def _changed(self) -> None:
        self._bounds = tuple(sorted(set(self._held) | {p + n for p, ns in self._held.items() for n in ns}))
        self.version += 1

    def bounds(self) -> tuple[int, ...]:
        """Every registered range's start and end, sorted: a copy must not run across any of them."""
        return self._bounds

    def crossed(self, lo: int, hi: int) -> bool:
        """True when a range boundary lies strictly inside [lo, hi)."""
        b = self._bounds
        i = bisect.bisect_right(b, lo)
        return i < len(b) and b[i] < hi

    def region(self, ptr: int) -> int:
        """The index of the stretch between two consecutive bounds that ``ptr`` lies in."""
        return bisect.bisect_right(self._bounds, ptr)


#: This process's record (registrations are process-wide, whichever facade made them).
REGISTERED = RegisteredRanges()
