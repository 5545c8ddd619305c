"""Shared-memory files: job-unique names, a checked directory, exclusive 0600 create (space reserved up front,
or allocated range by range by the writers' threads where the kernel reports a full filesystem as an error
rather than SIGBUS), an owner's lock, mapping (shared or copy-on-write), unlinking, and removal of files left by crashed
runs — only those. Forked children's copy-on-write views of the writable mappings: :mod:`magi_core.host.fork`.

Name: ``magi-u<uid>-p<pid>.<start>-<job>-<random>-<tag>.bin`` where ``pid`` and ``start`` (its start
time in clock ticks since boot, from ``/proc/<pid>/stat``) name the process that created the file (for
people reading the directory, and as a second guard: a visibly running owner keeps its files).

Liveness across PID namespaces: the creator holds ``flock(LOCK_EX)`` on the file from the moment it
exists until it is unlinked (every rank has mapped it). Locks belong to the inode, so a process in another
container that shares the tmpfs sees them, whatever pids it can see; the kernel drops them when the owner
dies (``kill -9`` included). :func:`cleanup_stale` removes a file only when it can take that lock itself
(``LOCK_EX | LOCK_NB``), the file is a regular file (never a symlink: ``lstat`` and ``O_NOFOLLOW``) owned
by this uid, its name parses, and its owner pid is not visibly running.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

from magi_core.errors import ConfigError
from magi_core.host.errors import ShmSpaceError

logger = logging.getLogger(__name__)

PREFIX = "magi-"
_NAME = re.compile(r"^magi-u(?P<uid>\d+)-p(?P<pid>\d+)\.(?P<start>\d+)-(?P<job>[A-Za-z0-9]+)-(?P<rand>[0-9a-f]+)-"
                   r"(?P<tag>[A-Za-z0-9_.-]+)\.bin$")
_JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[19])  # field 22 overall


def pid_alive(pid: int, start: int) -> bool:
    """True when process ``pid`` exists and started at ``start`` (so it is the file's owner)."""
    if os.path.isdir("/proc/self"):
        return process_start_time(pid) == start
    try:  # no procfs: pid only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_token() -> str:
    """Launcher job id (alphanumerics only) or ``nojob``."""
    for name in _JOB_VARS:
        raw = re.sub(r"[^A-Za-z0-9]", "", os.environ.get(name, ""))
        if raw:
            return raw[:32]
    return "nojob"


@dataclass(frozen=True)
class Owner:
    """The process a file belongs to (pid and start time) plus the run's random token."""

    pid: int
    start: int
    job: str
    token: str

    @staticmethod
    def current() -> Owner:
        """This process, with a fresh random token."""
        pid = os.getpid()
        return Owner(pid=pid, start=process_start_time(pid) or 0, job=job_token(), token=secrets.token_hex(6))


def file_name(owner: Owner, tag: str) -> str:
    """The file name for ``owner`` and ``tag`` (letters, digits, ``_``, ``.`` and ``-``)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
        raise ValueError(f"bad shm tag {tag!r}")
    return f"{PREFIX}u{os.getuid()}-p{owner.pid}.{owner.start}-{owner.job}-{owner.token}-{tag}.bin"


def parse_name(name: str) -> dict[str, str] | None:
    """The fields of a magi shm file name, or None for any other name."""
    m = _NAME.match(name)
    return m.groupdict() if m else None


def _lock_free(fd: int) -> bool:
    """Take ``LOCK_EX`` on ``fd`` without waiting; False when another open file holds a lock on it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:  # a filesystem without flock: no proof the owner is gone
        logger.debug("flock failed (%s); keeping the file", exc)
        return False
    return True


def cleanup_stale(shm_dir: str) -> list[str]:
    """Remove this user's magi files that no live process owns; return the removed paths.

    A file is removed only when all hold: its name parses with our uid, it is a regular file (not a symlink)
    owned by our uid, its owner pid is not visibly running, and nobody holds its lock (we take it, without
    waiting, before unlinking; a live owner in another PID namespace still holds it).
    """
    removed: list[str] = []
    uid = os.getuid()
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        fields = parse_name(name)
        if fields is None or int(fields["uid"]) != uid:
            continue
        path = os.path.join(shm_dir, name)
        try:
            lst = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(lst.st_mode) or lst.st_uid != uid:
            continue  # a symlink, fifo, device or another user's file named like ours: never ours to remove
        if pid_alive(int(fields["pid"]), int(fields["start"])):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue  # gone, swapped for a symlink, or not readable
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino) or not _lock_free(fd):
                continue  # replaced since the lstat, or its owner is alive (maybe in another PID namespace)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                continue  # another rank removed it first
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)  # releases our lock
        removed.append(path)
        logger.warning("removed %s left by a run that is gone (owner pid %s not running, lock free)", path,
                       fields["pid"])
    return removed


