""":func:`materialize`: the steps of :mod:`magi_core.host.materialize` in order on every rank, and what the ranks
agree on between them (options, the sharing plan, pinning waves).
"""

from __future__ import annotations

import faulthandler
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from magi_core._once import first_time
from magi_core.errors import ConfigError, MagiError
from magi_core.host import memstat, moves, pinning, shm
from magi_core.host.arena import Entry, Layout, Slot, collect, fingerprint, group
from magi_core.host.config import DEFAULT_SHM_DIR, HostOptions
from magi_core.host.errors import HostStateError, ShmSpaceError, WeightMismatchError, WeightSourceError
from magi_core.host.loading import Loader, Rename, SourceSpec, open_source
from magi_core.host.loading.loader import NoSource
from magi_core.host.materialize.call import (
    FIX,
    CallState,
    ProgressCallback,
    RankInfo,
    check_agreement,
    name_of,
    show,
    status,
)
from magi_core.host.materialize.file_round import FileRound, extents
from magi_core.host.materialize.weights import (
    RELEASED_MODEL,
    HostWeights,
    is_owned,
    register,
    was_released,
    weights_of,
)
from magi_core.host.topology import Claim, Share, Topology, build_topology, global_order, node_key, plan_sharing
from magi_core.plugin.facade import Backend

logger = logging.getLogger("magi_core.host.materialize")

#: Keys of the once-per-process notes of this module.
_told: set[str] = set()


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
    existing = weights_of(model)
    if setup is None and was_released(model):
        setup = HostStateError(RELEASED_MODEL.format(name=type(model).__name__))
    if setup is None and existing is not None and not existing.released:
        if existing.options == opts and source is None:
            logger.info("model already materialised; returning its HostWeights")
            return existing
        setup = HostStateError("the model is already materialised with other options (or weights); call "
                               "release(restore=True) on its HostWeights first")
    loader: Loader | NoSource = NoSource()
    if source is not None and setup is None:
        try:
            loader = Loader(open_source(source), strict=strict, rename=rename)
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the first gather
            setup = exc
    try:
        return _Materializer(model, opts, backend, on_progress, loader, setup).run()
    finally:
        loader.close()


#: Stands in for the options of a rank whose own failed to resolve (it only takes part in the first gather).
_SETUP_FAILED = HostOptions(ep_size=1, skip_shm=True, pin=False, pin_concurrency=1, shm_dir=DEFAULT_SHM_DIR,
                            progress=False)
#: Classes of setup errors another rank's failure is raised as on this rank (by name).
_SETUP_CLASSES: dict[str, type[MagiError]] = {c.__name__: c for c in (ConfigError, WeightSourceError,
                                                                       HostStateError)}


