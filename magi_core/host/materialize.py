"""Stream a model's weights into shared host memory, share or split the files across ranks, pin in waves.

See :func:`materialize`. Order of work on every rank (collectives are on a gloo group, so they never
touch the device):

1. plan the layout, fingerprint the tensors; gather (node key, owner, layout digest, fingerprints)
2. decide, identically on every rank, who writes which file and who maps it (EP > 1: one file per rank;
   EP 1: one per node, unless weights differ: error or per-rank files); a problem raises on every rank
3. writers create their files exclusively (0600) with the space reserved; gather status (no room: every
   rank raises, nothing was changed)
4. writers stream: copy one slot, swap it into the module, free the original; gather status
5. readers map, check the mapped values against their own fingerprints, swap; gather; files unlinked
6. pin in waves of ``concurrency`` ranks per node
"""

from __future__ import annotations

import atexit
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
from magi_core.host.arena import Entry, Layout, collect, fingerprint, fingerprints, plan
from magi_core.host.config import HostOptions
from magi_core.host.errors import HostStateError, WeightMismatchError
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

    def info(self) -> dict[str, Any]:
        """JSON-able description."""
        return {"dtype": self.key, "nbytes": self.nbytes, "path": self.path, "inode": self.inode,
                "shared_by": list(self.shared_by), "writer": self.writer}


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

    def _phase(self, hw: HostWeights, name: str) -> None:
        now = time.perf_counter()
        hw.report["timings"][name] = now - self.t0
        snap = memstat.snapshot()
        hw.report["memory"][name] = snap
        logger.info("rank %d: host weights %s after %.2fs; %s", self.rank, name, now - self.t0, memstat.fmt(snap))

    def _fail_all(self, statuses: list[str | None], own: BaseException | None) -> None:
        bad = [(r, s) for r, s in enumerate(statuses) if s]
        if not bad:
            return
        if own is not None:
            raise own
        raise MagiError("host weights: " + "; ".join(f"rank {r}: {s}" for r, s in bad))

    def run(self) -> HostWeights:
        opts = self.opts
        entries = collect(self.model)
        for e in entries:
            if id(e.tensor) in _owned:
                raise HostStateError(f"{e.names[0]} already lives in host memory materialised for another module; "
                                     "materialise the outer model once")
        layout = plan(entries, opts.alignment)
        hw = HostWeights(self.model, layout, opts, self.backend)
        assert opts.shm_dir is not None and opts.ep_size is not None
        if not opts.skip_shm:
            os.makedirs(opts.shm_dir, exist_ok=True)
        sharing = opts.ep_size == 1 or opts._unsafe_share_across_ranks
        need_fp = self.coord.world_size > 1 and sharing and not opts._unsafe_share_across_ranks and not opts.skip_shm
        own_fps = fingerprints(layout.entries, opts.fingerprint_samples) if need_fp else []
        owner = shm.Owner.current()
        info = {
            "key": node_key(opts.shm_dir) if not opts.skip_shm else None,
            "owner": owner, "digest": layout.digest(), "fps": own_fps, "skip": bool(opts.skip_shm),
            "ep": opts.ep_size, "unsafe": opts._unsafe_share_across_ranks, "pin": opts.pin,
            "conc": opts.pin_concurrency,
            "bytes": sum(layout.arena_bytes.values()), "avail": memstat.available_bytes(),
            "names": [e.names[0] for e in layout.entries] if need_fp else [],
        }
        infos = self.coord.all_gather(info)
        self._check_agreement(infos)
        self._phase(hw, "planned")
        if opts.skip_shm:
            self._plain(hw)
            return self._finish(hw, None, infos)
        topo = build_topology(self.rank, [i["key"] for i in infos], opts.ep_size, opts.shm_dir)
        assign = self._assign(topo, infos)
        mine = assign[self.rank]
        writer_owner: shm.Owner = infos[mine.writer]["owner"]
        paths = {k: os.path.join(opts.shm_dir, shm.file_name(writer_owner, f"{mine.tag}-{k}"))
                 for k in layout.arena_bytes}
        hw.report.update(mode="shared" if len(mine.readers) > 1 else ("per_rank" if topo.distributed else "single"),
                         rank=self.rank, node_ranks=list(topo.node_ranks), ep_size=opts.ep_size,
                         shared_by=list(mine.readers), writer=mine.writer)

        # 3. writers create their files
        fds: dict[str, int] = {}
        err: BaseException | None = None
        if mine.writer == self.rank:
            try:
                if opts.cleanup_stale:
                    hw.report["stale_removed"] = shm.cleanup_stale(opts.shm_dir)
                shm.check_room(opts.shm_dir, sum(layout.arena_bytes.values()))
                for k, p in paths.items():
                    fds[k] = shm.create(p, layout.arena_bytes[k])
            except BaseException as exc:
                err = exc
                self._close_and_unlink(fds, paths)
        self._fail_all(self.coord.all_gather(f"{type(err).__name__}: {err}" if err else None), err)

        # 4. writers stream the weights in
        total = layout.weight_bytes
        if mine.writer == self.rank:
            try:
                arenas = self._map(hw, fds, paths, mine)
                if len(mine.readers) == 1:
                    self._unlink(paths)
                self._stream(hw, arenas, total)
            except BaseException as exc:
                err = exc
                self._unlink(paths)
        self._fail_all(self.coord.all_gather(f"{type(err).__name__}: {err}" if err else None), err)
        if mine.writer == self.rank:
            self._phase(hw, "copied")

        # 5. readers map the writer's files
        if mine.writer != self.rank:
            try:
                for k, p in paths.items():
                    fds[k] = shm.open_existing(p, layout.arena_bytes[k])
                arenas = self._map(hw, fds, paths, mine)
                self._swap_mapped(hw, arenas, own_fps, total)
            except BaseException as exc:
                err = exc
                for fd in fds.values():
                    os.close(fd)
                fds.clear()
        statuses = self.coord.all_gather(f"{type(err).__name__}: {err}" if err else None)
        if mine.writer == self.rank:
            self._unlink(paths)  # every rank that shares them has mapped them (or failed)
        self._fail_all(statuses, err)
        if mine.writer != self.rank:
            self._phase(hw, "mapped")
        return self._finish(hw, topo, infos)

    # -- decisions --------------------------------------------------------------------------------
    def _check_agreement(self, infos: list[dict[str, Any]]) -> None:
        for field_name, what in (("skip", "MAGI_SKIP_SHM"), ("ep", "the EP size (MAGI_EP_SIZE)"),
                                 ("unsafe", "_unsafe_share_across_ranks"), ("pin", "HostOptions.pin"),
                                 ("conc", "MAGI_PIN_CONCURRENCY")):
            values = {repr(i[field_name]) for i in infos}
            if len(values) > 1:
                raise ConfigError(f"ranks disagree on {what}: {[i[field_name] for i in infos]}; set it the same on "
                                  "every rank")

    def _assign(self, topo: Topology, infos: list[dict[str, Any]]) -> dict[int, _Assignment]:
        """Writer and readers for every rank of this rank's node (deterministic on every rank)."""
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
                "ranks that would share one host file hold different weights: " + "; ".join(problems) +
                ". If the model is expert-parallel, set MAGI_EP_SIZE (or HostOptions(ep_size=...)) so every rank "
                "gets its own file; to give only the differing ranks their own files, use "
                "HostOptions(on_mismatch='per_rank')"
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
    def _map(self, hw: HostWeights, fds: dict[str, int], paths: dict[str, str], mine: _Assignment) -> list[Arena]:
        arenas = []
        try:
            for k, fd in fds.items():
                nbytes = hw.layout.arena_bytes[k]
                mm = shm.map_fd(fd, nbytes)
                inode = os.fstat(fd).st_ino
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                arena = Arena(key=k, nbytes=nbytes, buf=buf, path=paths[k], inode=int(inode),
                              shared_by=mine.readers, writer=mine.writer, mapping=mm)
                arenas.append(arena)
                hw._mapping_refs.append(weakref.ref(mm))
        finally:
            for fd in fds.values():
                os.close(fd)
            fds.clear()
        hw.arenas = arenas
        hw.files = [a.path for a in arenas if a.path]
        return arenas

    def _progress(self, desc: str, total: int) -> tqdm:
        return tqdm(total=total, unit="B", unit_scale=True, desc=f"{desc} (rank {self.rank})",
                    disable=not self.show, leave=False)

    def _stream(self, hw: HostWeights, arenas: list[Arena], total: int) -> None:
        by_key = {a.key: a for a in arenas}
        done = 0
        with self._progress("magi: materialise", total) as bar:
            for slot in hw.layout.slots:
                buf = by_key[slot.arena].buf
                views = slot.views(buf, slot.offset)
                slot.copy_from_model(buf[slot.offset: slot.offset + slot.nbytes], views)
                hw._adopt(list(zip(slot.entries, views, strict=True)))  # the originals are freed here
                done += slot.nbytes
                bar.update(slot.nbytes)
                if self.on_progress is not None:
                    self.on_progress("copy", done, total)

    def _swap_mapped(self, hw: HostWeights, arenas: list[Arena], own_fps: list[int], total: int) -> None:
        by_key = {a.key: a for a in arenas}
        pending = []
        i = 0
        for slot in hw.layout.slots:
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            for e, v in zip(slot.entries, views, strict=True):
                if own_fps and fingerprint(v, self.opts.fingerprint_samples) != own_fps[i]:
                    raise WeightMismatchError(f"rank {self.rank}: the shared file holds other values for "
                                              f"{e.names[0]!r} than this rank's weights; nothing was replaced")
                i += 1
            pending.append((slot, views))
        done = 0
        for slot, views in pending:
            hw._adopt(list(zip(slot.entries, views, strict=True)))
            done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("map", done, total)

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
        hw.report["pinned_bytes"] = hw.pinned_bytes
        hw.report["weight_bytes"] = hw.weight_bytes
        hw.report["files"] = [a.info() for a in hw.arenas]
        self._phase(hw, "done")
        return hw

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
                    result = pinning.pin_ranges(self.backend, ranges, opts.pin_budget_bytes, step, self.rank)
                hw._ranges = result.ranges
                logger.info("rank %d: pinned %d of %d bytes in %.2fs (wave %d of %d, %d rank(s) at once)",
                            self.rank, result.pinned_bytes, sum(n for _, n in ranges), result.seconds, w + 1, waves, c)
            self.coord.barrier()
        hw.report["pin"] = {"seconds": result.seconds, "pinned_bytes": result.pinned_bytes, "wave": my_wave,
                            "waves": waves, "concurrency": c, "budget": opts.pin_budget_bytes, "error": result.error,
                            "memlock": pinning.memlock_limit() if result.error else None}
        self._phase(hw, "pinned")

    @staticmethod
    def _close_and_unlink(fds: dict[str, int], paths: dict[str, str]) -> None:
        for k, fd in fds.items():
            os.close(fd)
            shm.unlink(paths[k])
        fds.clear()

    @staticmethod
    def _unlink(paths: dict[str, str]) -> None:
        for p in paths.values():
            shm.unlink(p)


__all__ = ["Arena", "HostWeights", "ProgressCallback", "materialize"]
