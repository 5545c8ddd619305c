"""Stream a model's weights into shared host memory, share each tensor across the ranks that hold it, pin in waves.

See :func:`materialize`. The weights come from the model's own tensors, or from a weight source (a model built
on the meta device: :mod:`magi_core.host.loading`). Order of work on every rank (collectives are on a gloo group,
so they never touch the device):

1. check the shm directory, group the tensors into slots (one per storage), match them with the weight source
   (missing / unexpected / mis-shaped tensors), give each slot a claim: its provenance when it comes from a
   source, else a sampled fingerprint; gather (node key, owner, slot signatures and claims, problems); a
   problem on any rank raises on every rank
2. decide, identically on every rank, per slot: which ranks of the node hold one copy of it together (equal
   signature and claim), which member writes it (spread over the members), and whether the others must compare
   it with their own values (:func:`magi_core.host.topology.plan_sharing`). Each set of members gets one file per
   dtype, created by its lowest rank
3. creators create their files exclusively (0600, ``flock``-ed until unlinked): sparse where the kernel has
   ``MADV_POPULATE_WRITE`` (each writer thread allocates what it fills, or lets the read system call that fills
   a slot allocate it, with a clear error on a full filesystem either way), else with the space reserved;
   gather status (no room: every rank raises, nothing was changed)
4. every member maps its files; each slot's writer copies its own values (or reads the source) into it and
   swaps the mapping into the module at once (the original is freed there); gather status (under
   copy_on_write a file several ranks map is written through a temporary shared mapping and the modules get
   copy-on-write views)
5. the other members compare every byte of their own values with the copy (before swapping anything in);
   gather; files unlinked. A member that differs: with ``on_mismatch="copy"`` (default) it writes a copy of
   its own in a second round (3-5 with files of one rank); with ``"error"`` every rank raises naming the
   tensors (and every rank's model is put back as it was)
6. pin in waves of ``concurrency`` ranks per node; then read_only: protect the shared mappings,
   copy_on_write: report a pin that copied the shared pages. An arena only this rank maps (one rank per node,
   a copy of its own) is pinned in pieces while step 4 fills it (:class:`pinning.PinAhead`), unless a pin
   budget is set; step 6 pins what is left

Host memory per node is the bytes of the distinct tensors: each is held once per distinct content.

Isolation (``HostOptions.shared_writes``): a write on one rank never reaches another. "read_only" (default):
the shared mapping is ``mprotect``-ed read-only after pinning (CUDA refuses to register a read-only range with
default flags; one registered before stays valid), so a write is a SIGSEGV that kills the process (torch does
not check), but one copy per node stays true under pinning. "copy_on_write": every rank maps a shared file
``MAP_PRIVATE`` (the writer too, after copying in through a temporary shared mapping), so an in-place write
changes that rank's pages only; registering such a mapping with CUDA copies every page (measured on an H200),
which :meth:`_Materializer._check_private_copies` reports. A process forked from a rank (a DataLoader or
multiprocessing worker) maps the writable shared arenas copy-on-write (:func:`shm.track_for_fork`): its writes
stay its own.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno
import faulthandler
import hashlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from magi_core.errors import ConfigError, MagiError
from magi_core.host import memstat, moves, pinning, shm
from magi_core.host.arena import Entry, Layout, Slot, collect, dtype_key, fingerprint, group, place, same_bytes
from magi_core.host.config import DEFAULT_SHM_DIR, HostOptions
from magi_core.host.errors import HostStateError, ShmSpaceError, WeightMismatchError, WeightSourceError
from magi_core.host.loading import Loader, Rename, SourceSpec, open_source
from magi_core.host.topology import (
    Claim,
    Coordinator,
    Share,
    Topology,
    build_topology,
    global_order,
    node_key,
    plan_sharing,
)
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[str, int, int], None]

_live_lock = threading.Lock()
_live: dict[int, HostWeights] = {}
_owned: dict[int, HostWeights] = {}  # id(tensor) -> owner, for tensors kept alive by their HostWeights
_by_model: weakref.WeakKeyDictionary[nn.Module, HostWeights] = weakref.WeakKeyDictionary()

@dataclass
class Arena:
    """One mapping (or plain buffer) holding the slots of one dtype that one set of ranks shares."""

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
    write_map: Any = None  # while filling a copy-on-write arena: the shared mapping the bytes go through

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
    """The arena's key: its dtype's name, followed by ``-r<ranks>`` when not all the node's ranks share it."""
    offset: int
    """Byte offset of the tensor's first element from the start of the arena."""
    nbytes: int
    """Bytes from the first to one past the last element (``numel * element_size`` for a contiguous tensor)."""
    path: str | None
    """The arena's shared-memory file (``None`` for plain host memory; files are unlinked once mapped)."""
    pinned: bool
    """True when all of the bytes lie in a range registered with the backend."""


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
    def model(self) -> nn.Module | None:
        """The model these weights belong to (None once it was garbage-collected)."""
        return self._model()

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
                if e.tensor.is_meta:  # a meta tensor cannot take host data: a new one replaces it in every module
                    _replace(e, v)
                else:
                    e.tensor.data = v
                _owned[id(e.tensor)] = self
                self._entries.append(e)