class _Materializer(CallState):
    """One call of :func:`materialize` on this rank (see the package docstring for the steps)."""

    def __init__(self, model: nn.Module, opts: HostOptions, backend: Backend,
                 on_progress: ProgressCallback | None, loader: Loader | NoSource,
                 setup: BaseException | None = None) -> None:
        super().__init__(model, opts, backend, on_progress, loader)
        self.setup = setup  # this rank's options or source failed: raised after the first gather, on every rank

    # -- planning ------------------------------------------------------------------------------------------
    def _claim(self, slot: Slot, world: int) -> Claim:
        if world <= 1 or self.opts.skip_shm:
            return ("own",)
        if self.loader.owns(slot):
            return self.loader.claim(slot)
        fps = [fingerprint(e.tensor, self.opts.fingerprint_samples) for e in slot.entries]
        self.own_fps[id(slot)] = fps
        return ("fp", int.from_bytes(hashlib.blake2b(repr(fps).encode(), digest_size=8).digest(), "little"))

    def _fail_setup(self, infos: list[RankInfo], undo: Callable[[], None] | None) -> None:
        """Raise on every rank when a rank's options or weight source failed: its own error there, one naming it
        (of the same class) on the others."""
        bad = [(r, i.setup, i.setup_cls) for r, i in enumerate(infos) if i.setup]
        if not bad:
            return
        if undo is not None:
            undo()
        if self.setup is not None:
            raise self.setup
        kinds = {kind for _, _, kind in bad}
        cls = _SETUP_CLASSES.get(kinds.pop() or "", MagiError) if len(kinds) == 1 else MagiError
        raise cls("host weights: " + "; ".join(f"rank {r}: {text}" for r, text, _ in bad)
                  + " (every rank raises; fix that rank's input)")

    def run(self) -> HostWeights:
        """Every step on this rank, in order; the materialised weights."""
        if self.setup is not None:  # nothing else to do here: the first gather, then raise on every rank
            self._fail_setup(self.coord.all_gather(RankInfo(setup=status(self.setup),
                                                            setup_cls=type(self.setup).__name__)), None)
        opts, loader = self.opts, self.loader
        local_err: BaseException | None = None
        try:
            loader.resolve_buffers(self.model)
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the first gather, the model undone
            local_err = exc
        # a problem of this rank's model (a meta tensor, a sparse one, weights another model holds): every rank
        # raises after the first gather below, so no rank waits in it for one that left
        state_err: MagiError | None = None
        entries: list[Entry] = []
        try:
            entries = collect(self.model, allow_meta=loader.from_source)
            for e in entries:
                if is_owned(e.tensor):
                    raise HostStateError(f"{e.names[0]} already lives in host memory materialised for another "
                                         "module; materialise the outer model once")
        except MagiError as exc:
            state_err, entries = exc, []
        except BaseException:
            loader.undo()
            raise
        slots = group(entries)
        if local_err is None and state_err is None:
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
        info = RankInfo(
            key=node_key(opts.shm_dir) if not opts.skip_shm and dir_err is None else None,
            dir_err=status(dir_err), err=status(local_err), state_err=status(state_err),
            owner=shm.Owner.current(), skip=bool(opts.skip_shm),
            slots=[(s.signature(), self._claim(s, world), s.nbytes) for s in slots] if local_err is None else [],
            names=[" = ".join(e.names[0] for e in s.entries) for s in slots] if world > 1 else [],
            ep=opts.ep_size, unsafe=opts._unsafe_share_across_ranks, pin=opts.pin,
            conc=opts.pin_concurrency, mismatch=opts.on_mismatch, verify=opts.verify_shared,
            writes=opts.shared_writes, loading=loader.from_source,
            bytes=sum(s.nbytes for s in slots), avail=memstat.available_bytes(),
        )
        infos: list[RankInfo] = self.coord.all_gather(info)
        undo = loader.undo
        self._fail_setup(infos, undo)
        self.fail_all([i.state_err for i in infos], state_err, undo, cls=HostStateError)
        self.fail_all([i.dir_err for i in infos], dir_err, undo, cls=ConfigError)
        self.fail_all([i.err for i in infos], local_err, undo, cls=WeightSourceError)
        try:
            check_agreement(infos)
        except ConfigError:
            undo()
            raise
        self.phase(hw, "planned")
        self.total = hw.layout.weight_bytes
        if opts.skip_shm:
            self._plain(hw)
            return self._finish(hw, None, infos)
        topo = build_topology(self.rank, [i.key for i in infos], opts.ep_size, opts.shm_dir)
        node = topo.node_ranks
        self.node_size = len(node)
        claims = {r: infos[r].slots for r in node}
        shares = plan_sharing(node, claims, unsafe=opts._unsafe_share_across_ranks)
        order = global_order(node, claims)
        if opts.on_mismatch == "error" and not opts._unsafe_share_across_ranks:
            problems = _sampled_differences(node, infos, shares)
            if problems:  # the sampled pre-check: before any file
                undo()
                raise WeightMismatchError("ranks of a node hold different weights: " + "; ".join(problems) + ". "
                                          + FIX)
        hw.report.update(rank=self.rank, node_ranks=list(node), ep_size=opts.ep_size)
        copies = _copies(node, claims, shares, 0)
        own: set[str] = set()
        items = list(zip(slots, shares[self.rank], strict=True))
        bad = FileRound(self, hw, infos, topo, items, order, 0).run()
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
            bad = FileRound(self, hw, infos, topo, items, order, rnd).run()
        hw.layout.arena_bytes = {a.key: a.nbytes for a in hw.arenas}
        self._report_sharing(hw, topo, infos, sum(copies.values()), own)
        return self._finish(hw, topo, infos)

    def _report_sharing(self, hw: HostWeights, topo: Topology, infos: list[RankInfo], distinct: int,
                        differing: set[str]) -> None:
        """Mode, ranks sharing, and the node's host bytes against the all-shared and all-private layouts."""
        node = topo.node_ranks
        all_shared = sum({sig: n for r in node for sig, _, n in infos[r].slots}.values())
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
                        "all_private": sum(infos[r].bytes for r in node), "ranks": len(node)},
            own_bytes=own_bytes, own_tensors=len(partial))
        if partial and len(full) > 1:
            names = [name_of(s) for s in partial]
            level = logging.WARNING if (self.opts.ep_size or 1) == 1 else logging.INFO
            logger.log(level, "rank %d holds %d tensor(s) (%.3f GiB) that not every rank of its node holds alike (a "
                       "copy per distinct content): %s%s", self.rank, len(partial), own_bytes / 2**30, show(names),
                       "; if the ranks should hold the same weights, check how they are initialised (or set "
                       "HostOptions(on_mismatch='error')); for expert-parallel models set MAGI_EP_SIZE to say "
                       "this is expected" if level == logging.WARNING else "")

    def _plain(self, hw: HostWeights) -> None:
        """MAGI_SKIP_SHM: host tensors stay as they are; device tensors are copied to plain host memory; tensors
        from a weight source are read into plain host memory."""
        hw.report.update(mode="plain", rank=self.rank)
        done, total = 0, hw.layout.weight_bytes
        try:
            for slot in hw.layout.slots:
                t = slot.entries[0].tensor
                if self.loader.owns(slot):
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
            late = self.loader.late_problems()
            if late is not None:
                raise WeightSourceError(late)
        except BaseException:
            self.undo(hw)
            raise
        self.phase(hw, "copied")

    # -- afterwards -------------------------------------------------------------------------------------------
    def _finish(self, hw: HostWeights, topo: Topology | None, infos: list[RankInfo]) -> HostWeights:
        register(hw, self.model)
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
        if self.loader.from_source:
            rep = hw.report["load"] = self.loader.report()
            logger.info("rank %d: read %d tensor(s), %.3f GB from %s in %.2fs (%.2f GB/s); staging window %d bytes",
                        self.rank, rep["tensors"], rep["bytes_read"] / 1e9, rep["source"], rep["read_seconds"],
                        rep["GBps"], rep["staging_bytes"])
        hw.report["files"] = [a.info() for a in hw.arenas]
        self.phase(hw, "done")
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
            # a warning once per process: the write it warns of kills the process, with nothing else to explain it
            log = logger.warning if first_time(_told, "read_only") else logger.info
            log("rank %d: host weights shared with ranks %s are read-only: an in-place write to them "
                "(param.add_, load_state_dict, a buffer update) kills this process with SIGSEGV. To edit weights "
                "after offload, offload with HostOptions(shared_writes='copy_on_write') (an edit then stays this "
                "rank's own), or edit them before offloading", self.rank, list(shared[0].shared_by))

    def _pin(self, hw: HostWeights, topo: Topology, infos: list[RankInfo]) -> None:
        """Pin what pinning while filling left, in waves of ranks per node (each wave waits for the one before)."""
        opts = self.opts
        nodes: dict[Any, list[int]] = {}
        for r, i in enumerate(infos):
            nodes.setdefault(i.key, []).append(r)

        def conc(ranks: list[int]) -> int:
            if opts.pin_concurrency is not None:
                return min(opts.pin_concurrency, len(ranks))
            return min(len(ranks), pinning.default_concurrency(min(infos[r].avail for r in ranks),
                                                               max(infos[r].bytes for r in ranks)))

        waves = max(pinning.wave_plan(0, len(rs), conc(rs))[1] for rs in nodes.values())
        c = conc(list(topo.node_ranks))
        my_wave, _ = pinning.wave_plan(topo.local_rank, topo.local_world_size, c)
        ranges: list[tuple[int, int]] = []  # what is left after pinning ahead (whole arenas without it)
        starts: dict[int, list[tuple[int, int]]] = {}
        for a in hw.arenas:
            ptr = a.buf.data_ptr()
            upto = self.pinned_ahead.get(ptr, 0)
            if upto < a.nbytes:
                ranges.append((ptr + upto, a.nbytes - upto))
                starts[ptr + upto] = extents(hw.layout.slots, a.key, upto)
        ahead_bytes, ahead_s = hw.pinned_bytes, self.ahead_seconds
        result = pinning.PinResult()
        budget_total = ahead_bytes + (sum(n for _, n in ranges) if opts.pin_budget_bytes is None else
                                      min(opts.pin_budget_bytes, sum(n for _, n in ranges)))
        for w in range(waves):
            if w == my_wave:
                done = ahead_bytes
                with self.progress("magi: pin", budget_total) as bar:
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
                                                starts)
                hw._ranges.extend(result.ranges)
                logger.info("rank %d: pinned %d of %d bytes in %.2fs (wave %d of %d, %d rank(s) at once; %d bytes "
                            "while filling, in %.2fs)", self.rank, result.pinned_bytes, sum(n for _, n in ranges),
                            result.seconds, w + 1, waves, c, ahead_bytes, ahead_s)
            self.coord.barrier()
        hw.report["pin"] = {"seconds": result.seconds + ahead_s, "pinned_bytes": hw.pinned_bytes,
                            "ahead_bytes": ahead_bytes, "ahead_seconds": ahead_s, "wave": my_wave,
                            "waves": waves, "concurrency": c, "budget": opts.pin_budget_bytes, "error": result.error,
                            "memlock": pinning.memlock_limit() if result.error else None}
        self.phase(hw, "pinned")


