"""Host memory figures read from procfs (Linux); missing files give empty results."""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterable

_ROLLUP_KEYS = ("Anonymous", "Pss_Shmem", "Rss")
_MEMINFO_KEYS = ("MemTotal", "MemAvailable", "Shmem")


def _read_kb(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def process_memory(pid: int | None = None) -> dict[str, int]:
    """``Anonymous``, ``Pss_Shmem`` and ``Rss`` bytes of a process (this one by default)."""
    return _read_kb(f"/proc/{pid or 'self'}/smaps_rollup", _ROLLUP_KEYS)


def peak_rss_bytes() -> int:
    """The most resident memory this process has had (``VmHWM``: anonymous, file-backed and shared pages)."""
    return _read_kb("/proc/self/status", ("VmHWM",)).get("VmHWM", 0)


def _exact_counters() -> bool:
    """True on Linux 6.2+, whose per-process RSS counters are per-CPU sums read within a small batch; before 6.2
    each thread caches up to 64 page events, so ``RssAnon`` lags and under-reports a fast-growing process."""
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 2)


_EXACT_COUNTERS = _exact_counters()


def anonymous_bytes() -> int:
    """Anonymous memory of this process (private heap pages, and pages of private file mappings it wrote; not
    shared memory). On Linux 6.2+ ``RssAnon``, a counter the kernel keeps, so sampling it every millisecond costs
    nothing; else ``smaps_rollup``'s ``Anonymous``, which walks every page table under the mm lock (sampled that
    often during a large load, it slows the load itself severalfold)."""
    if _EXACT_COUNTERS:
        kb = _read_kb("/proc/self/status", ("RssAnon",))
        if "RssAnon" in kb:
            return kb["RssAnon"]
    return process_memory().get("Anonymous", 0)


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
_MAPPING_KEYS = ("Size", "Rss", "Pss")
_DELETED = " (deleted)"


def mapping_memory(ranges: Iterable[tuple[int, int]], paths: Iterable[str] = (),
                   pid: int | None = None, keys: tuple[str, ...] = _MAPPING_KEYS) -> dict[str, int]:
    """``Size``, ``Rss`` and ``Pss`` bytes (or the smaps fields ``keys``, e.g. ``Anonymous``: pages of a
    private file mapping that became this process's own) of the mappings overlapping any (ptr, nbytes) in
    ``ranges`` or backed by a file in ``paths`` (unlinked files too), plus their count as ``mappings``.

    Unlike ``Pss_Shmem`` of the whole process this counts only those mappings, so a driver's own shared
    mappings (pinned staging buffers, IPC) do not inflate it. A page mapped by N processes adds 1/N.
    """
    spans = [(p, p + n) for p, n in ranges if n > 0]
    wanted = {os.path.realpath(p) for p in paths}
    out = dict.fromkeys((*keys, "mappings"), 0)
    hit = False
    try:
        with open(f"/proc/{pid or 'self'}/smaps") as f:
            for line in f:
                m = _VMA.match(line)
                if m is not None:
                    lo, hi, path = int(m.group(1), 16), int(m.group(2), 16), m.group(3).removesuffix(_DELETED)
                    hit = any(lo < b and a < hi for a, b in spans) or (bool(path) and path in wanted)
                    out["mappings"] += hit
                    continue
                if hit:
                    name, _, rest = line.partition(":")
                    if name in keys:
                        out[name] += int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def system_memory(keys: tuple[str, ...] = _MEMINFO_KEYS) -> dict[str, int]:
    """Bytes of the host's /proc/meminfo fields ``keys`` (default ``MemTotal``, ``MemAvailable``, ``Shmem``)."""
    return _read_kb("/proc/meminfo", keys)


def available_bytes() -> int:
    """Host memory available to new allocations (MemAvailable; falls back to physical pages)."""
    avail = system_memory().get("MemAvailable")
    if avail is not None:
        return avail
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


_STATUS_KEYS = ("RssAnon", "RssShmem", "RssFile")


def snapshot() -> dict[str, int]:
    """Process and host memory together, for log lines and reports: the kernel's counters (``RssAnon``,
    ``RssShmem``, ``RssFile`` of /proc/self/status; reading ``smaps_rollup`` instead walks every page table, which
    takes a noticeable fraction of a second with a large arena mapped) and /proc/meminfo."""
    return {**_read_kb("/proc/self/status", _STATUS_KEYS), **{f"host_{k}": v for k, v in system_memory().items()}}


def fmt(snap: dict[str, int]) -> str:
    """A short human-readable form of :func:`snapshot`."""
    return ", ".join(f"{k}={v / 2**30:.2f}GiB" for k, v in snap.items())
