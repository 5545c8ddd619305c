"""Cost of the full-content check of shared host weights (``HostOptions(verify_shared="full")``), in GB/s.

A rank that maps another rank's file compares every byte of its own weights with the file's before using it
(``magi_core.host.arena.same_bytes``, slot by slot). Two measurements, written as one JSON document with
hardware and date:

``compare``     the comparison alone: own tensors (anonymous memory) against a tmpfs file mapped the way
                readers map it, for a few slot sizes (GB/s = bytes of weights checked per second; each byte
                is read twice, once from each side)
``end_to_end``  two gloo ranks on this machine materialise one model with ``verify_shared="full"`` and
                ``"sampled"``: the reader's check time and the difference in materialisation time

    python benchmarks/share_verify_cost.py --out benchmarks/results/<date>-share-verify-<host>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from script_io import emit_json
from torch import nn

from magi_core.bench.measure import cpu_name
from magi_core.host import HostOptions, materialize, shm
from magi_core.host.arena import same_bytes

MB = 1 << 20


def compare(shm_dir: str, total_mb: int, slot_kib: int, repeats: int) -> dict[str, Any]:
    """GB/s of same_bytes over ``total_mb`` of weights cut into slots of ``slot_kib`` KiB."""
    nbytes = total_mb * MB
    own = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    path = os.path.join(shm_dir, f"magi-bench-verify-{os.getpid()}.bin")
    fd = shm.create(path, nbytes)
    try:
        w = shm.map_fd(fd, nbytes)
        torch.frombuffer(w, dtype=torch.uint8).copy_(own)
        mm = shm.map_fd(fd, nbytes, private=True)  # as a reader maps it (copy-on-write flavour; same pages)
    finally:
        shm.unlink(path)
        os.close(fd)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    step = slot_kib * 1024
    bounds = [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        ok = all(same_bytes(own[lo:hi], host[lo:hi]) for lo, hi in bounds)
        samples.append(time.perf_counter() - t0)
        assert ok
    best, med = min(samples[1:]), statistics.median(samples[1:])  # the first pass faults the pages in
    return {"total_mb": total_mb, "slot_kib": slot_kib, "slots": len(bounds), "first_pass_s": samples[0],
            "median_s": med, "gb_per_s_median": nbytes / med / 1e9, "gb_per_s_best": nbytes / best / 1e9}


class _Model(nn.Module):
    def __init__(self, mb: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        per = mb * MB // 4 // 8
        side = int(per ** 0.5)
        self.layers = nn.ModuleList(nn.Linear(side, side) for _ in range(8))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _rank(rank: int, world: int, port: int, shm_dir: str, mb: int, out: str, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = {}
    for mode in ("sampled", "full") * (repeats + 1):  # the first pair warms up (dropped below)
        model = _Model(mb)
        dist.barrier()
        t0 = time.perf_counter()
        hw = materialize(model, options=HostOptions(shm_dir=shm_dir, progress=False, pin=False, verify_shared=mode))
        seconds = time.perf_counter() - t0
        rows.setdefault(mode, []).append({"seconds": seconds, "verify_seconds": hw.report.get("verify_seconds"),
                                          "mode": hw.report["mode"], "weight_bytes": hw.weight_bytes})
        hw.release()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def end_to_end(shm_dir: str, mb: int, repeats: int) -> dict[str, Any]:
    """Two gloo ranks, one shared file: the reader's check and the change in materialisation time (medians of
    ``repeats`` runs of each mode, alternating, after one warm-up pair; on a loaded machine the whole-run
    times are noisy, the check's own time is the direct cost: the writer waits for it)."""
    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, shm_dir, mb, out, repeats), nprocs=2, join=True)
        recs = []
        for r in range(2):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                recs.append({m: rows[1:] for m, rows in json.load(f).items()})  # drop the warm-up
    reader = recs[1]
    weight_bytes = reader["full"][-1]["weight_bytes"]
    verify = statistics.median(r["verify_seconds"] for r in reader["full"])
    full = statistics.median(r["seconds"] for r in reader["full"])
    sampled = statistics.median(r["seconds"] for r in reader["sampled"])
    return {"model_mb": weight_bytes / MB, "mode": reader["full"][-1]["mode"], "repeats": repeats,
            "reader_verify_s_median": verify, "reader_verify_gb_per_s": weight_bytes / verify / 1e9,
            "materialize_full_s_median": full, "materialize_sampled_s_median": sampled,
            "materialize_added_s_median": full - sampled, "ranks": recs}


def main() -> int:
    """Measure and write or print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shm-dir", default=os.environ.get("MAGI_SHM_DIR", "/dev/shm"))
    ap.add_argument("--mb", type=int, default=512, help="bytes of weights compared (MiB)")
    ap.add_argument("--model-mb", type=int, default=256, help="model size of the two-rank run (MiB; 0 skips it)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shm_dir = tempfile.mkdtemp(prefix="magi-bench-", dir=args.shm_dir)
    try:
        rows = [compare(shm_dir, args.mb, kib, args.repeats) for kib in (4, 256, 4096, 64 * 1024, args.mb * 1024)]
        e2e = end_to_end(shm_dir, args.model_mb, args.repeats) if args.model_mb > 0 else None
    finally:
        left = os.listdir(shm_dir)
        os.rmdir(shm_dir) if not left else None
    doc = {
        "what": "full-content check of shared host weights: same_bytes of own tensors vs the mapped file",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
                     "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "shm_fs": shm.fs_type(shm_dir), "load_avg_at_end": os.getloadavg(), "compare": rows, "end_to_end": e2e,
        "files_left": left,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