def _copies(node: tuple[int, ...], claims: dict[int, list[Any]], shares: dict[int, list[Share]],
            rnd: int) -> dict[tuple[int, str, tuple[int, ...]], int]:
    """(round, signature, members) -> bytes of every copy a round makes on the node."""
    return {(rnd, sig, sh.members): n for r in node for (sig, _, n), sh in zip(claims[r], shares[r], strict=True)}


def _arena_members(hw: HostWeights, slot: Slot) -> tuple[int, ...]:
    return next((a.shared_by for a in hw.arenas if a.key == slot.arena), ())


def _sampled_differences(node: tuple[int, ...], infos: list[RankInfo], shares: dict[int, list[Share]]) -> list[str]:
    """on_mismatch='error': the ranks of ``node`` whose structure or sampled values differ from the lowest rank's."""
    leader = node[0]
    lead = {sig for sig, _, _ in infos[leader].slots}
    out = []
    for r in node[1:]:
        if {sig for sig, _, _ in infos[r].slots} != lead:
            out.append(f"rank {r} has a different model structure (layout) than rank {leader}")
            continue
        differ = [i for i, sh in enumerate(shares[r]) if leader not in sh.members]
        if differ:
            out.append(f"rank {r} differs from rank {leader} in {len(differ)} tensor(s), first "
                       f"{infos[r].names[differ[0]]!r}")
    return out