#: Filesystem types whose files live in memory (``/proc/mounts`` names).
MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


def fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (from ``/proc/mounts``), or None when unknown."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):  # the last of equal mount points wins (it is on top)
                    best, kind = mnt, parts[2]
    except OSError:
        return None
    return kind


def check_dir(shm_dir: str) -> str | None:
    """Check ``shm_dir`` before any file is created there; return its filesystem type (None: unknown).

    Missing, not a directory, or not writable (permissions or a read-only mount): :class:`ConfigError` naming
    the fix. Not a memory filesystem (tmpfs, ramfs, hugetlbfs): a logged warning (the weights would be paged
    to disk). No free inodes: :class:`ShmSpaceError`, as for no free bytes.
    """
    fix = ("set MAGI_SHM_DIR (or HostOptions.shm_dir) to an existing, writable tmpfs directory such as /dev/shm, "
           "or MAGI_SKIP_SHM=1 to keep plain host tensors")
    if not os.path.lexists(shm_dir):
        raise ConfigError(f"shared-memory directory {shm_dir} does not exist; create it (mkdir -p {shm_dir}) or {fix}")
    if not os.path.isdir(shm_dir):
        raise ConfigError(f"shared-memory directory {shm_dir} is not a directory; {fix}")
    st = os.statvfs(shm_dir)
    if st.f_flag & os.ST_RDONLY:
        raise ConfigError(f"shared-memory directory {shm_dir} is on a read-only mount; remount it read-write "
                          f"(mount -o remount,rw) or {fix}")
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"shared-memory directory {shm_dir} is not writable by uid {os.getuid()}; fix its "
                          f"permissions or {fix}")
    kind = fs_type(shm_dir)
    if kind is not None and kind not in MEMORY_FS:
        logger.warning("shared-memory directory %s is on a %s filesystem, not in memory (tmpfs/ramfs/hugetlbfs): "
                       "the weights will be written to and paged from that filesystem. Set MAGI_SHM_DIR to a "
                       "tmpfs such as /dev/shm", shm_dir, kind)
    check_inodes(shm_dir, 1)
    return kind


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged writer can still allocate in the filesystem of ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return int(st.f_bavail) * int(st.f_frsize)


def free_inodes(shm_dir: str) -> int | None:
    """Files that can still be created in the filesystem of ``shm_dir``; None when it has no inode limit
    (tmpfs mounted with ``nr_inodes=0`` reports 0 files in total)."""
    st = os.statvfs(shm_dir)
    return None if st.f_files == 0 else int(st.f_favail)


def _inode_error(shm_dir: str, needed: int, cause: str) -> ShmSpaceError:
    return ShmSpaceError(shm_dir, needed, free_bytes(shm_dir), cause=cause, inodes=True)


def check_inodes(shm_dir: str, files: int) -> None:
    """Raise :class:`ShmSpaceError` when fewer than ``files`` new files fit in ``shm_dir`` (no free inodes)."""
    left = free_inodes(shm_dir)
    if left is not None and left < files:
        raise _inode_error(shm_dir, 0, f"{left} free inode(s), {files} file(s) to create")


def check_room(shm_dir: str, needed: int, files: int = 1) -> None:
    """Raise :class:`ShmSpaceError` when ``shm_dir`` has fewer than ``needed`` free bytes or ``files`` free inodes."""
    avail = free_bytes(shm_dir)
    if needed > avail:
        raise ShmSpaceError(shm_dir, needed, avail)
    left = free_inodes(shm_dir)
    if left is not None and left < files:
        raise _inode_error(shm_dir, needed, f"{left} free inode(s), {files} file(s) to create")


_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def create(path: str, nbytes: int, *, reserve: bool = True) -> int:
    """Create ``path`` exclusively (mode 0600), lock it (``LOCK_EX``) and size it to ``nbytes``; return the open fd.

    The lock is held for as long as this fd (or a mapping made from it) stays open: close it only after the
    file is unlinked. ``reserve``: the space is allocated here, before anything maps the file, so a full
    filesystem fails here with :class:`ShmSpaceError` (and the partial file is removed) instead of SIGBUS on
    first touch. ``reserve=False`` leaves the file sparse: every writer must then allocate the range it writes
    first (:func:`allocate`), which its own threads can do in parallel while they fill it. Running out of
    inodes fails here either way.
    """
    shm_dir = os.path.dirname(path)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise _inode_error(shm_dir, nbytes, f"cannot create a file: {os.strerror(exc.errno or 0)}") from exc
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # a cleanup may have taken the lock between our create and our flock, and removed the file
            now = _stat_quiet(path)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(path)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)
    else:
        raise FileExistsError(errno.EEXIST, f"{path} was removed three times while being created")
    try:
        os.fchmod(fd, 0o600)
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        _unlink_quiet(path)
        if exc.errno in _SPACE_ERRNOS:
            raise ShmSpaceError(shm_dir, nbytes, free_bytes(shm_dir), cause=os.strerror(exc.errno or 0)) from exc
        raise
    except BaseException:
        os.close(fd)
        _unlink_quiet(path)
        raise
    return fd


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE: list[bool] = []  # [whether this kernel has it], probed once


