"""Shared-memory files: job-unique names, exclusive 0600 create with space reserved up front, mapping,
unlinking, and removal of files left by crashed runs (owner process gone) — only those.

Name: ``magi-u<uid>-p<pid>.<start>-<job>-<random>-<tag>.bin`` where ``pid`` and ``start`` (its start
time in clock ticks since boot, from ``/proc/<pid>/stat``) identify the process that created the file,
so a recycled pid never makes a dead run's file look alive.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass

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


def cleanup_stale(shm_dir: str) -> list[str]:
    """Remove this user's magi files whose owner process is gone; return the removed paths."""
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
            if os.lstat(path).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if pid_alive(int(fields["pid"]), int(fields["start"])):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another rank removed it first
        removed.append(path)
        logger.warning("removed %s left by a crashed run (owner pid %s is gone)", path, fields["pid"])
    return removed


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged writer can still allocate in the filesystem of ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return int(st.f_bavail) * int(st.f_frsize)


def check_room(shm_dir: str, needed: int) -> None:
    """Raise :class:`ShmSpaceError` when ``shm_dir`` has fewer than ``needed`` free bytes."""
    avail = free_bytes(shm_dir)
    if needed > avail:
        raise ShmSpaceError(shm_dir, needed, avail)


def create(path: str, nbytes: int) -> int:
    """Create ``path`` exclusively (mode 0600) and reserve ``nbytes``; return the open fd.

    The space is allocated before anything maps the file, so a full filesystem fails here with
    :class:`ShmSpaceError` (and the partial file is removed) instead of SIGBUS on first touch.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        _unlink_quiet(path)
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise ShmSpaceError(os.path.dirname(path), nbytes, free_bytes(os.path.dirname(path)),
                                cause=os.strerror(exc.errno or 0)) from exc
        raise
    except BaseException:
        os.close(fd)
        _unlink_quiet(path)
        raise
    return fd


def open_existing(path: str, nbytes: int) -> int:
    """Open a file another rank created; check its owner, mode and size; return the fd."""
    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != nbytes:
        os.close(fd)
        raise PermissionError(
            f"{path}: expected a 0600 file of uid {os.getuid()} and {nbytes} bytes, found uid {st.st_uid}, "
            f"mode {oct(st.st_mode & 0o777)}, {st.st_size} bytes; another process tampered with it"
        )
    return fd


def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    """Map ``nbytes`` of ``fd`` shared and writable; the fd may be closed afterwards."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink(path: str) -> None:
    """Remove ``path`` (already gone is fine)."""
    _unlink_quiet(path)
