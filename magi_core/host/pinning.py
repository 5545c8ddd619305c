"""Pinning host ranges in place through the backend, in waves across the ranks of a node, under a budget."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from magi_core.host.arena import PAGE
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)


def memlock_limit() -> str:
    """The RLIMIT_MEMLOCK soft/hard limits, human readable."""
    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes"

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return f"soft {show(soft)}, hard {show(hard)}"


def default_concurrency(available_bytes: int, per_rank_bytes: int) -> int:
    """Ranks that may pin at once: available host memory / 2 / per-rank bytes, at least 1."""
    if per_rank_bytes <= 0:
        return 1 << 30
    return max(1, available_bytes // 2 // per_rank_bytes)


def wave_plan(local_rank: int, local_world: int, concurrency: int) -> tuple[int, int]:
    """(this rank's wave, waves on its node) for ``concurrency`` ranks pinning at once."""
    c = max(1, concurrency)
    return local_rank // c, (local_world + c - 1) // c


@dataclass
class PinResult:
    """What :func:`pin_ranges` registered (ptr, nbytes) and why it stopped early, if it did."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered."""
        return sum(n for _, n in self.ranges)


def pin_ranges(
    backend: Backend,
    ranges: list[tuple[int, int]],
    budget: int | None,
    progress: Callable[[int], None] | None = None,
    rank: int = 0,
) -> PinResult:
    """Register each (ptr, nbytes) in place, at most ``budget`` bytes in total (whole pages).

    A refused registration stops pinning (the rest stays pageable) and is logged with the memlock
    limit; it does not raise, so ranks waiting in the same wave never hang.
    """
    res = PinResult()
    left = budget if budget is not None else None
    t0 = time.perf_counter()
    for ptr, nbytes in ranges:
        n = nbytes if left is None else min(nbytes, left // PAGE * PAGE)
        if n <= 0:
            break
        try:
            backend.host_register(ptr, n)
        except Exception as exc:  # the runtime's own error; we report it with the memlock limit
            res.error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "rank %d: pinning %d bytes at %#x failed (%s); memlock limit: %s. The rest stays pageable "
                "(host-to-device copies from it run at pageable speed). Raise the limit (ulimit -l unlimited, "
                "docker --ulimit memlock=-1) or set MAGI_PIN_BUDGET_GB.", rank, n, ptr, res.error, memlock_limit(),
            )
            break
        res.ranges.append((ptr, n))
        if left is not None:
            left -= n
        if progress is not None:
            progress(n)
    res.seconds = time.perf_counter() - t0
    return res


def unpin_ranges(backend: Backend, ranges: list[tuple[int, int]]) -> list[str]:
    """Unregister every range (all are attempted); return the errors met."""
    errors = []
    for ptr, _ in ranges:
        try:
            backend.host_unregister(ptr)
        except Exception as exc:
            errors.append(f"{ptr:#x}: {type(exc).__name__}: {exc}")
    for err in errors:
        logger.error("host unregister failed for %s", err)
    return errors
