"""Pinning host ranges in place through the backend, in waves across the ranks of a node, under a budget."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Mapping, Sequence
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


def cut_between_tensors(n: int, extents: Sequence[tuple[int, int]]) -> int:
    """The largest page-aligned cut <= ``n`` that no tensor (start, end byte offsets) straddles.

    A tensor partly in pinned and partly in pageable pages cannot be copied to the device at all (CUDA
    refuses the copy, blocking or not: cudaErrorInvalidValue, measured on an H200), so a budget never
    splits one.
    """
    cut = n // PAGE * PAGE
    moved = True
    while moved and cut > 0:
        moved = False
        for start, end in extents:
            if start < cut < end:
                cut = start // PAGE * PAGE
                moved = True
    return cut


def pin_ranges(
    backend: Backend,
    ranges: list[tuple[int, int]],
    budget: int | None,
    progress: Callable[[int], None] | None = None,
    rank: int = 0,
    extents: Mapping[int, Sequence[tuple[int, int]]] | None = None,
) -> PinResult:
    """Register each (ptr, nbytes) in place, at most ``budget`` bytes in total (whole pages).

    ``extents`` (per range start: the byte offsets (start, end) of the tensors in it) keep a budget from
    cutting through a tensor (:func:`cut_between_tensors`). A refused registration stops pinning (the rest
    stays pageable) and is logged with the memlock limit; it does not raise, so ranks waiting in the same
    wave never hang.
    """
    res = PinResult()
    left = budget if budget is not None else None
    t0 = time.perf_counter()
    for ptr, nbytes in ranges:
        n = nbytes if left is None or left >= nbytes else cut_between_tensors(left, (extents or {}).get(ptr, ()))
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
