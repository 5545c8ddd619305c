"""The stream-ordering checker: flags device memory used across streams without the ordering CUDA-like devices need.

Execution on magidev is synchronous, so a missing wait or a missing ``record_stream`` never gives a wrong
number here. On a real device it would: this checker keeps the bookkeeping a real device's semantics imply
and reports where they are broken, so a CPU-only test can catch what only shows up on hardware.

The model (that of a CUDA-style caching allocator):

* Every stream has a position, bumped by each op enqueued on it (an op runs on the stream current when it is
  called, ``torch.magidev.current_stream()``), and a vector clock: for every other stream, the position up
  to which that stream's work is known to be complete before this stream's next op. ``Event.record(s)``
  snapshots ``s``'s clock; ``Stream.wait_event(e)`` / ``wait_stream`` merge a snapshot into the waiting
  stream's clock. The host has a clock too: ``synchronize()``, ``Stream.synchronize()``,
  ``Event.synchronize()`` / ``query()``, and blocking device-to-host reads (``.cpu()``, ``.item()``) merge
  into it, and the host's knowledge orders every stream's later work.
* Every device allocation (a *block*: one storage, shared by its views) remembers the stream it was
  allocated on, the last write (stream, position), the last read on each stream, and the streams named
  by ``Tensor.record_stream``.

Three rules, each checked when it happens:

``read``
    An op reads a block on stream S while the last write to it, on another stream W, is not ordered before
    S (no event wait, no host sync): e.g. a unit launched before waiting on its weights' copy event.
``overwrite``
    An op writes a block on stream S while a read or write on another stream R is not ordered before S:
    e.g. a copy into a buffer the compute stream may still be reading.
``free``
    The last tensor on a block dies (its memory returns to the allocator, reusable at once by later work on
    the allocation stream A) while a use on another stream R is neither covered by ``record_stream(R)`` nor
    ordered before A's later work: "freed without record_stream".

Violations are appended to :data:`CHECKER.violations <StreamOrderChecker.violations>` (tests assert it is
empty, see :func:`assert_clean`). In strict mode (``MAGIDEV_STRICT=1`` or :func:`strict`) a ``read`` or
``overwrite`` violation raises :class:`StreamOrderError` at the op; a ``free`` one, found in a finalizer
where raising is impossible, raises at the next magidev op or synchronisation. ``MAGIDEV_CHECK=0`` turns
the checker off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch_magidev._state import LOCK

#: A stream's identity in the checker: (device index, stream id).
StreamKey = tuple[int, int]


class StreamOrderError(RuntimeError):
    """A device tensor was used, overwritten or freed without the stream ordering a real device needs."""


@dataclass(frozen=True)
class Violation:
    """One broken ordering rule: its kind (``read``, ``overwrite``, ``free``), the streams and a message."""

    kind: str
    op: str
    block: str
    stream: StreamKey
    other: StreamKey
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(eq=False)  # compared by identity: one object per live allocation
class Block:
    """One device allocation (a storage): size, allocation stream, and its uses per stream."""

    key: tuple[int, int]
    nbytes: int
    alloc_stream: StreamKey
    desc: str
    refs: int = 0
    last_write: tuple[StreamKey, int] | None = None
    reads: dict[StreamKey, int] = field(default_factory=dict)
    recorded: set[StreamKey] = field(default_factory=set)
    #: Per byte range ``(lo, hi)`` written: the last write's stream and position (for the read/overwrite rules:
    #: views of one block that share no byte never conflict, as on a real device).
    range_writes: dict[tuple[int, int], tuple[StreamKey, int]] = field(default_factory=dict)
    #: Per byte range and stream read: the last read's position.
    range_reads: dict[tuple[int, int, StreamKey], int] = field(default_factory=dict)


#: One use of device memory by an op: the block, and the byte range ``[lo, hi)`` of it the op's tensor covers.
Use = tuple[Block, int, int]


def _name(s: StreamKey) -> str:
    return f"stream {s[1]} of magidev:{s[0]}" + (" (default)" if s[1] == 0 else "")


class StreamOrderChecker:
    """Vector clocks per stream and for the host, and the three rules of the module docstring."""

    def __init__(self) -> None:
        #: Every violation found so far (cleared by :meth:`clear`).
        self.violations: list[Violation] = []
        #: Raise :class:`StreamOrderError` on a violation (``free``: at the next op) instead of only recording it.
        self.strict = os.environ.get("MAGIDEV_STRICT", "").strip() not in ("", "0")
        #: Check at all (``MAGIDEV_CHECK=0`` turns it off).
        self.enabled = os.environ.get("MAGIDEV_CHECK", "1").strip() not in ("0", "false", "no", "off")
        self._pos: dict[StreamKey, int] = {}
        self._vc: dict[StreamKey, dict[StreamKey, int]] = {}
        self._host: dict[StreamKey, int] = {}
        self._pending: list[Violation] = []

    # -- clocks ------------------------------------------------------------------------------------------
    def tick(self, s: StreamKey) -> int:
        """Enqueue one op on ``s``; returns its position."""
        with LOCK:
            p = self._pos.get(s, 0) + 1
            self._pos[s] = p
            return p

    def snapshot(self, s: StreamKey) -> dict[StreamKey, int]:
        """What an event recorded on ``s`` now covers: ``s``'s work so far and everything ``s`` waited for."""
        with LOCK:
            snap = dict(self._vc.get(s, {}))
            snap[s] = self._pos.get(s, 0)
            return snap

    def stream_wait(self, s: StreamKey, snap: dict[StreamKey, int]) -> None:
        """``s``'s later work is ordered after ``snap`` (``wait_event`` / ``wait_stream``)."""
        with LOCK:
            vc = self._vc.setdefault(s, {})
            for k, p in snap.items():
                if p > vc.get(k, 0):
                    vc[k] = p

    def host_wait(self, snap: dict[StreamKey, int]) -> None:
        """The host waited for ``snap`` (event / stream synchronize, a blocking read back)."""
        with LOCK:
            for k, p in snap.items():
                if p > self._host.get(k, 0):
                    self._host[k] = p

    def host_wait_stream(self, s: StreamKey) -> None:
        """The host waited for all work enqueued on ``s`` so far."""
        self.host_wait(self.snapshot(s))

    def host_wait_device(self, index: int) -> None:
        """The host waited for every stream of device ``index`` (``synchronize()``)."""
        with LOCK:
            for s in list(self._pos):
                if s[0] == index:
                    self.host_wait_stream(s)

    def ordered(self, src: StreamKey, pos: int, dst: StreamKey) -> bool:
        """True when ``src``'s op at ``pos`` completes before ``dst``'s next op (same stream, a wait, or the host)."""
        return src == dst or self._vc.get(dst, {}).get(src, 0) >= pos or self._host.get(src, 0) >= pos

    # -- uses --------------------------------------------------------------------------------------------
    def on_alloc(self, block: Block, s: StreamKey, pos: int) -> None:
        """A new block on stream ``s``: its allocation counts as a write there (of all its bytes)."""
        block.last_write = (s, pos)
        block.range_writes = {(0, block.nbytes): (s, pos)}

    def on_op(self, op: str, reads: list[Use], writes: list[Use], s: StreamKey, pos: int) -> None:
        """Check and record an op at ``pos`` on ``s`` that reads ``reads`` and writes ``writes`` (byte ranges)."""
        if not self.enabled:
            return
        with LOCK:
            for b, lo, hi in reads:
                self._check_after_write(op, b, lo, hi, s, "read")
            for b, lo, hi in writes:
                self._check_after_write(op, b, lo, hi, s, "overwrite")
                for (rlo, rhi, r), p in b.range_reads.items():
                    if rlo < hi and lo < rhi and not self.ordered(r, p, s):
                        self._flag(
                            "overwrite", op, b, s, r,
                            f"{op} on {_name(s)} overwrites {b.desc} (bytes {lo}-{hi}) while {_name(r)} may still "
                            f"read it (bytes {rlo}-{rhi}, read at position {p}; no event recorded after that read "
                            f"was waited for by {_name(s)}, and the host did not synchronize it)",
                        )
            for b, lo, hi in reads:
                b.reads[s] = pos
                b.range_reads[(lo, hi, s)] = pos
            for b, lo, hi in writes:
                b.last_write = (s, pos)
                if lo <= 0 and hi >= b.nbytes:  # the whole block: earlier reads were checked to be ordered before
                    b.reads = {}
                b.range_reads = {k: p for k, p in b.range_reads.items() if not (lo <= k[0] and k[1] <= hi)}
                b.range_writes = {k: v for k, v in b.range_writes.items() if not (lo <= k[0] and k[1] <= hi)}
                b.range_writes[(lo, hi)] = (s, pos)

    def _check_after_write(self, op: str, b: Block, lo: int, hi: int, s: StreamKey, kind: str) -> None:
        for (wlo, whi), (w, p) in b.range_writes.items():
            if wlo < hi and lo < whi and not self.ordered(w, p, s):
                what = "reads" if kind == "read" else "overwrites"
                self._flag(
                    kind, op, b, s, w,
                    f"{op} on {_name(s)} {what} {b.desc} (bytes {lo}-{hi}) before the write on {_name(w)} "
                    f"(bytes {wlo}-{whi}, position {p}) is known to be complete: wait on an event recorded after "
                    "that write (Stream.wait_event) first",
                )

    def on_record_stream(self, block: Block, s: StreamKey) -> None:
        """``Tensor.record_stream(s)``: the allocator will not reuse the block before ``s``'s work at free time."""
        with LOCK:
            if s != block.alloc_stream:
                block.recorded.add(s)

    def on_free(self, block: Block) -> None:
        """The block's last tensor died: every use on another stream must be recorded or ordered."""
        if not self.enabled:
            return
        with LOCK:
            a = block.alloc_stream
            uses = dict(block.reads)
            if block.last_write is not None:
                w, p = block.last_write
                uses[w] = max(uses.get(w, 0), p)
            for r, p in uses.items():
                if r == a or r in block.recorded or self.ordered(r, p, a):
                    continue
                v = self._flag(
                    "free", "free", block, a, r,
                    f"{block.desc} (allocated on {_name(a)}) was freed while {_name(r)} may still use it "
                    f"(used at position {p}): call tensor.record_stream({_name(r)}) before dropping it, or make "
                    f"{_name(a)} wait for an event recorded on {_name(r)} after the use",
                    raise_now=False,
                )
                if v is not None and self.strict:
                    self._pending.append(v)

    def _flag(
        self, kind: str, op: str, b: Block, s: StreamKey, other: StreamKey, message: str, raise_now: bool = True
    ) -> Violation:
        v = Violation(kind, op, b.desc, s, other, "magidev stream-order violation: " + message)
        self.violations.append(v)
        if self.strict and raise_now:
            raise StreamOrderError(v.message)
        return v

    def raise_pending(self) -> None:
        """Strict mode: raise the first ``free`` violation found in a finalizer since the last call."""
        if self._pending:
            with LOCK:
                pending, self._pending = self._pending, []
            if pending:
                raise StreamOrderError(pending[0].message + (f" (and {len(pending) - 1} more)" if len(pending) > 1
                                                             else ""))

    def clear(self) -> None:
        """Forget the violations found so far."""
        with LOCK:
            self.violations.clear()
            self._pending.clear()


#: The process's checker.
CHECKER = StreamOrderChecker()


def violations() -> list[Violation]:
    """A copy of the violations found so far."""
    with LOCK:
        return list(CHECKER.violations)


def clear() -> None:
    """Forget the violations found so far."""
    CHECKER.clear()


def assert_clean() -> None:
    """Raise :class:`StreamOrderError` listing every violation found so far (none: return)."""
    found = violations()
    if found:
        raise StreamOrderError(f"{len(found)} magidev stream-order violation(s):\n" + "\n".join(map(str, found)))


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Inside the block, violations raise :class:`StreamOrderError` (``free`` ones at the next op)."""
    before = CHECKER.strict
    CHECKER.strict = enabled
    try:
        yield
    finally:
        CHECKER.strict = before
