"""One round of shared files across the ranks of a node (steps 3-5 of :mod:`magi_core.host.materialize`).

Every rank takes part in a round, maybe with no slot: the creators create the round's files, each slot's writer
fills its slots and swaps them into the model at once, the other members map the copies and compare them with
their own values before swapping anything in, and the files are unlinked.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
import time
import weakref

import torch
from tqdm import tqdm

from magi_core.host import fork, pinning, shm
from magi_core.host.arena import Slot, dtype_key, fingerprint, place, same_bytes
from magi_core.host.errors import ShmSpaceError, WeightMismatchError, WeightSourceError
from magi_core.host.materialize.call import FIX, CallState, RankInfo, RoundResult, drop_files, name_of, show, status
from magi_core.host.materialize.weights import Arena, HostWeights
from magi_core.host.topology import Share, Topology

logger = logging.getLogger("magi_core.host.materialize")


class FileRound:
    """One round of files for ``items`` (this rank's slots of the round, with their shares; maybe none).

    Arena keys name a dtype, followed by the members and the round when not all the node's ranks share it in
    the first round. Each set of members gets one file per dtype, created by its lowest rank.
    """

    def __init__(self, call: CallState, hw: HostWeights, infos: list[RankInfo], topo: Topology,
                 items: list[tuple[Slot, Share]], order: dict[str, int], rnd: int) -> None:
        opts = call.opts
        assert opts.shm_dir is not None
        self.call, self.hw, self.rnd = call, hw, rnd
        full = tuple(topo.node_ranks)
        share_of = {id(s): sh for s, sh in items}

        def key_of(slot: Slot) -> str:
            members = share_of[id(slot)].members
            base = dtype_key(slot.dtype)
            if members == full and rnd == 0:
                return base
            return f"{base}-r{'.'.join(map(str, members))}" + (f"-{rnd}" if rnd else "")

        self.items = sorted(items, key=lambda it: order[it[0].signature()])
        self.sizes = place([s for s, _ in self.items], opts.alignment, key_of)  # arena key -> bytes
        self.members = {s.arena: sh.members for s, sh in self.items}  # arena key -> ranks mapping it
        self.paths: dict[str, str] = {}  # arena key -> file
        for k, m in self.members.items():
            tag = f"node{min(m)}-{k}" if m == full and rnd == 0 else f"rank{min(m)}-{k}"
            owner = infos[min(m)].owner
            assert owner is not None  # every rank that got this far said who it is
            self.paths[k] = os.path.join(opts.shm_dir, shm.file_name(owner, tag))
        self.created = [k for k in self.sizes if min(self.members[k]) == call.rank]  # keys whose file it creates
        self.locks: dict[str, int] = {}  # created key -> fd holding the file's lock until it is unlinked
        self.fds: dict[str, int] = {}  # arena key -> fd this rank writes through (closed after)
        # files created sparse: each writer allocates the slots it fills just before filling them (in parallel threads)
        self.sparse = shm.can_populate()

    def run(self) -> dict[int, list[str]]:
        """Files created, filled by each slot's writer, mapped and checked by the other members, unlinked.
        Returns, for every rank, the signatures of its slots that differ from the copy it was to share (a copy
        of its own comes next)."""
        call, hw, rnd = self.call, self.hw, self.rnd
        opts = call.opts
        assert opts.shm_dir is not None
        sizes, paths, created, items = self.sizes, self.paths, self.created, self.items
        call.round = self

        def undo() -> None:
            call.undo(hw)

        # 3. creators create their files
        err: BaseException | None = None
        if created:
            try:
                if opts.cleanup_stale and not call.cleaned:
                    hw.report.setdefault("stale_removed", []).extend(shm.cleanup_stale(opts.shm_dir))
                    call.cleaned = True
                shm.check_room(opts.shm_dir, sum(sizes[k] for k in created), files=len(created))
                for k in created:
                    self.locks[k] = shm.create(paths[k], sizes[k], reserve=not self.sparse)
            except BaseException as exc:
                err = exc
                drop_files(self.locks, {k: paths[k] for k in created})
        call.fail_all(call.gather_status(err), err, undo)
        if created:  # sparse: each writer allocates what it fills; else reserved whole here
            call.phase(hw, "created" if rnd == 0 else "created_own")

        # 4. the writers map their files, fill their slots and swap each in at once
        arenas: list[Arena] = []
        fills = {s.arena for s, sh in items if sh.filler == call.rank}
        if fills:
            try:
                arenas = self._map([k for k in sizes if k in fills])
                self._stream(arenas, call.total)
            except BaseException as exc:
                err = exc
                undo()
        call.fail_all(call.gather_status(err), err, undo)
        if fills:
            call.phase(hw, "copied" if rnd == 0 else "copied_own")

        # 5. the other members map the copies and check them against their own values before swapping anything in
        differing: list[str] = []
        if items:
            total, own_fps = call.total, call.own_fps
            try:
                arenas += self._map([k for k in sizes if k not in fills])
                if opts.verify_shared == "full" or call.loader.from_source:
                    differing = self._verify(arenas, total)
                if opts.verify_shared == "sampled":
                    self._check_sampled(arenas, own_fps)
            except BaseException as exc:
                err = exc
        late = call.loader.late_problems()
        results = call.coord.all_gather(RoundResult(status(err), differing, late, [
            (name_of(s), sh.filler) for s, sh in items if s.signature() in differing]))
        drop_files(self.locks, {k: paths[k] for k in created})  # every member has mapped them (or failed)
        call.fail_all([x.err for x in results], err, undo)
        call.fail_all([x.late for x in results], WeightSourceError(late) if late else None, undo,
                      cls=WeightSourceError)
        bad = {r: x.bad for r, x in enumerate(results) if x.bad}
        if bad and opts.on_mismatch == "error":
            undo()
            raise WeightMismatchError(
                "ranks of a node hold different weights (found by comparing every byte; the sampled fingerprints "
                "agreed): " + "; ".join(_differs_text(r, results[r].names) for r in sorted(bad)) + ". " + FIX)
        self._swap(arenas, set(differing))
        call.round = None
        return bad

    def _map(self, keys: list[str]) -> list[Arena]:
        """Map the files ``keys`` of the round (shared, or copy-on-write where several ranks map them; a writer
        also gets a shared mapping to write through); the fds are closed (a creator's stays open until its file
        is unlinked); files of one rank are unlinked at once."""
        call, hw = self.call, self.hw
        fills = {s.arena for s, sh in self.items if sh.filler == call.rank}
        arenas: list[Arena] = []
        for k in keys:
            nbytes = self.sizes[k]
            m = self.members[k]
            cow = call.opts.shared_writes == "copy_on_write" and len(m) > 1
            fd = self.locks.get(k)
            own_fd = fd is None
            if fd is None:
                fd = shm.open_existing(self.paths[k], nbytes, writable=k in fills or not cow)
            try:
                mm = shm.map_fd(fd, nbytes, private=cow)
                writer = shm.map_fd(fd, nbytes) if cow and k in fills else None  # shared: the bytes reach the file
                inode = os.fstat(fd).st_ino
                if k in fills:  # the loader writes through the file (no page faults in this process's mapping)
                    self.fds[k] = os.dup(fd)
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                a = Arena(key=k, nbytes=nbytes, buf=buf, path=self.paths[k], inode=int(inode), shared_by=m,
                          writer=min(m), mapping=mm, private=cow)
                if not cow:  # a forked child maps it copy-on-write: its writes never reach this process
                    fork.track_for_fork(mm, buf.data_ptr(), fd, a)
            finally:
                if own_fd:
                    os.close(fd)
            a.write_map = writer
            arenas.append(a)
            hw._mapping_refs.append(weakref.ref(mm))
            hw.arenas.append(a)
            hw.files.append(self.paths[k])
            if len(m) == 1 and k in self.locks:  # mapped, and nobody else needs the name
                drop_files({k: self.locks.pop(k)}, {k: self.paths[k]})
        return arenas

    def _stream(self, arenas: list[Arena], total: int) -> None:
        """Fill the slots this rank writes and swap each into the model at once (its original is freed there).

        Slots read from files are filled by a few threads (each with its own file descriptions and share of the
        staging window); the others in order, here. Copy-on-write arenas are written through their temporary
        shared mapping (a private mapping's pages read the file until this process writes them); those mappings
        are closed at the end.
        """
        call, hw = self.call, self.hw
        by_key = {a.key: a for a in arenas}
        dst: dict[str, torch.Tensor] = {}
        for a in arenas:
            dst[a.key] = torch.frombuffer(a.write_map, dtype=torch.uint8) if a.write_map is not None else a.buf
        mine = [s for s, sh in self.items if sh.filler == call.rank]
        loader = call.loader
        loaded = [s for s in mine if loader.owns(s)]
        threads = self._load_threads(loaded) if loader.parallel else 1
        buf: torch.Tensor | None = None
        into: list[torch.Tensor] = []
        opts_dir = call.opts.shm_dir
        sparse = self.sparse
        t0 = time.perf_counter()

        def allocate(slot: Slot, into: torch.Tensor, fd: int | None) -> None:
            # a sparse file: this slot's pages now (through the file, or mapped by this thread), a clear error
            # when the filesystem is full instead of SIGBUS on a write
            if sparse:
                assert opts_dir is not None
                if fd is not None:
                    shm.allocate(opts_dir, slot.nbytes, fd=fd, offset=slot.offset)
                else:
                    shm.allocate(opts_dir, slot.nbytes, ptr=into.data_ptr() + slot.offset)

        ahead = self._pin_ahead(arenas)

        def adopt(slot: Slot, bar: tqdm) -> None:
            arena_buf = by_key[slot.arena].buf
            views = slot.views(arena_buf, slot.offset)
            call.adopted.add(id(slot))
            hw._adopt(list(zip(slot.entries, views, strict=True)))  # the originals are freed here
            if ahead is not None:
                ahead.written(arena_buf.data_ptr(), slot.offset)
            call.done += slot.nbytes
            bar.update(slot.nbytes)
            if call.on_progress is not None:
                call.on_progress("copy", call.done, total)

        try:
            with call.progress("magi: load" if loaded else "magi: materialise", sum(s.nbytes for s in mine)) as bar:
                if threads > 1:
                    local = threading.local()

                    def fill(slot: Slot) -> Slot:
                        # into the mapping: page faults of several threads run at once, while writes into one
                        # file (sendfile, pwrite) take the file's lock one writer at a time
                        if not hasattr(local, "staging"):
                            local.staging = loader.thread_staging(threads)
                        # a slot read straight into its place allocates its pages in the read (faster than
                        # populating them first); a full filesystem fails the read (EFAULT)
                        in_place = sparse and loader.reads_in_place(slot)
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
                    allocate(slot, buf, self.fds.get(slot.arena))
                    if loader.owns(slot):
                        loader.fill(slot, buf, slot.offset, self.fds.get(slot.arena))
                    else:
                        into = slot.views(buf, slot.offset)
                        slot.copy_from_model(buf[slot.offset: slot.offset + slot.nbytes], into)
                    adopt(slot, bar)
            if ahead is not None:
                hw._ranges.extend(ahead.finish())
                for ptr in ahead.arenas:
                    call.pinned_ahead[ptr] = ahead.pinned_upto(ptr)
                call.ahead_seconds += ahead.seconds
        except BaseException:
            if ahead is not None:
                ahead.abort()
            raise
        finally:
            if loaded:
                loader.seconds += time.perf_counter() - t0
                loader.threads = max(loader.threads, threads)
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
            dst.clear()
            buf, into = None, []  # drop every view of the write mappings, so they can be unmapped now
            for a in arenas:
                if a.write_map is not None:
                    try:
                        a.write_map.close()
                    except BufferError:  # a view still exists somewhere: unmapped when it dies
                        pass
                    a.write_map = None

    def _pin_ahead(self, arenas: list[Arena]) -> pinning.PinAhead | None:
        """Pinning that overlaps filling (:class:`pinning.PinAhead`) for the arenas only this rank maps and fills
        (shared mappings); None when there are none, when pinning is off, or under a pin budget (which pins arenas
        in order, after filling)."""
        call = self.call
        opts = call.opts
        if not opts.pin or call.backend is None or opts.pin_budget_bytes is not None:
            return None
        mine = [a for a in arenas if a.mapping is not None and not a.private and a.write_map is None
                and tuple(a.shared_by) == (call.rank,)]
        if not mine:
            return None
        bind = call.backend.device_binder()
        if bind is None:  # several devices and no way to make this one current there: pinned after filling
            return None
        return pinning.PinAhead(call.backend, [(a.buf.data_ptr(), a.nbytes, extents([s for s, _ in self.items], a.key))
                                               for a in mine], rank=call.rank, bind=bind)

    def _load_threads(self, slots: list[Slot]) -> int:
        """Threads filling slots from files: HostOptions.load_threads, else the cores shared by the node's ranks (at
        most 8: more threads read a checkpoint from the page cache faster, up to about 8). Several threads read
        into the arena's mapping."""
        call = self.call
        if len(slots) < 2:
            return 1
        if call.opts.load_threads is not None:
            return min(call.opts.load_threads, len(slots))
        return max(1, min(8, len(slots), (os.cpu_count() or 1) // call.node_size))

    def _verify(self, arenas: list[Arena], total: int) -> list[str]:
        """Signatures of this rank's slots whose values differ from the copy another member wrote (every byte
        compared; own values, or the source's for a function source)."""
        call, hw = self.call, self.hw
        by_key = {a.key: a for a in arenas}
        bad: list[str] = []
        done = 0
        t0 = time.perf_counter()
        for slot, share in self.items:
            if share.filler == call.rank or not share.verify:
                continue
            arena = by_key[slot.arena]
            if call.loader.owns(slot):
                same = call.loader.matches(slot, arena.buf, slot.offset)
            elif call.opts.verify_shared == "full":
                same = same_bytes(slot.source_bytes(), arena.buf[slot.offset: slot.offset + slot.nbytes])
            else:
                continue
            if not same:
                bad.append(slot.signature())
            done += slot.nbytes
            if call.on_progress is not None:
                call.on_progress("verify", done, total)
        seconds = time.perf_counter() - t0
        hw.report["verify_seconds"] = hw.report.get("verify_seconds", 0.0) + seconds
        if done:
            logger.info("rank %d: compared %d bytes with copies other ranks wrote in %.2fs (%.2f GB/s)%s", call.rank,
                        done, seconds, done / max(seconds, 1e-9) / 1e9, f"; {len(bad)} tensor(s) differ" if bad else "")
        return bad

    def _check_sampled(self, arenas: list[Arena], own_fps: dict[int, list[int]]) -> None:
        """verify_shared='sampled': the mapped values' fingerprints must be this rank's."""
        call = self.call
        by_key = {a.key: a for a in arenas}
        for slot, share in self.items:
            if share.filler == call.rank or not share.verify or id(slot) not in own_fps:
                continue
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            for e, v, fp in zip(slot.entries, views, own_fps[id(slot)], strict=True):
                if fingerprint(v, call.opts.fingerprint_samples) != fp:
                    raise WeightMismatchError(f"rank {call.rank}: the shared file holds other values for "
                                              f"{e.names[0]!r} than this rank's weights; nothing was replaced")

    def _swap(self, arenas: list[Arena], differing: set[str]) -> None:
        """Swap in the copies other members wrote (not the differing ones); forget arenas this rank does not use."""
        call, hw = self.call, self.hw
        by_key = {a.key: a for a in arenas}
        used: set[str] = set()
        for slot, share in self.items:
            if share.filler == call.rank:
                used.add(slot.arena)
                continue
            if slot.signature() in differing:
                continue
            views = slot.views(by_key[slot.arena].buf, slot.offset)
            call.adopted.add(id(slot))
            hw._adopt(list(zip(slot.entries, views, strict=True)))
            used.add(slot.arena)
            call.done += slot.nbytes
            if call.on_progress is not None:
                call.on_progress("map", call.done, call.total)
        unused = [a for a in arenas if a.key not in used]  # every slot of it differs: unmapped once its views die
        if unused:
            hw.arenas = [a for a in hw.arenas if a not in unused]
            hw.files = [p for p in hw.files if p not in {a.path for a in unused}]
        if any(sh.filler != call.rank for _, sh in self.items):
            call.phase(hw, "mapped")


def extents(slots: list[Slot], arena: str, start: int = 0) -> list[tuple[int, int]]:
    """The sorted (start, end) byte offsets, counted from ``start``, of the slots of ``arena`` from there on."""
    return sorted((s.offset - start, s.offset + s.nbytes - start) for s in slots
                  if s.arena == arena and s.offset >= start)


def _differs_text(rank: int, pairs: list[tuple[str, int]]) -> str:
    by_writer: dict[int, list[str]] = {}
    for name, writer in pairs:
        by_writer.setdefault(writer, []).append(name)
    return "; ".join(f"rank {rank} differs from rank {w} in {len(names)} tensor(s): {show(names)}"
                     for w, names in sorted(by_writer.items()))
