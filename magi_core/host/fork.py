"""Forked children get copy-on-write views of the writable shared arenas, so their writes never reach the parent.

A writable ``MAP_SHARED`` arena (one process, or files of one rank) stays shared with a child made by
``os.fork()`` (DataLoader workers, ``multiprocessing`` pools with the fork start method): an in-place write in the
child (``param.add_``) would change the parent's weights. Right after a fork, in the child
(``os.register_at_fork(after_in_child=...)``), every such arena is mapped again ``MAP_PRIVATE`` from its file at the
same address (``MAP_FIXED``: every tensor view keeps its pointer). The child keeps working: it reads the same
pages, and a page it writes becomes its own copy. The parent is never touched.

Why this and not the alternatives: ``MADV_DONTFORK`` leaves the pages absent in the child (a read there is a
SIGSEGV); ``MADV_WIPEONFORK`` applies to private anonymous memory only (and would zero the weights); making the
parent's own mapping private would copy every page it pins (CUDA registers for writing) and could not be undone
under a registration. Cost: one ``mmap`` per arena in the child, and one file descriptor per arena (a dup of the
one the mapping object already keeps) for as long as the mapping lives.

One difference from ordinary memory remains: until the child writes a page, it reads the file's page, so an
in-place edit the parent makes after the fork is seen by the child (as a thread would see it), not a snapshot.

Arenas mapped read-only (``shared_writes="read_only"`` across ranks) are left alone: a write there kills the child
with SIGSEGV, as it would the parent. Copy-on-write arenas and plain memory are private already.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


class _Arena(Protocol):
    private: bool
    read_only: bool


@dataclass
class _Tracked:
    """A writable shared mapping to make private in forked children."""

    ptr: int
    nbytes: int
    fd: int  # the arena's file (unlinked once every rank mapped it), kept open for the child's new mapping
    arena: weakref.ref[Any]  # its Arena: read_only may be set later; private is set in the child


_fork_lock = threading.Lock()
_tracked: dict[int, _Tracked] = {}  # ptr -> mapping


def track_for_fork(mapping: mmap.mmap, ptr: int, fd: int, arena: _Arena) -> None:
    """Make forked children map ``mapping`` (a writable ``MAP_SHARED`` mapping of ``fd`` at address ``ptr``)
    copy-on-write; forgotten, and the kept descriptor closed, when the mapping object is freed."""
    keep = os.dup(fd)  # not inherited by exec'd programs; a forked child keeps it
    entry = _Tracked(ptr, len(mapping), keep, weakref.ref(arena))
    with _fork_lock:
        _tracked[ptr] = entry
    weakref.finalize(mapping, _forget, ptr, keep)


def _forget(ptr: int, fd: int) -> None:
    with _fork_lock:
        entry = _tracked.get(ptr)
        if entry is not None and entry.fd == fd:
            del _tracked[ptr]
    try:
        os.close(fd)
    except OSError:
        pass


def fork_tracked() -> int:
    """How many mappings forked children would map again (for tests and reports)."""
    with _fork_lock:
        return len(_tracked)


def _fork_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_LIBC: ctypes.CDLL | None = None


def _after_fork_in_child() -> None:
    """In a forked child: every writable shared arena becomes a private mapping of its file at the same address.
    Where that fails, the arena is made read-only (a write is then a SIGSEGV, never a change to the parent); where
    that fails too, the child exits (status 70) rather than share writable weights with its parent."""
    global _LIBC
    entries = list(_tracked.values())  # no lock: the thread that held it does not exist in the child
    if not entries:
        return
    if _LIBC is None:
        _LIBC = _fork_libc()
    libc = _LIBC
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    for e in entries:
        arena = e.arena()
        if arena is not None and (arena.read_only or arena.private):
            continue
        got = libc.mmap(e.ptr, e.nbytes, rw, mmap.MAP_PRIVATE | _MAP_FIXED, e.fd, 0)
        if got == e.ptr:
            if arena is not None:
                arena.private = True  # no identity across processes any more (magi_core.compile.exchange)
            continue
        err = ctypes.get_errno()
        if libc.mprotect(e.ptr, e.nbytes, mmap.PROT_READ) == 0:
            if arena is not None:
                arena.read_only = True
            logger.error("forked child %d: could not map the host weights at %#x copy-on-write (%s); they are "
                         "read-only in this process (a write kills it, and never reaches the parent)", os.getpid(),
                         e.ptr, os.strerror(err))
            continue
        logger.critical("forked child %d: the host weights at %#x stay shared with the parent and could be neither "
                        "remapped nor protected (%s); exiting so that no write reaches the parent", os.getpid(),
                        e.ptr, os.strerror(ctypes.get_errno()))
        os._exit(70)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