def can_populate() -> bool:
    """True when this kernel can allocate and map a shared file's pages for writing with an error instead of
    SIGBUS (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+); files are then created sparse and filled range by
    range (:func:`allocate`), else their space is reserved whole when created (one thread, before any filling)."""
    if not _POPULATE:
        probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_ANONYMOUS", 0x20))
        first = ctypes.c_char.from_buffer(probe)
        try:
            _POPULATE.append(_madvise(ctypes.addressof(first), mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0)
        finally:
            del first
            probe.close()
    return _POPULATE[0]


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    """``madvise``; 0 or the errno (the GIL is released for the call: threads populate in parallel)."""
    libc = _load_libc()
    return 0 if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) == 0 else ctypes.get_errno()


def allocate(shm_dir: str, nbytes: int, *, fd: int | None = None, offset: int = 0, ptr: int | None = None) -> None:
    """Allocate ``nbytes`` of a sparse file before writing them: through the file ``fd`` at ``offset``
    (``fallocate``, nothing mapped), or through this process's shared writable mapping at address ``ptr``
    (``MADV_POPULATE_WRITE``: the pages are also mapped for the writes that follow; threads may do this for
    their own ranges at once). A full filesystem raises :class:`ShmSpaceError` here instead of SIGBUS later."""
    if nbytes <= 0:
        return
    if ptr is not None:
        page = mmap.PAGESIZE
        lo, hi = ptr // page * page, -(-(ptr + nbytes) // page) * page
        err = _madvise(lo, hi - lo, _MADV_POPULATE_WRITE)
        if err in (errno.EFAULT, errno.ENOMEM, *_SPACE_ERRNOS):  # EFAULT: a write would have raised SIGBUS
            raise ShmSpaceError(shm_dir, nbytes, free_bytes(shm_dir), cause=f"while filling: {os.strerror(err)}")
        if err:
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes: {os.strerror(err)}")
        return
    assert fd is not None, "allocate() takes an fd or a mapping address"
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS:
            raise ShmSpaceError(shm_dir, nbytes, free_bytes(shm_dir), cause=f"while filling: {exc.strerror}") from exc
        raise


def open_existing(path: str, nbytes: int, *, writable: bool = False) -> int:
    """Open a file another rank created; check its type, owner, mode and size; return the fd.

    ``writable=False`` opens it read-only (enough for a copy-on-write mapping). A FIFO put in its place is refused
    at once (opened without waiting for a writer).
    """
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
                 | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077
            or st.st_size != nbytes):
        os.close(fd)
        raise PermissionError(
            f"{path}: expected a regular 0600 file of uid {os.getuid()} and {nbytes} bytes, found uid {st.st_uid}, "
            f"mode {oct(st.st_mode & 0o777)}, {st.st_size} bytes; another process tampered with it"
        )
    return fd


def map_fd(fd: int, nbytes: int, *, private: bool = False) -> mmap.mmap:
    """Map ``nbytes`` of ``fd``; the fd may be closed afterwards.

    ``private=False``: shared and writable (writes reach the file: the writer's copy-in, per-rank files).
    ``private=True``: copy-on-write (``MAP_PRIVATE``): pages are the file's until this process writes one, which
    then becomes this process's own copy; a write never reaches the file or any other process mapping it.
    """
    if private:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def protect(ptr: int, nbytes: int, *, writable: bool) -> None:
    """``mprotect`` the page-aligned range to read-only (``writable=False``) or read/write; OSError on failure.

    A registration made while the range is writable stays valid after it is made read-only (with CUDA: device
    copies from it still work, and unregistering succeeds).
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if _load_libc().mprotect(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_int(prot)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect({ptr:#x}, {nbytes}): {os.strerror(err)}")


def _stat_quiet(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink(path: str) -> None:
    """Remove ``path`` (already gone is fine)."""
    _unlink_quiet(path)