def _retarget(module: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """Plain attributes of ``module`` holding the tensor ``old`` (an alias of a buffer) now hold ``new``."""
    for k, v in list(module.__dict__.items()):
        if v is old and not k.startswith("_"):
            module.__dict__[k] = new


def _replace(e: Entry, view: torch.Tensor) -> None:
    """Put ``view`` where the meta tensor of ``e`` was (a new Parameter for a parameter), everywhere it is held."""
    old = e.tensor
    new: torch.Tensor = nn.Parameter(view, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else view
    for module, attr, is_param in e.homes:
        (module._parameters if is_param else module._buffers)[attr] = new  # type: ignore[assignment]
        _retarget(module, old, new)
    e.original, e.tensor = old, new


def _unreplace(e: Entry) -> None:
    """Undo :func:`_replace`: the meta tensor is back in every module."""
    old = e.original
    if old is None:
        return
    for module, attr, is_param in e.homes:
        (module._parameters if is_param else module._buffers)[attr] = old  # type: ignore[assignment]
        _retarget(module, e.tensor, old)
    e.tensor, e.original = old, None


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
    source: SourceSpec | None = None,
    strict: bool = True,
    rename: Rename | None = None,
) -> HostWeights:
    """Move every parameter and buffer of ``model`` into host arenas (shared memory, pinned in place).

    Parameters keep their identity (``.data`` is swapped); tied tensors stay one tensor. With ``source`` (a
    weight source, see :func:`magi_core.host.loading.open_source`) the tensors on the meta device, and the real
    ones the source also holds, are read from it straight into the arenas (meta parameters become new
    ``nn.Parameter`` objects in every module that holds them); ``strict`` and ``rename`` as for
    :func:`magi_core.load`. Under torch.distributed every rank must call this (it runs collectives on a gloo
    group). ``on_progress(phase, done_bytes, total_bytes)`` is called after each tensor is copied, mapped or
    pinned.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize() takes an nn.Module, got {type(model).__name__}")
    # what this rank resolves alone (options and environment, the weight source) fails inside the first agreed
    # status: every rank raises at once instead of the others waiting in the first gather for the process
    # group's timeout
    setup: BaseException | None = None
    opts = _SETUP_FAILED
    try:
        if options is not None and not isinstance(options, HostOptions):
            raise ConfigError(f"materialize(options=...) takes a magi_core.host.HostOptions, got "
                              f"{type(options).__name__}: build one, e.g. HostOptions(pin=False)")
        if not isinstance(strict, bool):
            raise ConfigError(f"strict={strict!r} is invalid; expected True or False")
        for what, fn in (("rename", rename), ("on_progress", on_progress)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{what}={fn!r} is invalid; expected a function or None")
        opts = (options or HostOptions()).resolve()
    except ConfigError as exc:
        setup = exc
    if backend is None:
        from magi_core.plugin.manager import get_backend

        backend = get_backend()
    existing = _by_model.get(model)
    if setup is None and existing is not None and not existing.released:
        if existing.options == opts and source is None:
            logger.info("model already materialised; returning its HostWeights")
            return existing
        setup = HostStateError("the model is already materialised with other options (or weights); call "
                               "release(restore=True) on its HostWeights first")
    loader: Loader | None = None
    if source is not None and setup is None:
        try:
            loader = Loader(open_source(source), strict=strict, rename=rename)
        except (MagiError, OSError, TypeError, ValueError) as exc:
            setup = exc
    try:
        return _Materializer(model, opts, backend, on_progress, loader, setup).run()
    finally:
        if loader is not None:
            loader.close()


#: Stands in for the options of a rank whose own failed to resolve (it only takes part in the first gather).
_SETUP_FAILED = HostOptions(ep_size=1, skip_shm=True, pin=False, pin_concurrency=1, shm_dir=DEFAULT_SHM_DIR,
                            progress=False)
#: Classes of setup errors another rank's failure is raised as on this rank (by name).
_SETUP_CLASSES: dict[str, type[MagiError]] = {c.__name__: c for c in (ConfigError, WeightSourceError,
                                                                       HostStateError)}


@dataclass
class _Round:
    """One round of files on this rank: its slots with their shares, the arenas they go to, the files it creates."""

    items: list[tuple[Slot, Share]]
    sizes: dict[str, int]  # arena key -> bytes
    members: dict[str, tuple[int, ...]]  # arena key -> ranks mapping it
    paths: dict[str, str]  # arena key -> file
    created: list[str]  # arena keys whose file this rank creates
    locks: dict[str, int]  # created key -> fd holding the file's lock until it is unlinked
    fds: dict[str, int] = field(default_factory=dict)  # arena key -> fd this rank writes through (closed after)
    # files created sparse: each writer allocates the slots it fills just before filling them (in parallel threads)
    sparse: bool = False


class _Materializer:
    def __init__(self, model: nn.Module, opts: HostOptions, backend: Backend,
                 on_progress: ProgressCallback | None, loader: Loader | None = None,
                 setup: BaseException | None = None) -> None:
        self.model, self.opts, self.backend, self.on_progress = model, opts, backend, on_progress
        self.loader = loader
        self.setup = setup  # this rank's options or source failed: raised after the first gather, on every rank
        self.coord = Coordinator()
        self.rank = self.coord.rank
        self.t0 = time.perf_counter()
        self.show = opts.progress if opts.progress is not None else sys.stderr.isatty()
        self.adopted: set[int] = set()  # id() of the slots swapped into a mapping (for _rollback)
        self.devices: dict[int, torch.device] = {}
        self.own_fps: dict[int, list[int]] = {}  # id(slot) -> sampled fingerprints of its entries
        self.cleaned = False
        self.pinned_ahead: dict[int, int] = {}  # arena ptr -> bytes registered from its start while filling
        self.ahead_seconds = 0.0
        self.round: _Round | None = None
        self.done = 0  # bytes written or mapped so far (progress)
        self.total = 0
        self.node_size = 1  # ranks sharing this node's files

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

    def _undo(self, hw: HostWeights) -> None:
        """Another rank (or this one) failed: put the model back as it was, leave no file of this round."""
        self._rollback(hw)
        if self.round is not None:
            self._drop_files(self.round.locks, {k: self.round.paths[k] for k in self.round.created})
        hw.arenas, hw.files = [], []
        if self.loader is not None:
            self.loader.undo()

    # -- planning ------------------------------------------------------------------------------------------
    def _claim(self, slot: Slot, world: int) -> Claim:
        if world <= 1 or self.opts.skip_shm:
            return ("own",)
        if self.loader is not None and self.loader.owns(slot):
            return self.loader.claim(slot)
        fps = [fingerprint(e.tensor, self.opts.fingerprint_samples) for e in slot.entries]
        self.own_fps[id(slot)] = fps
        return ("fp", int.from_bytes(hashlib.blake2b(repr(fps).encode(), digest_size=8).digest(), "little"))

    def _fail_setup(self, infos: list[dict[str, Any]], undo: Callable[[], None] | None) -> None:
        """Raise on every rank when a rank's options or weight source failed: its own error there, one naming it
        (of the same class) on the others."""
        bad = [(r, i["setup"], i["setup_cls"]) for r, i in enumerate(infos) if i.get("setup")]
        if not bad:
            return
        if undo is not None:
            undo()
        if self.setup is not None:
            raise self.setup
        kinds = {kind for _, _, kind in bad}
        cls = _SETUP_CLASSES.get(kinds.pop(), MagiError) if len(kinds) == 1 else MagiError
        raise cls("host weights: " + "; ".join(f"rank {r}: {text}" for r, text, _ in bad)
                  + " (every rank raises; fix that rank's input)")

    def run(self) -> HostWeights:
        if self.setup is not None:  # nothing else to do here: the first gather, then raise on every rank
            self._fail_setup(self.coord.all_gather({"setup": _status(self.setup),
                                                    "setup_cls": type(self.setup).__name__}), None)
        opts, loader = self.opts, self.loader
        local_err: BaseException | None = None
        if loader is not None:
            try:
                loader.resolve_buffers(self.model)
            except (MagiError, OSError) as exc:
                local_err = exc
        # a problem of this rank's model (a meta tensor, a sparse one, weights another model holds): every rank
        # raises after the first gather below, so no rank waits in it for one that left
        state_err: MagiError | None = None
        entries: list[Entry] = []
        try:
            entries = collect(self.model, allow_meta=loader is not None)
            for e in entries:
                if id(e.tensor) in _owned:
                    raise HostStateError(f"{e.names[0]} already lives in host memory materialised for another "
                                         "module; materialise the outer model once")
        except MagiError as exc:
            state_err, entries = exc, []
        except BaseException:
            if loader is not None:
                loader.undo()
            raise
        slots = group(entries)
        if loader is not None and local_err is None and state_err is None:
            loader.set_window(sum(s.nbytes for s in slots), opts.staging_bytes)
            loader.match(slots, entries)
            text = loader.problems()
            if text is not None:
                local_err = WeightSourceError(text)
        self.devices = {id(s): s.entries[0].tensor.device for s in slots}
        hw = HostWeights(self.model, Layout(slots=slots, arena_bytes={}), opts, self.backend)
        assert opts.shm_dir is not None and opts.ep_size is not None
        dir_err: BaseException | None = None
        if not opts.skip_shm:  # before any file exists, on every rank; a problem on one rank raises on all
            try:
                hw.report["shm_fs"] = shm.check_dir(opts.shm_dir)
            except (ConfigError, ShmSpaceError) as exc:
                dir_err = exc
        world = self.coord.world_size
        info = {
            "setup": None, "setup_cls": None,
            "key": node_key(opts.shm_dir) if not opts.skip_shm and dir_err is None else None,
            "dir_err": _status(dir_err), "err": _status(local_err), "state_err": _status(state_err),
            "owner": shm.Owner.current(), "skip": bool(opts.skip_shm),
            "slots": [(s.signature(), self._claim(s, world), s.nbytes) for s in slots] if local_err is None else [],
            "names": [" = ".join(e.names[0] for e in s.entries) for s in slots] if world > 1 else [],
            "ep": opts.ep_size, "unsafe": opts._unsafe_share_across_ranks, "pin": opts.pin,
            "conc": opts.pin_concurrency, "mismatch": opts.on_mismatch, "verify": opts.verify_shared,
            "writes": opts.shared_writes, "loading": loader is not None,
            "bytes": sum(s.nbytes for s in slots), "avail": memstat.available_bytes(),
        }
        infos = self.coord.all_gather(info)
        undo = loader.undo if loader is not None else None
        self._fail_setup(infos, undo)
        self._fail_all([i["state_err"] for i in infos], state_err, undo, cls=HostStateError)
        self._fail_all([i["dir_err"] for i in infos], dir_err, undo, cls=ConfigError)
        self._fail_all([i["err"] for i in infos], local_err, undo, cls=WeightSourceError)
        try:
            self._check_agreement(infos)
        except ConfigError:
            if undo is not None:
                undo()
            raise
        self._phase(hw, "planned")
        self.total = hw.layout.weight_bytes
        if opts.skip_shm:
            self._plain(hw)
            return self._finish(hw, None, infos)
        topo = build_topology(self.rank, [i["key"] for i in infos], opts.ep_size, opts.shm_dir)
        node = topo.node_ranks
        self.node_size = len(node)
        claims = {r: infos[r]["slots"] for r in node}
        shares = plan_sharing(node, claims, unsafe=opts._unsafe_share_across_ranks)
        order = global_order(node, claims)
        if opts.on_mismatch == "error" and not opts._unsafe_share_across_ranks:
            problems = _sampled_differences(node, infos, shares)
            if problems:  # the sampled pre-check: before any file
                if undo is not None:
                    undo()
                raise WeightMismatchError("ranks of a node hold different weights: " + "; ".join(problems) + ". "
                                          + _FIX)
        hw.report.update(rank=self.rank, node_ranks=list(node), ep_size=opts.ep_size)
        copies = _copies(node, claims, shares, 0)
        own: set[str] = set()
        items = list(zip(slots, shares[self.rank], strict=True))
        bad = self._round(hw, infos, topo, items, order, 0)
        rnd = 0
        while bad:  # on_mismatch='copy': the ranks that differ from a copy share among themselves what they hold alike
            own |= {sig for sigs in bad.values() for sig in sigs}  # not held alike by every rank (the writer too)
            rnd += 1
            claims = {r: [c for c in claims[r] if c[0] in set(bad.get(r, ()))] for r in node}
            shares = plan_sharing(node, claims)
            copies.update(_copies(node, claims, shares, rnd))
            mine = {sig for sig, _, _ in claims[self.rank]}
            items = [(s, sh) for s, sh in zip([s for s in slots if s.signature() in mine], shares[self.rank],
                                               strict=True)]
            bad = self._round(hw, infos, topo, items, order, rnd)
        hw.layout.arena_bytes = {a.key: a.nbytes for a in hw.arenas}
        self._report_sharing(hw, topo, infos, sum(copies.values()), own)
        return self._finish(hw, topo, infos)

    def _report_sharing(self, hw: HostWeights, topo: Topology, infos: list[dict[str, Any]], distinct: int,
                        differing: set[str]) -> None:
        """Mode, ranks sharing, and the node's host bytes against the all-shared and all-private layouts."""
        node = topo.node_ranks
        all_shared = sum({sig: n for r in node for sig, _, n in infos[r]["slots"]}.values())
        mine = list(hw.arenas)
        full = tuple(node)
        partial = [s for s in hw.layout.slots if s.signature() in differing or _arena_members(hw, s) != full]
        own_bytes = sum(s.nbytes for s in partial)
        if len(full) == 1:
            mode = "per_rank" if topo.distributed else "single"
        elif not partial:
            mode = "shared"
        elif all(a.shared_by == (self.rank,) for a in mine) or len(partial) == len(hw.layout.slots):
            mode = "per_rank"
        else:
            mode = "mixed"
        hw.report.update(
            mode=mode, shared_by=list(full) if mode == "shared" else sorted({r for a in mine for r in a.shared_by}),
            writer=min(full), verify=self.opts.verify_shared if len(full) > 1 else None,
            node_bytes={"distinct": distinct, "all_shared": all_shared,
                        "all_private": sum(infos[r]["bytes"] for r in node), "ranks": len(node)},
            own_bytes=own_bytes, own_tensors=len(partial))
        if partial and len(full) > 1:
            names = [_name_of(s) for s in partial]
            level = logging.WARNING if (self.opts.ep_size or 1) == 1 else logging.INFO
            logger.log(level, "rank %d holds %d tensor(s) (%.3f GiB) that not every rank of its node holds alike (a "
                       "copy per distinct content): %s%s", self.rank, len(partial), own_bytes / 2**30, _show(names),
                       "; if the ranks should hold the same weights, check how they are initialised (or set "
                       "HostOptions(on_mismatch='error')); for expert-parallel models set MAGI_EP_SIZE to say "
                       "this is expected" if level == logging.WARNING else "")

    # -- one round of files ---------------------------------------------------------------------------------
    def _round(self, hw: HostWeights, infos: list[dict[str, Any]], topo: Topology,
               items: list[tuple[Slot, Share]], order: dict[str, int], rnd: int) -> dict[int, list[str]]:
        """Files for ``items`` (this rank's slots of this round; every rank takes part, maybe with none): created,
        filled by each slot's writer, mapped and checked by the other members, unlinked. Returns, for every rank,
        the signatures of its slots that differ from the copy it was to share (a copy of its own comes next)."""
        opts = self.opts
        assert opts.shm_dir is not None
        full = tuple(topo.node_ranks)
        share_of = {id(s): sh for s, sh in items}

        def key_of(slot: Slot) -> str:
            members = share_of[id(slot)].members
            base = dtype_key(slot.dtype)
            if members == full and rnd == 0:
                return base
            return f"{base}-r{'.'.join(map(str, members))}" + (f"-{rnd}" if rnd else "")

        items = sorted(items, key=lambda it: order[it[0].signature()])
        sizes = place([s for s, _ in items], opts.alignment, key_of)
        members = {s.arena: sh.members for s, sh in items}
        paths = {}
        for k, m in members.items():
            tag = f"node{min(m)}-{k}" if m == full and rnd == 0 else f"rank{min(m)}-{k}"
            paths[k] = os.path.join(opts.shm_dir, shm.file_name(infos[min(m)]["owner"], tag))
        created = [k for k in sizes if min(members[k]) == self.rank]
        rd = self.round = _Round(items, sizes, members, paths, created, {}, sparse=shm.can_populate())

        def undo() -> None:
            self._undo(hw)

        # 3. creators create their files
        err: BaseException | None = None
        if created:
            try:
                if opts.cleanup_stale and not self.cleaned:
                    hw.report.setdefault("stale_removed", []).extend(shm.cleanup_stale(opts.shm_dir))
                    self.cleaned = True
                shm.check_room(opts.shm_dir, sum(sizes[k] for k in created), files=len(created))
                for k in created:
                    rd.locks[k] = shm.create(paths[k], sizes[k], reserve=not rd.sparse)
            except BaseException as exc:
                err = exc
                self._drop_files(rd.locks, {k: paths[k] for k in created})
        self._fail_all(self._gather_status(err), err, undo)
        if created:  # sparse: each writer allocates what it fills; else reserved whole here
            self._phase(hw, "created" if rnd == 0 else "created_own")

        # 4. the writers map their files, fill their slots and swap each in at once
        arenas: list[Arena] = []
        fills = {s.arena for s, sh in items if sh.filler == self.rank}
        if fills:
            try:
                arenas = self._map_round(hw, rd, [k for k in sizes if k in fills])
                self._stream(hw, arenas, self.total, rd)
            except BaseException as exc:
                err = exc
                undo()
        self._fail_all(self._gather_status(err), err, undo)
        if fills:
            self._phase(hw, "copied" if rnd == 0 else "copied_own")

        # 5. the other members map the copies and check them against their own values before swapping anything in
        differing: list[str] = []
        if items:
            total, own_fps = self.total, self.own_fps
            try:
                arenas += self._map_round(hw, rd, [k for k in sizes if k not in fills])
                if opts.verify_shared == "full" or self.loader is not None:
                    differing = self._verify(hw, arenas, total)
                if opts.verify_shared == "sampled":
                    self._check_sampled(hw, arenas, own_fps)
            except BaseException as exc:
                err = exc
        late = self.loader.late_problems() if self.loader is not None else None
        results = self.coord.all_gather({"err": _status(err), "bad": differing, "late": late, "names": [
            (_name_of(s), sh.filler) for s, sh in items if s.signature() in differing]})
        self._drop_files(rd.locks, {k: paths[k] for k in created})  # every member has mapped them (or failed)
        self._fail_all([x["err"] for x in results], err, undo)
        self._fail_all([x["late"] for x in results], WeightSourceError(late) if late else None, undo,
                       cls=WeightSourceError)
        bad = {r: x["bad"] for r, x in enumerate(results) if x["bad"]}
        if bad and opts.on_mismatch == "error":
            undo()
            raise WeightMismatchError(
                "ranks of a node hold different weights (found by comparing every byte; the sampled fingerprints "
                "agreed): " + "; ".join(_differs_text(r, results[r]["names"]) for r in sorted(bad)) + ". " + _FIX)
        self._swap(hw, arenas, set(differing))
        self.round = None
        return bad

    def _map_round(self, hw: HostWeights, rd: _Round, keys: list[str]) -> list[Arena]:
        """Map the files ``keys`` of the round (shared, or copy-on-write where several ranks map them; a writer
        also gets a shared mapping to write through); the fds are closed (a creator's stays open until its file
        is unlinked); files of one rank are unlinked at once."""
        fills = {s.arena for s, sh in rd.items if sh.filler == self.rank}
        arenas: list[Arena] = []
        for k in keys:
            nbytes = rd.sizes[k]
            m = rd.members[k]
            cow = self.opts.shared_writes == "copy_on_write" and len(m) > 1
            fd = rd.locks.get(k)
            own_fd = fd is None
            if fd is None:
                fd = shm.open_existing(rd.paths[k], nbytes, writable=k in fills or not cow)
            try:
                mm = shm.map_fd(fd, nbytes, private=cow)
                writer = shm.map_fd(fd, nbytes) if cow and k in fills else None  # shared: the bytes reach the file
                inode = os.fstat(fd).st_ino
                if k in fills:  # the loader writes through the file (no page faults in this process's mapping)
                    rd.fds[k] = os.dup(fd)
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                a = Arena(key=k, nbytes=nbytes, buf=buf, path=rd.paths[k], inode=int(inode), shared_by=m,
                          writer=min(m), mapping=mm, private=cow)
                if not cow:  # a forked child maps it copy-on-write: its writes never reach this process
                    shm.track_for_fork(mm, buf.data_ptr(), fd, a)
            finally:
                if own_fd:
                    os.close(fd)
            a.write_map = writer
            arenas.append(a)
            hw._mapping_refs.append(weakref.ref(mm))
            hw.arenas.append(a)
            hw.files.append(rd.paths[k])
            if len(m) == 1 and k in rd.locks:  # mapped, and nobody else needs the name
                self._drop_files({k: rd.locks.pop(k)}, {k: rd.paths[k]})
        return arenas

    def _progress(self, desc: str, total: int) -> tqdm:
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{desc} (rank {self.rank})",
                    disable=not self.show, leave=False)

    def _stream(self, hw: HostWeights, arenas: list[Arena], total: int, rd: _Round) -> None:
        """Fill the slots this rank writes and swap each into the model at once (its original is freed there).

        Slots read from files are filled by a few threads (each with its own file descriptions and share of the
        staging window); the others in order, here. Copy-on-write arenas are written through their temporary
        shared mapping (a private mapping's pages read the file until this process writes them); those mappings
        are closed at the end.
        """
        by_key = {a.key: a for a in arenas}
        dst: dict[str, torch.Tensor] = {}
        for a in arenas:
            dst[a.key] = torch.frombuffer(a.write_map, dtype=torch.uint8) if a.write_map is not None else a.buf
        mine = [s for s, sh in rd.items if sh.filler == self.rank]
        loader = self.loader
        loaded = [s for s in mine if loader is not None and loader.owns(s)]
        threads = self._load_threads(loaded) if loader is not None and loader.parallel else 1
        buf: torch.Tensor | None = None
        into: list[torch.Tensor] = []
        opts_dir = self.opts.shm_dir
        t0 = time.perf_counter()

        def allocate(slot: Slot, into: torch.Tensor, fd: int | None) -> None:
            # a sparse file: this slot's pages now (through the file, or mapped by this thread), a clear error
            # when the filesystem is full instead of SIGBUS on a write
            if rd.sparse:
                assert opts_dir is not None
                if fd is not None:
                    shm.allocate(opts_dir, slot.nbytes, fd=fd, offset=slot.offset)
                else:
                    shm.allocate(opts_dir, slot.nbytes, ptr=into.data_ptr() + slot.offset)

        ahead = self._pin_ahead(arenas, rd)

        def adopt(slot: Slot, bar: tqdm) -> None:
            arena_buf = by_key[slot.arena].buf
            views = slot.views(arena_buf, slot.offset)
            self.adopted.add(id(slot))
            hw._adopt(list(zip(slot.entries, views, strict=True)))  # the originals are freed here
            if ahead is not None:
                ahead.written(arena_buf.data_ptr(), slot.offset)
            self.done += slot.nbytes
            bar.update(slot.nbytes)
            if self.on_progress is not None:
                self.on_progress("copy", self.done, total)

        try:
            with self._progress("magi: load" if loaded else "magi: materialise", sum(s.nbytes for s in mine)) as bar:
                if threads > 1:
                    assert loader is not None
                    local = threading.local()

                    def fill(slot: Slot) -> Slot:
                        # into the mapping: page faults of several threads run at once, while writes into one
                        # file (sendfile, pwrite) take the file's lock one writer at a time
                        if not hasattr(local, "staging"):
                            local.staging = loader.thread_staging(threads)
                        # a slot read straight into its place allocates its pages in the read (8 threads on the H200
                        # host: 5.3 GB/s on average against 5.0 GB/s populating them first, benchmarks/results/
                        # probes/2026-12-01-shm-fill-threads-thp-h200.json); a full filesystem fails the read (EFAULT)
                        in_place = rd.sparse and loader.reads_in_place(slot)
                        if not in_place:
                            allocate(slot, dst[slot.arena], None)
                        try:
                            loader.fill(slot, dst[slot.arena], slot.offset, None, local.staging)
                        except OSError as exc:
                            if in_place and exc.errno == errno.EFAULT:
                                assert opts_dir is not None
                                raise ShmSpaceError(opts_dir, slot.nbytes, shm.free_bytes(opts_dir),
                                                    cause="while filling: a read found no room") from exc
                            raise
                        return slot

                    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="magi-load") as pool:
                        # largest first: a big tensor started last would be read by one thread while the others
                        # idle (an 8B model's 1 GB output embedding comes last in its order)
                        futures = [pool.submit(fill, s) for s in sorted(loaded, key=lambda s: -s.nbytes)]
                        try:
                            for fut in concurrent.futures.as_completed(futures):
                                adopt(fut.result(), bar)
                        except BaseException:
                            for fut in futures:
                                fut.cancel()
                            raise
                    loaded_set = {id(s) for s in loaded}
                    mine = [s for s in mine if id(s) not in loaded_set]
                for slot in mine:
                    buf = dst[slot.arena]
                    allocate(slot, buf, rd.fds.get(slot.arena))
                    if loader is not None and loader.owns(slot):
                        loader.fill(slot, buf, slot.offset, rd.fds.get(slot.arena))
                    else:
                        into = slot.views(buf, slot.offset)
                        slot.copy_from_model(buf[slot.offset: slot.offset + slot.nbytes], into)
                    adopt(slot, bar)
            if ahead is not None:
                hw._ranges.extend(ahead.finish())
                for ptr in ahead.arenas:
                    self.pinned_ahead[ptr] = ahead.pinned_upto(ptr)
                self.ahead_seconds += ahead.seconds
        except BaseException:
            if ahead is not None:
                ahead.abort()
            raise
        finally:
            if loader is not None and loaded:
                loader.seconds += time.perf_counter() - t0
                loader.threads = max(loader.threads, threads)
            for fd in rd.fds.values():
                os.close(fd)
            rd.fds.clear()
            dst.clear()
            buf, into = None, []  # drop every view of the write mappings, so they can be unmapped now
            for a in arenas:
                if a.write_map is not None:
                    try:
                        a.write_map.close()
                    except BufferError:  # a view still exists somewhere: unmapped when it dies
                        pass
                    a.write_map = None

    def _pin_ahead(self, arenas: list[Arena], rd: _Round) -> pinning.PinAhead | None:
        """Pinning that overlaps filling (:class:`pinning.PinAhead`) for the arenas only this rank maps and fills
        (shared mappings); None when there are none, when pinning is off, or under a pin budget (which pins arenas
        in order, after filling)."""
        opts = self.opts
        if not opts.pin or self.backend is None or opts.pin_budget_bytes is not None:
            return None
        mine = [a for a in arenas if a.mapping is not None and not a.private and a.write_map is None
                and tuple(a.shared_by) == (self.rank,)]
        if not mine:
            return None
        bind = self.backend.device_binder()
        if bind is None:  # several devices and no way to make this one current there: pinned after filling
            return None
        return pinning.PinAhead(self.backend, [(a.buf.data_ptr(), a.nbytes, _extents([s for s, _ in rd.items], a.key))
                                               for a in mine], rank=self.rank, bind=bind)

    def _load_threads(self, slots: list[Slot]) -> int:
        """Threads filling slots from files: HostOptions.load_threads, else the cores shared by the node's ranks (at
        most 8: on the H200 host an 8B checkpoint read from the page cache at 0.64x its page-cache rate with one
        thread, 1.01x with 4 and 1.56x with 8). Several threads read into the arena's mapping."""
        if len(slots) < 2 or self.loader is None:
            return 1
        if self.opts.load_threads is not None:
            return min(self.opts.load_threads, len(slots))
        return max(1, min(8, len(slots), (os.cpu_count() or 1) // self.node_size))

    def _verify(self, hw: HostWeights, arenas: list[Arena], total: int) -> list[str]:
        """Signatures of this rank's slots whose values differ from the copy another member wrote (every byte
        compared; own values, or the source's for a function source)."""
        assert self.round is not None
        by_key = {a.key: a for a in arenas}
        bad: list[str] = []
        done = 0
        t0 = time.perf_counter()
        for slot, share in self.round.items:
            if share.filler == self.rank or not share.verify:
                continue
            arena = by_key[slot.arena]
            if self.loader is not None and self.loader.owns(slot):
                same = self.loader.matches(slot, arena.buf, slot.offset)
            elif self.opts.verify_shared == "full":
                same = same_bytes(slot.source_bytes(), arena.buf[slot.offset: slot.offset + slot.nbytes])
            else:
                continue
            if not same:
                bad.append(slot.signature())
            done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("verify", done, total)
        seconds = time.perf_counter() - t0
        hw.report["verify_seconds"] = hw.report.get("verify_seconds", 0.0) + seconds
        if done:
            logger.info("rank %d: compared %d bytes with copies other ranks wrote in %.2fs (%.2f GB/s)%s", self.rank,
                        done, seconds, done / max(seconds, 1e-9) / 1e9, f"; {len(bad)} tensor(s) differ" if bad else "")
        return bad

    def _check_sampled(self, hw: HostWeights, arenas: list[Arena], own_fps: dict[int, list[int]]) -> None:
        """verify_shared='sampled': the mapped values' fingerprints must be this rank's."""
        assert self.round is not None
        by_key = {a.key: a for a in arenas}
        for slot, share in self.round.items:
            if share.filler == self.rank or not share.verify or id(slot) not in own_fps:
                continue
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            for e, v, fp in zip(slot.entries, views, own_fps[id(slot)], strict=True):
                if fingerprint(v, self.opts.fingerprint_samples) != fp:
                    raise WeightMismatchError(f"rank {self.rank}: the shared file holds other values for "
                                              f"{e.names[0]!r} than this rank's weights; nothing was replaced")

    def _swap(self, hw: HostWeights, arenas: list[Arena], differing: set[str]) -> None:
        """Swap in the copies other members wrote (not the differing ones); forget arenas this rank does not use."""
        assert self.round is not None
        by_key = {a.key: a for a in arenas}
        used: set[str] = set()
        for slot, share in self.round.items:
            if share.filler == self.rank:
                used.add(slot.arena)
                continue
            if slot.signature() in differing:
                continue
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            self.adopted.add(id(slot))
            hw._adopt(list(zip(slot.entries, views, strict=True)))
            used.add(slot.arena)
            self.done += slot.nbytes
            if self.on_progress is not None:
                self.on_progress("map", self.done, self.total)
        unused = [a for a in arenas if a.key not in used]  # every slot of it differs: unmapped once its views die
        if unused:
            hw.arenas = [a for a in hw.arenas if a not in unused]
            hw.files = [p for p in hw.files if p not in {a.path for a in unused}]
        if any(sh.filler != self.rank for _, sh in self.round.items):
            self._phase(hw, "mapped")

    def _rollback(self, hw: HostWeights) -> None:
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
                    with _live_lock:
                        if _owned.get(id(e.tensor)) is hw:
                            del _owned[id(e.tensor)]
                    _unreplace(e)
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
        """MAGI_SKIP_SHM: host tensors stay as they are; device tensors are copied to plain host memory; tensors
        from a weight source are read into plain host memory."""
        hw.report.update(mode="plain", rank=self.rank)
        done, total = 0, hw.layout.weight_bytes
        try:
            for slot in hw.layout.slots:
                t = slot.entries[0].tensor
                if self.loader is not None and self.loader.owns(slot):
                    buf = torch.zeros(slot.nbytes, dtype=torch.uint8)
                    t0 = time.perf_counter()
                    self.loader.fill(slot, buf, 0)
                    self.loader.seconds += time.perf_counter() - t0
                    views = slot.views(buf, 0)
                elif t.device.type == "cpu":
                    views = [e.tensor.data for e in slot.entries]
                else:
                    buf = torch.empty(slot.nbytes, dtype=torch.uint8)
                    views = slot.views(buf, 0)
                    slot.copy_from_model(buf, views)
                self.adopted.add(id(slot))
                hw._adopt(list(zip(slot.entries, views, strict=True)))
                done += slot.nbytes
                if self.on_progress is not None:
                    self.on_progress("copy", done, total)
            late = self.loader.late_problems() if self.loader is not None else None
            if late is not None:
                raise WeightSourceError(late)
        except BaseException:
            self._undo(hw)
            raise
        self._phase(hw, "copied")

    # -- decisions --------------------------------------------------------------------------------------------
    def _check_agreement(self, infos: list[dict[str, Any]]) -> None:
        for field_name, what in (("skip", "MAGI_SKIP_SHM"), ("ep", "the EP size (MAGI_EP_SIZE)"),
                                 ("unsafe", "_unsafe_share_across_ranks"), ("pin", "HostOptions.pin"),
                                 ("conc", "MAGI_PIN_CONCURRENCY"), ("mismatch", "HostOptions.on_mismatch"),
                                 ("verify", "HostOptions.verify_shared"), ("writes", "HostOptions.shared_writes"),
                                 ("loading", "loading from a weight source (magi_core.load on every rank, or on "
                                             "none)")):
            values = {repr(i[field_name]) for i in infos}
            if len(values) > 1:
                raise ConfigError(f"ranks disagree on {what}: {[i[field_name] for i in infos]}; set it the same on "
                                  "every rank")

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
        if self.loader is not None:
            rep = hw.report["load"] = self.loader.report()
            logger.info("rank %d: read %d tensor(s), %.3f GB from %s in %.2fs (%.2f GB/s); staging window %d bytes",
                        self.rank, rep["tensors"], rep["bytes_read"] / 1e9, rep["source"], rep["read_seconds"],
                        rep["GBps"], rep["staging_bytes"])
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
            global _told_read_only
            # a warning once per process: the write it warns of kills the process, with nothing else to explain it
            log = logger.info if _told_read_only else logger.warning
            _told_read_only = True
            log("rank %d: host weights shared with ranks %s are read-only: an in-place write to them "
                "(param.add_, load_state_dict, a buffer update) kills this process with SIGSEGV. To edit weights "
                "after offload, offload with HostOptions(shared_writes='copy_on_write') (an edit then stays this "
                "rank's own), or edit them before offloading", self.rank, list(shared[0].shared_by))

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
        ranges: list[tuple[int, int]] = []  # what is left after pinning ahead (whole arenas without it)
        extents: dict[int, list[tuple[int, int]]] = {}
        for a in hw.arenas:
            ptr = a.buf.data_ptr()
            upto = self.pinned_ahead.get(ptr, 0)
            if upto < a.nbytes:
                ranges.append((ptr + upto, a.nbytes - upto))
                extents[ptr + upto] = _extents(hw.layout.slots, a.key, upto)
        ahead_bytes, ahead_s = hw.pinned_bytes, self.ahead_seconds
        result = pinning.PinResult()
        budget_total = ahead_bytes + (sum(n for _, n in ranges) if opts.pin_budget_bytes is None else
                                      min(opts.pin_budget_bytes, sum(n for _, n in ranges)))
        for w in range(waves):
            if w == my_wave:
                done = ahead_bytes
                with self._progress("magi: pin", budget_total) as bar:
                    bar.update(done)
                    if done and self.on_progress is not None:
                        self.on_progress("pin", done, budget_total)

                    def step(n: int) -> None:
                        nonlocal done
                        done += n
                        bar.update(n)
                        if self.on_progress is not None:
                            self.on_progress("pin", done, budget_total)
                    result = pinning.pin_ranges(self.backend, ranges, opts.pin_budget_bytes, step, self.rank,
                                                extents)
                hw._ranges.extend(result.ranges)
                logger.info("rank %d: pinned %d of %d bytes in %.2fs (wave %d of %d, %d rank(s) at once; %d bytes "
                            "while filling, in %.2fs)", self.rank, result.pinned_bytes, sum(n for _, n in ranges),
                            result.seconds, w + 1, waves, c, ahead_bytes, ahead_s)
            self.coord.barrier()
        hw.report["pin"] = {"seconds": result.seconds + ahead_s, "pinned_bytes": hw.pinned_bytes,
                            "ahead_bytes": ahead_bytes, "ahead_seconds": ahead_s, "wave": my_wave,
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


_FIX = ("If the ranks hold different weights on purpose (expert parallelism), use HostOptions(on_mismatch='copy') "
        "(the default): differing tensors get a copy per rank, identical ones stay shared (set MAGI_EP_SIZE to say "
        "the differences are expected)")


def _extents(slots: list[Slot], arena: str, start: int = 0) -> list[tuple[int, int]]:
    """The sorted (start, end) byte offsets, counted from ``start``, of the slots of ``arena`` from there on."""
    return sorted((s.offset - start, s.offset + s.nbytes - start) for s in slots
                  if s.arena == arena and s.offset >= start)


#: Whether this process was told (at WARNING) that shared host weights are read-only.
_told_read_only = False


def _status(err: BaseException | None) -> str | None:
    return f"{type(err).__name__}: {err}" if err is not None else None


def _show(names: list[str], n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _name_of(slot: Slot) -> str:
    return " = ".join(e.names[0] for e in slot.entries)  # tensors of one storage: named together


def _differs_text(rank: int, pairs: list[tuple[str, int]]) -> str:
    by_writer: dict[int, list[str]] = {}
    for name, writer in pairs:
        by_writer.setdefault(writer, []).append(name)
    return "; ".join(f"rank {rank} differs from rank {w} in {len(names)} tensor(s): {_show(names)}"
                     for w, names in sorted(by_writer.items()))


def _copies(node: tuple[int, ...], claims: dict[int, list[Any]], shares: dict[int, list[Share]],
            rnd: int) -> dict[tuple[int, str, tuple[int, ...]], int]:
    """(round, signature, members) -> bytes of every copy a round makes on the node."""
    return {(rnd, sig, sh.members): n for r in node for (sig, _, n), sh in zip(claims[r], shares[r], strict=True)}


def _arena_members(hw: HostWeights, slot: Slot) -> tuple[int, ...]:
    return next((a.shared_by for a in hw.arenas if a.key == slot.arena), ())


def _sampled_differences(node: tuple[int, ...], infos: list[dict[str, Any]],
                         shares: dict[int, list[Share]]) -> list[str]:
    """on_mismatch='error': the ranks of ``node`` whose structure or sampled values differ from the lowest rank's."""
    leader = node[0]
    lead = {sig for sig, _, _ in infos[leader]["slots"]}
    out = []
    for r in node[1:]:
        if {sig for sig, _, _ in infos[r]["slots"]} != lead:
            out.append(f"rank {r} has a different model structure (layout) than rank {leader}")
            continue
        differ = [i for i, sh in enumerate(shares[r]) if leader not in sh.members]
        if differ:
            out.append(f"rank {r} differs from rank {leader} in {len(differ)} tensor(s), first "
                       f"{infos[r]['names'][differ[0]]!r}")
    return out


__all__ = ["Arena", "HostWeights", "ProgressCallback", "materialize"]
