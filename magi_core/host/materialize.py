"""Stream a model's weights into shared host memory, share or split the files across ranks, pin in waves.

See :func:`materialize`. Order of work on every rank (collectives are on a gloo group, so they never
touch the device):

1. check the shm directory, plan the layout, fingerprint the tensors (sampled); gather (node key, owner,
   layout digest, fingerprints, directory problem); a problem on any rank raises on every rank
2. decide, identically on every rank, who writes which file and who maps it (EP > 1: one file per rank;
   EP 1: one per node, unless the sampled fingerprints already differ: error or per-rank files)
3. writers create their files exclusively (0600, ``flock``-ed until unlinked) with the space reserved;
   gather status (no room: every rank raises, nothing was changed)
4. writers stream: copy one slot, swap it into the module, free the original; gather status (under
   copy_on_write a file other ranks will map is written through a temporary shared mapping and the module
   gets copy-on-write views)
5. readers map the file and compare every byte of their own weights with it (before swapping anything
   in); gather; files unlinked. Any difference: with ``on_mismatch="error"`` every rank raises
   naming the tensors (the writer's model is put back in memory of its own); with ``"per_rank"`` the
   differing ranks repeat 3-5 with files of their own
6. pin in waves of ``concurrency`` ranks per node; then read_only: protect the shared mappings,
   copy_on_write: report a pin that copied the shared pages

Isolation (``HostOptions.shared_writes``): a write on one rank never reaches another. "copy_on_write"
(default): every rank maps a shared file ``MAP_PRIVATE`` (the writer too, after copying in through a
temporary shared mapping), so an in-place write changes that rank's pages only; registering such a mapping
with CUDA copies every page (measured on an H200), which :meth:`_Materializer._check_private_copies`
reports. "read_only": the shared mapping is ``mprotect``-ed read-only after pinning (CUDA refuses to
register a read-only range with default flags; one registered before stays valid), so a write is a SIGSEGV
that kills the process (torch does not check), but one copy per node stays true under pinning.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from magi_core.errors import ConfigError, MagiError
from magi_core.host import memstat, moves, pinning, shm
from magi_core.host.arena import Entry, Layout, collect, fingerprint, fingerprints, plan, same_bytes
from magi_core.host.config import HostOptions
from magi_core.host.errors import HostStateError, ShmSpaceError, WeightMismatchError
from magi_core.host.topology import Coordinator, Topology, build_topology, node_key
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[str, int, int], None]

_live_lock = threading.Lock()
_live: dict[int, HostWeights] = {}
_owned: dict[int, HostWeights] = {}  # id(tensor) -> owner, for tensors kept alive by their HostWeights
_by_model: weakref.WeakKeyDictionary[nn.Module, HostWeights] = weakref.WeakKeyDictionary()


@dataclass
class Arena:
    """One mapping (or plain buffer) holding the slots of one dtype."""

    key: str
    nbytes: int
    buf: torch.Tensor  # uint8 view of the whole mapping
    path: str | None = None
    inode: int | None = None
    shared_by: tuple[int, ...] = ()
    writer: int = 0
    mapping: Any = None  # the mmap object (kept alive by the views too)
    private: bool = False  # copy-on-write mapping (MAP_PRIVATE): this rank's writes stay its own
    read_only: bool = False  # mprotect-ed read-only (a write is a SIGSEGV)

    def info(self) -> dict[str, Any]:
        """JSON-able description."""
        return {"dtype": self.key, "nbytes": self.nbytes, "path": self.path, "inode": self.inode,
                "shared_by": list(self.shared_by), "writer": self.writer,
                "mapping": "copy_on_write" if self.private else "read_only" if self.read_only else
                "shared" if self.mapping is not None else "plain"}


@dataclass(frozen=True)
class HostLocation:
    """Where a tensor's bytes lie in the host arenas (see :meth:`HostWeights.locate`)."""

    arena: str
    """The arena's key (its dtype name)."""
    offset: int
    """Byte offset of the tensor's first element from the start of the arena."""
    nbytes: int
    """Bytes from the first to one past the last element (``numel * element_size`` for a contiguous tensor)."""
    path: str | None
    """The arena's shared-memory file (``None`` for plain host memory; files are unlinked once mapped)."""
    pinned: bool
    """True when all of the bytes lie in a range registered with the backend."""


@dataclass
class _Assignment:
    """Who writes the files this rank uses, and which ranks map them."""

    writer: int
    readers: tuple[int, ...]
    tag: str


