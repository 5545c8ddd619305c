"""What a CUDA host registration does to the mappings the host layer uses (run by hand on a GPU machine).

    python3 tests/host_workers/cow_pin_probe.py [--mib 256]

Prints one JSON object. For each mapping kind, the file is a tmpfs file filled with 1s through a shared
writable mapping (as the writer rank does); the probe maps it the given way, touches every page, registers
it with ``cudaHostRegister`` (default flags, then ``cudaHostRegisterReadOnly``), and reports:

``rc``                the runtime's return code (0: registered)
``anon_before/after`` ``Anonymous`` bytes of the mapping before and after registering: a jump to the whole
                      size means the driver pinned for write and broke copy-on-write (a private copy per rank)
``pss_after``         the mapping's Pss while a second process maps the same file (shared: half the size)
``device_sees_host_write`` after registering, the host writes 7 into the first page; a device copy from the
                      mapping then reads 7 (coherent) or 1 (the pinned page is not the one the process sees)
``other_process_sees_write`` whether that host write reached the file (the other ranks' view)

Kinds: ``shared_rw`` (MAP_SHARED, read/write: per-rank files), ``shared_rw_then_ro`` (MAP_SHARED read/write,
registered, then ``mprotect(PROT_READ)``: shared files under ``shared_writes="read_only"``), ``private_cow``
(MAP_PRIVATE: shared files under ``shared_writes="copy_on_write"``), ``shared_ro`` (MAP_SHARED, PROT_READ from
the start). No host write is tried on a read-only mapping (it would SIGSEGV). The case expected to fail to
register runs last (a failed registration latches an error the next CUDA call reports).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import re
import subprocess
import sys
import textwrap
import uuid

import torch

FLAGS = {"default": 0, "read_only": 8}  # cudaHostRegisterDefault, cudaHostRegisterReadOnly
_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def vma_stats(ptr: int) -> dict[str, int]:
    """Rss, Pss, Anonymous and Private_Dirty bytes of the mapping holding ``ptr``."""
    out: dict[str, int] = {}
    hit = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _VMA.match(line)
            if m:
                hit = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
                continue
            if hit:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss", "Anonymous", "Private_Dirty"):
                    out[name] = int(rest.split()[0]) * 1024
    return out


_HOLDER = textwrap.dedent("""
    import mmap, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    n = int(sys.argv[2])
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    s = sum(mm[i] for i in range(0, n, mmap.PAGESIZE))
    print("ready", flush=True)
    sys.stdin.readline()
    print(mm[0], flush=True)
""")


def probe(kind: str, flag: str, nbytes: int, shm_dir: str) -> dict[str, object]:
    path = os.path.join(shm_dir, f"magi-probe-{uuid.uuid4().hex[:8]}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    w = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    w[:] = b"\1" * nbytes
    w.close()
    if kind in ("shared_rw", "shared_rw_then_ro"):
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    elif kind == "private_cow":
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
    else:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, path, str(nbytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    rec: dict[str, object] = {"kind": kind, "flag": flag}
    try:
        assert holder.stdin is not None and holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: torch warns
            host = torch.frombuffer(mm, dtype=torch.uint8)
        int(host[:: mmap.PAGESIZE].sum())  # touch every page
        ptr = host.data_ptr()
        rec["anon_before"] = vma_stats(ptr).get("Anonymous")
        rt = torch.cuda.cudart()
        rc = int(rt.cudaHostRegister(ptr, nbytes, FLAGS[flag]))
        rec["rc"] = rc
        if kind == "shared_rw_then_ro":
            libc = ctypes.CDLL(None, use_errno=True)
            rec["mprotect_rc"] = int(libc.mprotect(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), mmap.PROT_READ))
        if rc != 0:
            getattr(rt, "cudaGetLastError", lambda: None)()  # drain the latched error
        st = vma_stats(ptr)
        rec["anon_after"], rec["pss_after"], rec["private_dirty_after"] = (st.get("Anonymous"), st.get("Pss"),
                                                                           st.get("Private_Dirty"))
        if rc == 0:
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            rec["device_copy_ok"] = bool(int(dev[:: mmap.PAGESIZE].sum()) == nbytes // mmap.PAGESIZE)
            if kind in ("shared_rw", "private_cow"):
                host[:16] = 7
                dev.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                rec["device_sees_host_write"] = int(dev[0])
                rec["anon_after_write"] = vma_stats(ptr).get("Anonymous")
            rec["unregister_rc"] = int(rt.cudaHostUnregister(ptr))
        holder.stdin.write("\n")
        holder.stdin.flush()
        rec["other_process_sees_write"] = holder.stdout.readline().strip() == "7"
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        holder.kill()
        holder.wait()
        os.unlink(path)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--shm-dir", default="/dev/shm")
    args = ap.parse_args()
    nbytes = args.mib << 20
    out: dict[str, object] = {"kernel": platform.release(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0)}
    try:
        attr = 113  # cudaDevAttrHostRegisterReadOnlySupported
        rt = torch.cuda.cudart()
        out["read_only_supported_attr"] = str(rt.cudaDeviceGetAttribute(attr, 0)) \
            if hasattr(rt, "cudaDeviceGetAttribute") else "n/a (binding lacks cudaDeviceGetAttribute)"
    except Exception as exc:
        out["read_only_supported_attr"] = f"{type(exc).__name__}: {exc}"
    results = []
    cases = [("shared_rw", "default"), ("shared_rw_then_ro", "default"), ("shared_ro", "read_only"),
             ("private_cow", "default"), ("private_cow", "read_only"), ("shared_rw", "read_only"),
             ("shared_ro", "default")]
    for kind, flag in cases:
        results.append(probe(kind, flag, nbytes, args.shm_dir))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    out["results"] = results
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
