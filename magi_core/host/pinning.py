"""Pinning host ranges in place through the backend, in waves across the ranks of a node, under a budget."""

from __future__ import annotations

import bisect
import logging
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from magi_core.errors import HostRegisterError
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
    refuses the copy, blocking or not, with cudaErrorInvalidValue), so a budget never splits one.
    """
    ordered = sorted(extents)
    cut = n // PAGE * PAGE
    while cut > 0 and (hit := _straddling(cut, ordered)) is not None:
        cut = hit[0] // PAGE * PAGE
    return cut


def _straddling(cut: int, extents: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The tensor (start, end) that ``cut`` falls strictly inside, or None; ``extents`` sorted, not overlapping."""
    i = bisect.bisect_left(extents, cut, key=lambda e: e[0]) - 1  # the last tensor starting before the cut
    return extents[i] if i >= 0 and extents[i][1] > cut else None


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
        except HostRegisterError as exc:  # the runtime refused: we report it with the memlock limit
            res.error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "rank %d: pinning %d bytes at %#x failed (%s); memlock limit: %s. The rest stays pageable "
                "(host-to-device copies from it run at pageable speed). Raise the limit (ulimit -l unlimited, "
                "docker --ulimit memlock=-1) or set MAGI_PIN_BUDGET_GB.", rank, n, ptr, res.error, memlock_limit(),
            )
            break
        except Exception as exc:  # not the hook's documented failure: a fault of the backend, not of a limit
            res.error = f"{type(exc).__name__}: {exc}"
            logger.error(
                "rank %d: backend %r (%s)'s magi_host_register raised %s for %d bytes at %#x, not the "
                "HostRegisterError its hook spec names for a refused range: a bug in that backend, report it to "
                "its maintainers. Nothing more is pinned; the rest stays pageable (copies from it run at pageable "
                "speed).", rank, backend.name, backend.package, res.error, n, ptr,
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


def cut_after(n: int, extents: Sequence[tuple[int, int]]) -> int:
    """The smallest page-aligned cut >= ``n`` that no tensor straddles; ``extents``: the tensors' (start, end) byte
    offsets, sorted and not overlapping (an arena's slots), searched by bisection (an arena may hold 100k)."""
    cut = -(-n // PAGE) * PAGE
    while (hit := _straddling(cut, extents)) is not None:
        cut = -(-hit[1] // PAGE) * PAGE
    return cut


#: Bytes :class:`PinAhead` registers at a time (cut between tensors).
AHEAD_GROUP = 256 << 20


@dataclass
class _AheadArena:
    ptr: int
    nbytes: int
    extents: list[tuple[int, int]]  # every tensor region in it, sorted: all must be written before it is pinned
    written: set[int] = field(default_factory=set)  # starts of the regions written so far
    ready: int = 0  # index of the first region (in ``extents``) not written yet
    pinned: int = 0  # registered from the arena's start up to here


class PinAhead:
    """Registers arenas while they are being filled, from a thread of its own, so pinning overlaps filling.

    ``arenas``: (ptr, nbytes, extents) per arena (page-aligned ptr), where ``extents`` are the byte offsets
    (start, end) of every tensor region in it. Each arena is registered in pieces of at least ``group`` bytes
    (default :data:`AHEAD_GROUP`) from its start, each cut between tensors (:func:`cut_after`) and registered
    once every region in it is :meth:`written`: a tensor lies in one registration, and no registered page is
    written afterwards. Pinning piece by piece while the arena is read from the page cache hides most of the pinning
    time, which reserving the arena whole, filling it, then pinning it would add to the load. A refused
    registration stops it: the rest is left to :func:`pin_ranges` (which logs the error). The backend's
    register is called from this thread, one call at a time, after ``bind()`` (the caller's device made current
    there: :meth:`Backend.device_binder`).
    """

    def __init__(self, backend: Backend, arenas: Sequence[tuple[int, int, Sequence[tuple[int, int]]]],
                 group: int | None = None, rank: int = 0, bind: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.bind = bind
        self.group = max(PAGE, group if group is not None else AHEAD_GROUP)
        self.rank = rank
        self.arenas = {p: _AheadArena(p, n, sorted(ext)) for p, n, ext in arenas}
        self.ranges: list[tuple[int, int]] = []
        self.error: str | None = None
        self.seconds = 0.0  # time spent registering
        self._cv = threading.Condition()
        self._stop = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"magi-pin-ahead-{rank}", daemon=True)
        self._thread.start()

    def written(self, ptr: int, start: int) -> None:
        """The region starting at byte ``start`` of the arena at ``ptr`` holds its final bytes."""
        with self._cv:
            a = self.arenas.get(ptr)
            if a is None:
                return
            a.written.add(start)
            while a.ready < len(a.extents) and a.extents[a.ready][0] in a.written:
                a.ready += 1
            self._cv.notify()

    def pinned_upto(self, ptr: int) -> int:
        """Bytes of the arena at ``ptr`` registered from its start (0 for an arena not given)."""
        with self._cv:
            a = self.arenas.get(ptr)
            return a.pinned if a is not None else 0

    def finish(self) -> list[tuple[int, int]]:
        """Register what is written and not registered yet, then stop; the ranges registered (an arena not
        written whole, or one after a refused registration, is left partly unregistered: see :meth:`pinned_upto`)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        return list(self.ranges)

    def abort(self) -> list[str]:
        """Stop, and unregister what was registered; the errors met doing so."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()
        errors = unpin_ranges(self.backend, self.ranges)
        self.ranges = []
        for a in self.arenas.values():
            a.pinned = 0
        return errors

    def _next(self) -> tuple[_AheadArena, int] | None:
        """An arena whose next piece may be registered now, with the piece's end; None when none may."""
        for a in self.arenas.values():
            if a.pinned >= a.nbytes:
                continue
            hi = min(a.nbytes, cut_after(a.pinned + self.group, a.extents))
            written_upto = a.extents[a.ready][0] if a.ready < len(a.extents) else a.nbytes
            if hi <= written_upto:
                return a, hi
        return None

    def _run(self) -> None:
        if self.bind is not None:
            try:
                self.bind()
            except Exception as exc:  # nothing registered: everything is left to pin_ranges
                self.error = f"{type(exc).__name__}: {exc}"
                logger.debug("rank %d: pinning ahead not started: %s", self.rank, self.error)
                return
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    job = self._next()
                    if job is not None:
                        break
                    if self._closing or all(a.pinned >= a.nbytes for a in self.arenas.values()):
                        return
                    self._cv.wait()
            a, hi = job
            lo = a.pinned
            t0 = time.perf_counter()
            try:
                self.backend.host_register(a.ptr + lo, hi - lo)
            except Exception as exc:  # the rest is left to pin_ranges, which logs its own refusal
                self.error = f"{type(exc).__name__}: {exc}"
                logger.debug("rank %d: pinning ahead stopped at %#x (+%d bytes): %s", self.rank, a.ptr + lo,
                             hi - lo, self.error)
                return
            finally:
                self.seconds += time.perf_counter() - t0
            with self._cv:
                self.ranges.append((a.ptr + lo, hi - lo))
                a.pinned = hi
