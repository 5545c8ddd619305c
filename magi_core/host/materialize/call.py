"""One materialisation on this rank: the state its steps and rounds share, and what it tells the other ranks.

:class:`CallState` holds the inputs, the progress, the slots swapped into a mapping (to put back on failure)
and what was pinned while filling; :class:`RankInfo` is what every rank says in the first gather, and
:func:`check_agreement` what they must say alike; :class:`RoundResult` what each says after a round of files.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from magi_core.errors import ConfigError, MagiError
from magi_core.host import memstat, pinning, shm
from magi_core.host.arena import Slot
from magi_core.host.config import HostOptions
from magi_core.host.loading.loader import Loader, NoSource
from magi_core.host.materialize.weights import HostWeights, unreplace
from magi_core.host.topology import Claim, Coordinator
from magi_core.plugin.facade import Backend

if TYPE_CHECKING:
    from magi_core.host.materialize.file_round import FileRound

logger = logging.getLogger("magi_core.host.materialize")

ProgressCallback = Callable[[str, int, int], None]

#: What a node's ranks do when they hold different weights on purpose (said with every mismatch error).
FIX = ("If the ranks hold different weights on purpose (expert parallelism), use HostOptions(on_mismatch='copy') "
       "(the default): differing tensors get a copy per rank, identical ones stay shared (set MAGI_EP_SIZE to say "
       "the differences are expected)")


class CallState:
    """What one materialisation shares on this rank across its steps and rounds: the inputs, the progress, the
    slots swapped into a mapping (to put back on failure) and what was pinned while filling."""

    def __init__(self, model: nn.Module, opts: HostOptions, backend: Backend,
                 on_progress: ProgressCallback | None, loader: Loader | NoSource) -> None:
        self.model, self.opts, self.backend, self.on_progress = model, opts, backend, on_progress
        self.loader = loader
        self.coord = Coordinator()
        self.rank = self.coord.rank
        self.t0 = time.perf_counter()
        self.show = opts.progress if opts.progress is not None else sys.stderr.isatty()
        self.adopted: set[int] = set()  # id() of the slots swapped into a mapping (for rollback)
        self.devices: dict[int, torch.device] = {}
        self.own_fps: dict[int, list[int]] = {}  # id(slot) -> sampled fingerprints of its entries
        self.cleaned = False
        self.pinned_ahead: dict[int, int] = {}  # arena ptr -> bytes registered from its start while filling
        self.ahead_seconds = 0.0
        self.round: FileRound | None = None
        self.done = 0  # bytes written or mapped so far (progress)
        self.total = 0
        self.node_size = 1  # ranks sharing this node's files

    def phase(self, hw: HostWeights, name: str) -> None:
        """Record (timings, memory) and log that step ``name`` is done."""
        now = time.perf_counter()
        hw.report["timings"][name] = now - self.t0
        snap = memstat.snapshot()
        hw.report["memory"][name] = snap
        logger.info("rank %d: host weights %s after %.2fs; %s", self.rank, name, now - self.t0, memstat.fmt(snap))

    def gather_status(self, err: BaseException | None) -> list[str | None]:
        """Every rank's error text (None where it succeeded)."""
        return self.coord.all_gather(status(err))

    def fail_all(self, statuses: list[str | None], own: BaseException | None,
                 undo: Callable[[], None] | None = None, cls: type[MagiError] = MagiError) -> None:
        """Raise on every rank when any rank failed: its own error, else one naming the others' (``undo`` first)."""
        bad = [(r, s) for r, s in enumerate(statuses) if s]
        if not bad:
            return
        if undo is not None:
            undo()
        if own is not None:
            raise own
        raise cls("host weights: " + "; ".join(f"rank {r}: {s}" for r, s in bad))

    def progress(self, desc: str, total: int) -> tqdm:
        """A progress bar of bytes (shown when HostOptions.progress says so, else on a terminal)."""
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{desc} (rank {self.rank})",
                    disable=not self.show, leave=False)

    def undo(self, hw: HostWeights) -> None:
        """Another rank (or this one) failed: put the model back as it was, leave no file of this round."""
        self.rollback(hw)
        if self.round is not None:
            drop_files(self.round.locks, {k: self.round.paths[k] for k in self.round.created})
        hw.arenas, hw.files = [], []
        self.loader.undo()

    def rollback(self, hw: HostWeights) -> None:
        """Give every tensor already swapped into a mapping memory of its own again, on its original device,
        with the same values (a tensor loaded from a source: its meta tensor back); forget the mappings
        (unmapped once the last view dies); what was pinned while filling is unregistered first."""
        if hw._ranges and self.backend is not None:
            pinning.unpin_ranges(self.backend, hw._ranges)
        hw._ranges = []
        self.pinned_ahead.clear()
        for slot in hw.layout.slots:
            if id(slot) not in self.adopted:
                continue
            if any(e.original is not None for e in slot.entries):
                for e in slot.entries:
                    hw._disown([e.tensor])
                    unreplace(e)
                continue
            buf = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.devices[id(slot)])
            views = slot.views(buf, 0)
            buf.copy_(slot.source_bytes())
            for e, v in zip(slot.entries, views, strict=True):
                e.tensor.data = v
        hw._disown([e.tensor for e in hw._entries])
        hw._entries = []
        self.adopted.clear()
        hw.arenas, hw.files = [], []


