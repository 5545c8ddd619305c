"""Probe: how fast can several threads fill a sparse /dev/shm file from a checkpoint in the page cache?

Compares, on the same bytes: reading into reused buffers (the page-cache ceiling), and filling a shared
mapping of a sparse shm file with 4 KiB pages and with transparent huge pages (``MADV_HUGEPAGE``; only where
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows ``advise``), with ``MADV_POPULATE_WRITE`` first or
faulting inside the read; optionally the time to register (pin) the filled mapping with the accelerator.
Writes one JSON (``--out``). A probe for the load path's design, not a benchmark of magi_core itself.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import mmap
import os
import platform
import time
from datetime import datetime, timezone
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
CHUNK = 256 << 20


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def _meminfo(key: str) -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _madvise(addr: int, n: int, advice: int) -> None:
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), advice) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"madvise({advice}): {os.strerror(e)}")


def _source(path: str, nbytes: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    return [(lo, min(CHUNK, nbytes - lo)) for lo in range(0, nbytes, CHUNK)]


def ceiling(src: str, nbytes: int, threads: int) -> float:
    """Page cache -> reused per-thread buffers (no destination faults)."""
    fd = os.open(src, os.O_RDONLY)
    bufs = [bytearray(64 << 20) for _ in range(threads)]
    free = list(range(threads))

    def one(c: tuple[int, int]) -> None:
        i = free.pop()
        mv = memoryview(bufs[i])
        lo, n = c
        done = 0
        while done < n:
            k = min(len(mv), n - done)
            done += os.preadv(fd, [mv[:k]], lo + done)
        free.append(i)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, _chunks(nbytes)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def fill(src: str, shm_path: str, nbytes: int, threads: int, *, huge: bool, populate: bool,
         pin: bool) -> dict[str, Any]:
    """Sparse shm file, shared mapping, threads fill 256 MiB chunks (populate, then read into the mapping)."""
    fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    huge_before = _meminfo("ShmemHugePages")
    rec: dict[str, Any] = {"threads": threads, "huge": huge, "populate": populate}
    try:
        if huge:
            _madvise(base, nbytes, MADV_HUGEPAGE)
        sfd = os.open(src, os.O_RDONLY)
        whole = memoryview(mm)
        pop_s = [0.0]

        def one(c: tuple[int, int]) -> None:
            lo, n = c
            if populate:
                t = time.perf_counter()
                _madvise(base + lo, n, MADV_POPULATE_WRITE)
                pop_s[0] += time.perf_counter() - t
            done = 0
            while done < n:
                done += os.preadv(sfd, [whole[lo + done: lo + n]], lo + done)

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, _chunks(nbytes)))
        rec["seconds"] = time.perf_counter() - t0
        rec["populate_thread_seconds"] = pop_s[0]
        rec["GBps"] = nbytes / rec["seconds"] / 1e9
        rec["shmem_huge_bytes"] = _meminfo("ShmemHugePages") - huge_before
        whole.release()
        os.close(sfd)
        if pin:
            import torch
            cudart = torch.cuda.cudart()
            t = time.perf_counter()
            assert cudart.cudaHostRegister(base, nbytes, 0) == 0
            rec["register_s"] = time.perf_counter() - t
            t = time.perf_counter()
            assert cudart.cudaHostUnregister(base) == 0
            rec["unregister_s"] = time.perf_counter() - t
    finally:
        mm.close()
        os.close(fd)
        os.unlink(shm_path)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--src", default="/tmp/shm-fill-probe.src")
    ap.add_argument("--shm", default="/dev/shm/shm-fill-probe")
    ap.add_argument("--pin", action="store_true", help="also time cudaHostRegister of the filled mapping")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    nbytes = a.gib << 30
    thp = _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    out: dict[str, Any] = {
        "what": "filling a sparse /dev/shm mapping from the page cache: 4 KiB pages against transparent huge pages",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "kernel": platform.release(), "cores": os.cpu_count(), "bytes": nbytes,
        "thp_shmem_enabled": thp,
        "thp_2m_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled"),
        "shm_mount": [ln for ln in _read("/proc/mounts").splitlines() if " /dev/shm " in ln],
        "rows": []}
    _source(a.src, nbytes)
    try:
        for r in range(a.repeats):
            for t in (int(x) for x in a.threads.split(",")):
                out["rows"].append({"case": "page-cache ceiling", "threads": t, "repeat": r,
                                    "GBps": nbytes / ceiling(a.src, nbytes, t) / 1e9})
                for huge in (False, True):
                    for populate in (True, False):
                        rec = fill(a.src, a.shm, nbytes, t, huge=huge, populate=populate, pin=a.pin and t > 1)
                        rec.update(case="fill", repeat=r)
                        out["rows"].append(rec)
                        print(json.dumps(rec), flush=True)
    finally:
        os.unlink(a.src)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))


if __name__ == "__main__":
    main()