class HostWeights:
    """A model's weights in host arenas: release with :meth:`release` (also on ``with`` exit and at exit)."""

    def __init__(self, model: nn.Module, layout: Layout, options: HostOptions, backend: Backend) -> None:
        self.options = options
        self.backend = backend
        self.layout = layout
        self.arenas: list[Arena] = []
        self.files: list[str] = []
        self.report: dict[str, Any] = {"timings": {}, "memory": {}}
        self.released = False
        self._ranges: list[tuple[int, int]] = []
        self._entries: list[Entry] = []
        self._patched: list[weakref.ref[nn.Module]] = []
        self._model = weakref.ref(model)
        self._lock = threading.Lock()
        self._mapping_refs: list[weakref.ref[Any]] = []

    # -- public ------------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held (no padding)."""
        return self.layout.weight_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered with the backend now."""
        return sum(n for _, n in self._ranges)

    @property
    def pinned_ranges(self) -> list[tuple[int, int]]:
        """The registered (ptr, nbytes) ranges."""
        return list(self._ranges)

    @property
    def mapped_ranges(self) -> list[tuple[int, int]]:
        """The (ptr, nbytes) of every arena backed by a shared-memory mapping."""
        return [(a.buf.data_ptr(), a.nbytes) for a in self.arenas if a.mapping is not None]

    def mapping_memory(self) -> dict[str, int]:
        """This process's ``Size``, ``Rss`` and ``Pss`` bytes of the arena mappings (see memstat.mapping_memory)."""
        return memstat.mapping_memory(self.mapped_ranges, [a.path for a in self.arenas if a.path])

    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t`` is one of the offloaded tensors."""
        return _owned.get(id(t)) is self

    def is_pinned(self, t: torch.Tensor) -> bool:
        """True when all of ``t``'s bytes lie in a registered range (safe for non_blocking copies)."""
        if t.numel() == 0:
            return False
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(p <= lo and hi <= p + n for p, n in self._ranges)

    def locate(self, t: torch.Tensor) -> HostLocation | None:
        """Where ``t``'s bytes lie in this object's arenas, or ``None`` when they are not (all) in one of them."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        lo = t.data_ptr()
        span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()
        for a in self.arenas:
            base = a.buf.data_ptr()
            if base <= lo and lo + span <= base + a.nbytes:
                return HostLocation(a.key, lo - base, span, a.path, self.is_pinned(t))
        return None

    def release(self, *, restore: bool = False) -> None:
        """Unregister every range, then unmap (idempotent).

        Default: the offloaded tensors become empty and the model refuses to run (its weights are gone).
        ``restore=True`` first copies the weights into ordinary host memory, so the model stays usable.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
            errors = pinning.unpin_ranges(self.backend, self._ranges)
            self._ranges = []
            moves.uninstall(self._patched)
            if restore:
                self._restore()
            else:
                for e in self._entries:
                    e.tensor.data = torch.empty(0, dtype=e.tensor.dtype)
            with _live_lock:
                _live.pop(id(self), None)
                for e in self._entries:
                    if _owned.get(id(e.tensor)) is self:
                        del _owned[id(e.tensor)]
            model = self._model()
            if model is not None:
                if _by_model.get(model) is self:
                    del _by_model[model]
                if not restore:
                    model.register_forward_pre_hook(_released_hook)
            self._entries = []
            self.arenas = []
            still = sum(1 for r in self._mapping_refs if r() is not None)
            if still:
                logger.warning("%d host mapping(s) stay mapped (unpinned) until the tensors still referencing them "
                               "are freed", still)
            self.report["released"] = {"restore": restore, "still_mapped": still, "unregister_errors": errors}
            if errors:
                raise MagiError(f"unregistering host ranges failed: {'; '.join(errors)}")

    def unmapped(self) -> bool:
        """True once every mapping of this object has been unmapped."""
        return all(r() is None for r in self._mapping_refs)

    def __enter__(self) -> HostWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.pinned_bytes}/{self.weight_bytes} bytes pinned"
        return f"HostWeights({len(self.arenas)} arena(s), {state})"

    # -- internals ---------------------------------------------------------------------------------
    def _restore(self) -> None:
        for slot in self.layout.slots:
            buf = torch.empty(slot.nbytes, dtype=torch.uint8)
            views = slot.views(buf, 0)
            buf.copy_(slot.source_bytes())
            for e, v in zip(slot.entries, views, strict=True):
                e.tensor.data = v

    def _adopt(self, slot_views: list[tuple[Entry, torch.Tensor]]) -> None:
        with _live_lock:
            for e, v in slot_views:
                e.tensor.data = v
                _owned[id(e.tensor)] = self
                self._entries.append(e)