@dataclass
class RankInfo:
    """What every rank tells the others in the first gather (a rank whose setup failed tells only that)."""

    setup: str | None = None  # this rank's options or weight source failed: the error's text
    setup_cls: str | None = None  # and its class's name
    key: Any = None  # the node key of its shm directory (None without shm files)
    dir_err: str | None = None
    err: str | None = None  # a problem matching the weight source
    state_err: str | None = None  # a problem of the model (a meta tensor, weights another model holds)
    owner: shm.Owner | None = None
    slots: list[tuple[str, Claim, int]] = field(default_factory=list)  # per slot: signature, claim, bytes
    names: list[str] = field(default_factory=list)  # per slot, when distributed
    # settings every rank must agree on (AGREED names each)
    skip: bool = False
    ep: int | None = None
    unsafe: bool = False
    pin: bool = False
    conc: int | None = None
    mismatch: str | None = None
    verify: str | None = None
    writes: str | None = None
    loading: bool = False
    bytes: int = 0  # weight bytes
    avail: int = 0  # host memory available


#: RankInfo fields every rank must hold alike, and what each is to a user.
AGREED = (("skip", "MAGI_SKIP_SHM"), ("ep", "the EP size (MAGI_EP_SIZE)"),
           ("unsafe", "_unsafe_share_across_ranks"), ("pin", "HostOptions.pin"),
           ("conc", "MAGI_PIN_CONCURRENCY"), ("mismatch", "HostOptions.on_mismatch"),
           ("verify", "HostOptions.verify_shared"), ("writes", "HostOptions.shared_writes"),
           ("loading", "loading from a weight source (magi_core.load on every rank, or on none)"))


def check_agreement(infos: list[RankInfo]) -> None:
    """Raise when the ranks disagree on a setting they must hold alike (:data:`AGREED`)."""
    for field_name, what in AGREED:
        values = {repr(getattr(i, field_name)) for i in infos}
        if len(values) > 1:
            raise ConfigError(f"ranks disagree on {what}: {[getattr(i, field_name) for i in infos]}; set it the same "
                              "on every rank")


@dataclass
class RoundResult:
    """What a rank reports at the end of a round: its error, the signatures (and names, with their writers) of
    its slots that differ from the copy it was to share, and the weight source's late problems."""

    err: str | None
    bad: list[str]
    late: str | None
    names: list[tuple[str, int]]


def drop_files(locks: dict[str, int], paths: dict[str, str]) -> None:
    """Unlink the files, then close the fds holding their locks (idempotent)."""
    for p in paths.values():
        shm.unlink(p)
    for fd in locks.values():
        os.close(fd)
    locks.clear()


def status(err: BaseException | None) -> str | None:
    """An error as the text other ranks receive (None for no error)."""
    return f"{type(err).__name__}: {err}" if err is not None else None


def show(names: list[str], n: int = 5) -> str:
    """The first ``n`` names, quoted, and how many more there are."""
    return ", ".join(repr(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def name_of(slot: Slot) -> str:
    """The names of a slot's tensors (tensors of one storage: named together)."""
    return " = ".join(e.names[0] for e in slot.entries)