def _released_hook(module: nn.Module, args: Any) -> None:
    raise HostStateError(
        f"{type(module).__name__}: its host weights were released (HostWeights.release()); materialise the "
        "weights again, or release with restore=True to keep using the model"
    )


@atexit.register
def _release_all() -> None:
    with _live_lock:
        live = list(_live.values())
    for hw in live:
        try:
            hw.release()
        except Exception as exc:  # at exit: log and go on with the others
            logger.error("releasing host weights at exit failed: %s", exc)


def _model_gone(hw_ref: weakref.ref[HostWeights]) -> None:
    hw = hw_ref()
    if hw is not None and not hw.released:
        hw.release()


# ---------------------------------------------------------------------------------------------------
def materialize(
    model: nn.Module,
    *,
    options: HostOptions | None = None,
    backend: Backend | None = None,
    on_progress: ProgressCallback | None = None,
) -> HostWeights:
    """Move every parameter and buffer of ``model`` into host arenas (shared memory, pinned in place).

    Parameters keep their identity (``.data`` is swapped); tied tensors stay one tensor. Under
    torch.distributed every rank must call this (it runs collectives on a gloo group).
    ``on_progress(phase, done_bytes, total_bytes)`` is called after each tensor is copied, mapped or pinned.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize() takes an nn.Module, got {type(model).__name__}")
    opts = (options or HostOptions()).resolve()
    if backend is None:
        from magi_core.plugin.manager import get_backend

        backend = get_backend()
    existing = _by_model.get(model)
    if existing is not None and not existing.released:
        if existing.options == opts:
            logger.info("model already materialised; returning its HostWeights")
            return existing
        raise HostStateError("the model is already materialised with other options; call release(restore=True) on "
                             "its HostWeights first")
    return _Materializer(model, opts, backend, on_progress).run()


class _Materializer:
    def __init__(self, model: nn.Module, opts: HostOptions, backend: Backend,
                 on_progress: ProgressCallback | None) -> None:
        self.model, self.opts, self.backend, self.on_progress = model, opts, backend, on_progress
        self.coord = Coordinator()
        self.rank = self.coord.rank
        self.t0 = time.perf_counter()
        self.show = opts.progress if opts.progress is not None else sys.stderr.isatty()
        self.adopted: set[int] = set()  # id() of the slots swapped into a mapping by _stream (for _rollback)
        self.devices: dict[int, torch.device] = {}

    def _phase(self, hw: HostWeights, name: str) -> None:
        now = time.perf_counter()
        hw.report["timings"][name] = now - self.t0
        snap = memstat.snapshot()
        hw.report["memory"][name] = snap
        logger.info("rank %d: host weights %s after %.2fs; %s", self.rank, name, now - self.t0, memstat.fmt(snap))

    def _gather_status(self, err: BaseException | None) -> list[str | None]:
        return self.coord.all_gather(_status(err))

    def _fail_all(self, statuses: list[str | None], own: BaseException | None,
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

    def run(self) -> HostWeights:
        opts = self.opts
        entries = collect(self.model)
        for e in entries:
            if id(e.tensor) in _owned:
                raise HostStateError(f"{e.names[0]} already lives in host memory materialised for another module; "
                                     "materialise the outer model once")
        layout = plan(entries, opts.alignment)
        self.devices = {id(s): s.entries[0].tensor.device for s in layout.slots}
        hw = HostWeights(self.model, layout, opts, self.backend)
        assert opts.shm_dir is not None and opts.ep_size is not None
        dir_err: BaseException | None = None
        if not opts.skip_shm:  # before any file exists, on every rank; a problem on one rank raises on all
            try:
                hw.report["shm_fs"] = shm.check_dir(opts.shm_dir)
            except (ConfigError, ShmSpaceError) as exc:
                dir_err = exc
        sharing = opts.ep_size == 1 or opts._unsafe_share_across_ranks
        need_fp = self.coord.world_size > 1 and sharing and not opts._unsafe_share_across_ranks and not opts.skip_shm
        own_fps = fingerprints(layout.entries, opts.fingerprint_samples) if need_fp else []
        owner = shm.Owner.current()
        info = {
            "key": node_key(opts.shm_dir) if not opts.skip_shm and dir_err is None else None,
            "dir_err": _status(dir_err),
            "owner": owner, "digest": layout.digest(), "fps": own_fps, "skip": bool(opts.skip_shm),
            "ep": opts.ep_size, "unsafe": opts._unsafe_share_across_ranks, "pin": opts.pin,
            "conc": opts.pin_concurrency, "mismatch": opts.on_mismatch, "verify": opts.verify_shared,
            "writes": opts.shared_writes,
            "bytes": sum(layout.arena_bytes.values()), "avail": memstat.available_bytes(),
            "names": [e.names[0] for e in layout.entries] if need_fp else [],
        }
        infos = self.coord.all_gather(info)
        self._fail_all([i["dir_err"] for i in infos], dir_err, cls=ConfigError)
        self._check_agreement(infos)
        self._phase(hw, "planned")
        if opts.skip_shm:
            self._plain(hw)
            return self._finish(hw, None, infos)
        topo = build_topology(self.rank, [i["key"] for i in infos], opts.ep_size, opts.shm_dir)
        assign = self._assign(topo, infos)  # the sampled pre-check: raises here, before any file, when it sees it
        hw.report.update(rank=self.rank, node_ranks=list(topo.node_ranks), ep_size=opts.ep_size)
        verify = self.coord.world_size > 1 and opts.verify_shared == "full" and not opts._unsafe_share_across_ranks
        bad = self._share(hw, infos, assign, assign[self.rank], [] if verify else own_fps, verify)
        if bad:  # on_mismatch='per_rank' (else _share raised): the differing ranks make files of their own
            for r, names in sorted(bad.items()):
                logger.warning("%s; it gets its own file (on_mismatch='per_rank')",
                               _differs_text(r, assign[r].writer, names))
            again = {r: _Assignment(writer=r, readers=(r,), tag=f"rank{r}") for r in bad}
            self._share(hw, infos, again, again.get(self.rank), [], False)
        mine = _Assignment(self.rank, (self.rank,), "") if self.rank in bad else assign[self.rank]
        readers = tuple(r for r in mine.readers if r not in bad)
        for a in hw.arenas:
            a.shared_by = readers
        hw.report.update(mode="shared" if len(readers) > 1 else ("per_rank" if topo.distributed else "single"),
                         shared_by=list(readers), writer=mine.writer, verify=opts.verify_shared if verify else None)
        return self._finish(hw, topo, infos)

    def _share(self, hw: HostWeights, infos: list[dict[str, Any]], assign: dict[int, _Assignment],
               mine: _Assignment | None, own_fps: list[int], verify: bool) -> dict[int, list[str]]:
        """One round of files: writers create and stream, readers map and check every byte, files unlinked.

        Every rank takes part in the collectives (``mine`` None: no file this round). Returns, for every rank
        whose weights differ from the file it was to share, the names of the differing tensors (``verify``).
        """
        opts = self.opts
        assert opts.shm_dir is not None
        layout = hw.layout
        total = layout.weight_bytes
        writing = mine is not None and mine.writer == self.rank
        reading = mine is not None and mine.writer != self.rank
        shared = mine is not None and len(mine.readers) > 1
        cow = shared and opts.shared_writes == "copy_on_write"
        paths: dict[str, str] = {}
        if mine is not None:
            writer_owner: shm.Owner = infos[mine.writer]["owner"]
            paths = {k: os.path.join(opts.shm_dir, shm.file_name(writer_owner, f"{mine.tag}-{k}"))
                     for k in layout.arena_bytes}
        locks: dict[str, int] = {}  # the writer's fds: each holds its file's lock until the file is unlinked

        def undo() -> None:  # another rank failed: put the model back as it was, leave no file
            if writing:
                self._rollback(hw)
                self._drop_files(locks, paths)
            hw.arenas, hw.files = [], []

        # 3. writers create their files
        err: BaseException | None = None
        if writing:
            try:
                if opts.cleanup_stale:
                    hw.report.setdefault("stale_removed", []).extend(shm.cleanup_stale(opts.shm_dir))
                shm.check_room(opts.shm_dir, sum(layout.arena_bytes.values()), files=len(paths))
                for k, p in paths.items():
                    locks[k] = shm.create(p, layout.arena_bytes[k])
            except BaseException as exc:
                err = exc
                self._drop_files(locks, paths)
        self._fail_all(self._gather_status(err), err, undo)

        # 4. writers stream the weights in (through a shared mapping; under copy_on_write the model gets
        #    copy-on-write views of a file other ranks map too, so a write on this rank never reaches theirs)
        if writing:
            try:
                assert mine is not None
                arenas = self._map(hw, locks, paths, mine, private=cow)
                if not shared:
                    self._drop_files(locks, paths)  # mapped: nobody else needs the name
                self._stream(hw, arenas, total, locks if cow else None)
            except BaseException as exc:
                err = exc
                undo()
        self._fail_all(self._gather_status(err), err, undo)
        if writing:
            self._phase(hw, "copied")

        # 5. readers map the writer's files (shared, made read-only in _finish; or copy-on-write) and check them
        #    against their own weights before swapping anything in
        differing: list[str] = []
        arenas = []
        if reading:
            fds: dict[str, int] = {}
            try:
                for k, p in paths.items():
                    fds[k] = shm.open_existing(p, layout.arena_bytes[k], writable=not cow)
                assert mine is not None
                arenas = self._map(hw, fds, paths, mine, private=cow)
                if verify:
                    differing = self._verify(hw, arenas, total)
                elif own_fps:
                    self._check_sampled(hw, arenas, own_fps)
            except BaseException as exc:
                err = exc
                hw.arenas, hw.files = [], []
            finally:
                for fd in fds.values():
                    os.close(fd)
        results = self.coord.all_gather({"err": _status(err), "bad": differing})
        if writing:
            self._drop_files(locks, paths)  # every rank that shares them has mapped them (or failed)
        bad = {r: x["bad"] for r, x in enumerate(results) if x["bad"]}
        self._fail_all([x["err"] for x in results], err, undo)
        if bad and opts.on_mismatch == "error":
            undo()
            raise WeightMismatchError(
                "ranks that would share one host file hold different weights (found by comparing every byte; the "
                "sampled fingerprints agreed): " + "; ".join(_differs_text(r, assign[r].writer, names)
                                                             for r, names in sorted(bad.items())) + ". " + _FIX)
        if reading:
            if differing:
                hw.arenas, hw.files = [], []  # unmapped once the views die; this rank writes its own file next
            else:
                self._swap(hw, arenas, total)
                self._phase(hw, "mapped")
        return bad
    # -- decisions --------------------------------------------------------------------------------
    def _check_agreement(self, infos: list[dict[str, Any]]) -> None:
        for field_name, what in (("skip", "MAGI_SKIP_SHM"), ("ep", "the EP size (MAGI_EP_SIZE)"),
                                 ("unsafe", "_unsafe_share_across_ranks"), ("pin", "HostOptions.pin"),
                                 ("conc", "MAGI_PIN_CONCURRENCY"), ("mismatch", "HostOptions.on_mismatch"),
                                 ("verify", "HostOptions.verify_shared"), ("writes", "HostOptions.shared_writes")):
            values = {repr(i[field_name]) for i in infos}
            if len(values) > 1:
                raise ConfigError(f"ranks disagree on {what}: {[i[field_name] for i in infos]}; set it the same on "
                                  "every rank")

    def _assign(self, topo: Topology, infos: list[dict[str, Any]]) -> dict[int, _Assignment]:
        """Writer and readers for every rank (deterministic on every rank), from the layouts and sampled
        fingerprints: the fast pre-check; ranks it lets share are checked on every byte after the copy."""
        opts = self.opts
        out: dict[int, _Assignment] = {}
        nodes: dict[Any, list[int]] = {}
        for r, i in enumerate(infos):
            nodes.setdefault(i["key"], []).append(r)
        problems: list[str] = []
        for ranks in nodes.values():
            if (opts.ep_size or 1) > 1 and not opts._unsafe_share_across_ranks:
                for r in ranks:
                    out[r] = _Assignment(writer=r, readers=(r,), tag=f"rank{r}")
                continue
            leader = ranks[0]
            same = [r for r in ranks if infos[r]["digest"] == infos[leader]["digest"]
                    and (opts._unsafe_share_across_ranks or infos[r]["fps"] == infos[leader]["fps"])]
            for r in ranks:
                if r in same:
                    out[r] = _Assignment(writer=leader, readers=tuple(same), tag=f"node{leader}")
                else:
                    problems.append(self._mismatch_text(infos, leader, r))
                    out[r] = _Assignment(writer=r, readers=(r,), tag=f"rank{r}")
        if problems and opts.on_mismatch == "error":
            raise WeightMismatchError(
                "ranks that would share one host file hold different weights: " + "; ".join(problems) + ". " + _FIX
            )
        for p in problems:
            logger.warning("%s; it gets its own file (on_mismatch='per_rank')", p)
        return out

    @staticmethod
    def _mismatch_text(infos: list[dict[str, Any]], leader: int, r: int) -> str:
        if infos[r]["digest"] != infos[leader]["digest"]:
            return f"rank {r} has a different model structure (layout) than rank {leader}"
        a, b = infos[leader]["fps"], infos[r]["fps"]
        first = next(i for i in range(len(a)) if a[i] != b[i])
        n = sum(1 for x, y in zip(a, b, strict=True) if x != y)
        return f"rank {r} differs from rank {leader} in {n} tensor(s), first {infos[r]['names'][first]!r}"

    # -- work ------------------------------------------------------------------------------------
    def _map(self, hw: HostWeights, fds: dict[str, int], paths: dict[str, str], mine: _Assignment,
             private: bool) -> list[Arena]:
        """Map every file (the fds stay open: the caller closes them); ``private``: copy-on-write."""
        arenas = []
        for k, fd in fds.items():
            nbytes = hw.layout.arena_bytes[k]
            mm = shm.map_fd(fd, nbytes, private=private)
            inode = os.fstat(fd).st_ino
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            arenas.append(Arena(key=k, nbytes=nbytes, buf=buf, path=paths[k], inode=int(inode),
                                shared_by=mine.readers, writer=mine.writer, mapping=mm, private=private))
            hw._mapping_refs.append(weakref.ref(mm))
        hw.arenas = arenas
        hw.files = [a.path for a in arenas if a.path]
        return arenas

    def _progress(self, desc: str, total: int) -> tqdm:
        return tqdm(total=total, unit="B", unit_scale=True, desc=f"{desc} (rank {self.rank})",
                    disable=not self.show, leave=False)

    def _stream(self, hw: HostWeights, arenas: list[Arena], total: int, write_fds: dict[str, int] | None) -> None:
        """Copy slot by slot and swap each into the model at once (its original is freed there).

        ``write_fds``: the arenas are copy-on-write views of these files; the bytes go in through a temporary
        shared mapping of each (a private mapping's pages read the file until this process writes them).
        """
        by_key = {a.key: a for a in arenas}
        maps: dict[str, Any] = {}
        dst: dict[str, torch.Tensor] = {a.key: a.buf for a in arenas}
        if write_fds is not None:
            for k, fd in write_fds.items():
                maps[k] = shm.map_fd(fd, by_key[k].nbytes)
                dst[k] = torch.frombuffer(maps[k], dtype=torch.uint8)
        done = 0
        buf: torch.Tensor | None = None
        into: list[torch.Tensor] = []
        try:
            with self._progress("magi: materialise", total) as bar:
                for slot in hw.layout.slots:
                    buf = dst[slot.arena]
                    into = slot.views(buf, slot.offset)
                    slot.copy_from_model(buf[slot.offset: slot.offset + slot.nbytes], into)
                    views = into if write_fds is None else slot.views(by_key[slot.arena].buf, slot.offset)
                    self.adopted.add(id(slot))
                    hw._adopt(list(zip(slot.entries, views, strict=True)))  # the originals are freed here
                    done += slot.nbytes
                    bar.update(slot.nbytes)
                    if self.on_progress is not None:
                        self.on_progress("copy", done, total)
        finally:
            dst.clear()
            buf, into = None, []  # drop every view of the write mappings, so they can be unmapped now
            for m in maps.values():
                try:
                    m.close()
                except BufferError:  # a view still exists somewhere: unmapped when it dies
                    pass

    def _verify(self, hw: HostWeights, arenas: list[Arena], total: int) -> list[str]:
        """Names of this rank's tensors whose bytes differ from the mapped file's (every byte compared)."""
        by_key = {a.key: a for a in arenas}
        bad: list[str] = []
        done = 0
        t0 = time.perf_counter()
        for slot in hw.layout.slots:
            region = by_key[slot.arena].buf[slot.offset: slot.offset + slot.nbytes]
            if not same_bytes(slot.source_bytes(), region):
                bad.append(" = ".join(e.names[0] for e in slot.entries))  # tensors of one storage: named together
            done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("verify", done, total)
        seconds = time.perf_counter() - t0
        hw.report["verify_seconds"] = seconds
        logger.info("rank %d: compared %d bytes with the shared file in %.2fs (%.2f GB/s)%s", self.rank, done,
                    seconds, done / max(seconds, 1e-9) / 1e9, f"; {len(bad)} tensor(s) differ" if bad else "")
        return bad

    def _check_sampled(self, hw: HostWeights, arenas: list[Arena], own_fps: list[int]) -> None:
        """verify_shared='sampled': the mapped values' fingerprints must be this rank's."""
        by_key = {a.key: a for a in arenas}
        i = 0
        for slot in hw.layout.slots:
            for e, v in zip(slot.entries, slot.views(by_key[slot.arena].buf, slot.offset), strict=True):
                if fingerprint(v, self.opts.fingerprint_samples) != own_fps[i]:
                    raise WeightMismatchError(f"rank {self.rank}: the shared file holds other values for "
                                              f"{e.names[0]!r} than this rank's weights; nothing was replaced")
                i += 1

    def _swap(self, hw: HostWeights, arenas: list[Arena], total: int) -> None:
        by_key = {a.key: a for a in arenas}
        done = 0
        for slot in hw.layout.slots:
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            hw._adopt(list(zip(slot.entries, views, strict=True)))
            done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("map", done, total)

    def _rollback(self, hw: HostWeights) -> None:
        """Give every tensor already swapped into a mapping memory of its own again, on its original device,
        with the same values; forget the mappings (unmapped once the last view dies)."""
        for slot in hw.layout.slots:
            if id(slot) not in self.adopted:
                continue
            buf = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.devices[id(slot)])
            views = slot.views(buf, 0)
            buf.copy_(slot.source_bytes())
            for e, v in zip(slot.entries, views, strict=True):
                e.tensor.data = v
        with _live_lock:
            for e in hw._entries:
                if _owned.get(id(e.tensor)) is hw:
                    del _owned[id(e.tensor)]
        hw._entries = []
        self.adopted.clear()
        hw.arenas, hw.files = [], []

    def _plain(self, hw: HostWeights) -> None:
        """MAGI_SKIP_SHM: host tensors stay as they are; device tensors are copied to plain host memory."""
        hw.report.update(mode="plain", rank=self.rank)
        done, total = 0, hw.layout.weight_bytes
        for slot in hw.layout.slots:
            t = slot.entries[0].tensor
            if t.device.type == "cpu":
                views = [e.tensor.data for e in slot.entries]
            else:
                buf = torch.empty(slot.nbytes, dtype=torch.uint8)
                views = slot.views(buf, 0)
                slot.copy_from_model(buf, views)
            hw._adopt(list(zip(slot.entries, views, strict=True)))
            done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("copy", done, total)
        self._phase(hw, "copied")

    def _finish(self, hw: HostWeights, topo: Topology | None, infos: list[dict[str, Any]]) -> HostWeights:
        with _live_lock:
            _live[id(hw)] = hw
        _by_model[self.model] = hw
        weakref.finalize(self.model, _model_gone, weakref.ref(hw))
        modules = [m for m in self.model.modules()
                   if any(t is not None and hw.owns(t) for t in (*m._parameters.values(), *m._buffers.values()))]
        hw._patched = moves.install(modules, hw.owns)
        if topo is not None and self.opts.pin and self.backend is not None:
            self._pin(hw, topo, infos)
        if self.opts.shared_writes == "read_only":
            self._protect(hw)
        else:
            self._check_private_copies(hw)
        hw.report["pinned_bytes"] = hw.pinned_bytes
        hw.report["weight_bytes"] = hw.weight_bytes
        hw.report["files"] = [a.info() for a in hw.arenas]
        self._phase(hw, "done")
        return hw

    def _check_private_copies(self, hw: HostWeights) -> None:
        """Say so when pinning a copy-on-write mapping of a shared file made it this rank's own copy."""
        cow = [(a.buf.data_ptr(), a.nbytes) for a in hw.arenas if a.private and len(a.shared_by) > 1]
        pinned = sum(n for p, n in hw._ranges if any(lo <= p < lo + size for lo, size in cow))
        if not pinned:
            return
        anon = memstat.mapping_memory(cow, keys=("Anonymous",))["Anonymous"]
        hw.report["private_copy_bytes"] = anon
        if anon >= pinned // 2:
            logger.warning(
                "rank %d: pinning the host weights shared with ranks %s made this rank a private copy of them "
                "(%.2f GiB): the backend registers memory for writing, which breaks copy-on-write (CUDA does, with "
                "or without its read-only flag), so every rank sharing the file now holds its own copy. To "
                "keep one copy per node use HostOptions(shared_writes='read_only') (an in-place write to the "
                "weights then kills the process); or pin less (MAGI_PIN_BUDGET_GB)",
                self.rank, list(hw.arenas[0].shared_by), anon / 2**30)

    def _protect(self, hw: HostWeights) -> None:
        """Make every mapping shared with other ranks read-only (after pinning: CUDA refuses to register a
        read-only range with default flags; a registration made before stays valid)."""
        shared = [a for a in hw.arenas if a.mapping is not None and not a.private and len(a.shared_by) > 1]
        for a in shared:
            try:
                shm.protect(a.buf.data_ptr(), a.nbytes, writable=False)
                a.read_only = True
            except OSError as exc:  # ENOMEM (mapping count limit) only: say so loudly, the weights stay correct
                logger.error("rank %d: could not make the shared host weights read-only (%s): an in-place write "
                             "on this rank would reach the other ranks sharing the file", self.rank, exc)
        if shared and all(a.read_only for a in shared):
            if not faulthandler.is_enabled():
                try:  # a write now kills the process: show where it came from
                    faulthandler.enable()
                except (RuntimeError, ValueError, OSError):  # stderr without a file descriptor
                    pass
            logger.info("rank %d: host weights shared with ranks %s are read-only: an in-place write to them "
                        "(param.add_, load_state_dict, a buffer update) kills this process with SIGSEGV. To edit "
                        "them, use HostOptions(shared_writes='copy_on_write') or one file per rank "
                        "(MAGI_EP_SIZE)", self.rank, list(shared[0].shared_by))

    def _pin(self, hw: HostWeights, topo: Topology, infos: list[dict[str, Any]]) -> None:
        opts = self.opts
        nodes: dict[Any, list[int]] = {}
        for r, i in enumerate(infos):
            nodes.setdefault(i["key"], []).append(r)

        def conc(ranks: list[int]) -> int:
            if opts.pin_concurrency is not None:
                return min(opts.pin_concurrency, len(ranks))
            return min(len(ranks), pinning.default_concurrency(min(infos[r]["avail"] for r in ranks),
                                                               max(infos[r]["bytes"] for r in ranks)))

        waves = max(pinning.wave_plan(0, len(rs), conc(rs))[1] for rs in nodes.values())
        c = conc(list(topo.node_ranks))
        my_wave, _ = pinning.wave_plan(topo.local_rank, topo.local_world_size, c)
        ranges = [(a.buf.data_ptr(), a.nbytes) for a in hw.arenas]
        result = pinning.PinResult()
        budget_total = sum(n for _, n in ranges) if opts.pin_budget_bytes is None else \
            min(opts.pin_budget_bytes, sum(n for _, n in ranges))
        for w in range(waves):
            if w == my_wave:
                done = 0
                with self._progress("magi: pin", budget_total) as bar:
                    def step(n: int) -> None:
                        nonlocal done
                        done += n
                        bar.update(n)
                        if self.on_progress is not None:
                            self.on_progress("pin", done, budget_total)
                    extents = {a.buf.data_ptr(): sorted((s.offset, s.offset + s.nbytes) for s in hw.layout.slots
                                                        if s.arena == a.key) for a in hw.arenas}
                    result = pinning.pin_ranges(self.backend, ranges, opts.pin_budget_bytes, step, self.rank,
                                                extents)
                hw._ranges = result.ranges
                logger.info("rank %d: pinned %d of %d bytes in %.2fs (wave %d of %d, %d rank(s) at once)",
                            self.rank, result.pinned_bytes, sum(n for _, n in ranges), result.seconds, w + 1, waves, c)
            self.coord.barrier()
        hw.report["pin"] = {"seconds": result.seconds, "pinned_bytes": result.pinned_bytes, "wave": my_wave,
                            "waves": waves, "concurrency": c, "budget": opts.pin_budget_bytes, "error": result.error,
                            "memlock": pinning.memlock_limit() if result.error else None}
        self._phase(hw, "pinned")

    @staticmethod
    def _drop_files(locks: dict[str, int], paths: dict[str, str]) -> None:
        """Unlink the files, then close the fds holding their locks (idempotent)."""
        for p in paths.values():
            shm.unlink(p)
        for fd in locks.values():
            os.close(fd)
        locks.clear()


_FIX = ("If the model is expert-parallel, set MAGI_EP_SIZE (or HostOptions(ep_size=...)) so every rank gets its own "
        "file; to give only the differing ranks their own files, use HostOptions(on_mismatch='per_rank')")


def _status(err: BaseException | None) -> str | None:
    return f"{type(err).__name__}: {err}" if err is not None else None


def _differs_text(rank: int, writer: int, names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"rank {rank} differs from rank {writer} in {len(names)} tensor(s): {shown}"


__all__ = ["Arena", "HostWeights", "ProgressCallback", "materialize"]
