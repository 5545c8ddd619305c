"""Host bytes per node when the ranks of a node share each tensor by content, against the all-shared layout (one
copy of everything: what EP 1 gave, wrong when ranks differ) and the all-private one (a copy per rank: what
``MAGI_EP_SIZE`` > 1 gave for every tensor).

For 2 and 4 gloo ranks on this machine (torch.multiprocessing), each scenario materialises a model of a dense
trunk and an expert shard on every rank:

``identical``      every tensor the same on every rank
``different``      every tensor differs (seeded by rank)
``experts``        dense identical, experts differ on every rank (expert parallelism, EP = ranks)
``experts_ep2``    dense identical, experts seeded by ``rank % 2`` (EP 2 with data parallelism; 4 ranks only)
``load_files``     a model built on the meta device, loaded from one safetensors checkpoint (identical by
                   provenance: read once per node, never compared)

and reports the node's bytes from the sharing report (``distinct``), the proportional set size of the arena
mappings summed over the ranks (measured in /proc: a page mapped by k ranks counts 1/k on each), the set-up
time, and that every rank's weights equal its own model's. Written as one JSON document with hardware and date:

    python benchmarks/share_by_content.py --out benchmarks/results/<date>-share-by-content-<host>.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import socket
import sys
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

MB = 1 << 20


class _Model(nn.Module):
    """``dense_mb`` MiB of float32 dense layers and ``experts_mb`` MiB of bfloat16 experts."""

    def __init__(self, dense_mb: int, experts_mb: int, dense_seed: int, expert_seed: int | None) -> None:
        super().__init__()
        side = int((dense_mb * MB // 4 // 4) ** 0.5)
        self.dense = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(4))
        per = experts_mb * MB // 2 // 8
        self.experts = nn.Parameter(torch.empty(8, per // 1024, 1024, dtype=torch.bfloat16))
        if expert_seed is None:  # on the meta device: filled by loading
            return
        g, e = torch.Generator().manual_seed(dense_seed), torch.Generator().manual_seed(expert_seed)
        with torch.no_grad():
            for p in self.dense.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.experts.copy_(torch.randn(self.experts.shape, generator=e))


def _digest(m: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _seeds(scenario: str, rank: int) -> tuple[int, int]:
    return {"identical": (0, 1000), "different": (rank, 1000 + rank), "experts": (0, 1000 + rank),
            "experts_ep2": (0, 1000 + rank % 2), "load_files": (0, 1000)}[scenario]


def _rank(rank: int, world: int, port: int, shm_dir: str, out: str, dense_mb: int, experts_mb: int,
          scenarios: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    ckpt = os.path.join(out, "checkpoint.safetensors")
    for scenario in scenarios:
        dense_seed, expert_seed = _seeds(scenario, rank)
        ref = _Model(dense_mb, experts_mb, dense_seed, expert_seed)
        if scenario == "load_files":
            if rank == 0:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, ckpt)
            with torch.device("meta"):
                model = _Model(dense_mb, experts_mb, 0, None)
        else:
            model = ref
        want = _digest(ref)
        dist.barrier()
        t0 = time.perf_counter()
        hw = materialize(model, options=HostOptions(shm_dir=shm_dir, progress=False, pin=False),
                         source=ckpt if scenario == "load_files" else None)
        seconds = time.perf_counter() - t0
        own_values = _digest(model) == want
        with torch.no_grad():  # touch every page: each rank's share of every mapping is resident
            for p in model.parameters():
                p.float().sum()
        dist.barrier()
        mem = hw.mapping_memory()
        rows.append({"scenario": scenario, "seconds": seconds, "pss": mem["Pss"], "mode": hw.report["mode"],
                     "node_bytes": hw.report["node_bytes"], "own_bytes": hw.report["own_bytes"],
                     "weight_bytes": hw.weight_bytes, "own_values": own_values,
                     "bytes_read": (hw.report.get("load") or {}).get("bytes_read")})
        dist.barrier()
        hw.release()
        del model, ref
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def run(world: int, shm_dir: str, dense_mb: int, experts_mb: int) -> list[dict[str, Any]]:
    """Every scenario on ``world`` ranks; one row per scenario (node figures, per-rank details)."""
    scenarios = ["identical", "different", "experts", "load_files"] + (["experts_ep2"] if world >= 4 else [])
    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(world, port, shm_dir, out, dense_mb, experts_mb, scenarios), nprocs=world, join=True)
        recs = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                recs.append(json.load(f))
    rows = []
    for i, scenario in enumerate(scenarios):
        per = [rec[i] for rec in recs]
        nb = per[0]["node_bytes"]
        rows.append({
            "ranks": world, "scenario": scenario, "weight_bytes_per_rank": per[0]["weight_bytes"],
            "node_bytes": nb["distinct"], "all_shared_bytes": nb["all_shared"], "all_private_bytes": nb["all_private"],
            "vs_all_private": nb["distinct"] / nb["all_private"], "vs_all_shared": nb["distinct"] / nb["all_shared"],
            "measured_pss_bytes": sum(p["pss"] for p in per), "setup_seconds_max": max(p["seconds"] for p in per),
            "modes": [p["mode"] for p in per], "own_bytes": [p["own_bytes"] for p in per],
            "every_rank_has_its_own_values": all(p["own_values"] for p in per),
            "bytes_read_per_rank": [p["bytes_read"] for p in per] if scenario == "load_files" else None,
        })
    return rows


def main() -> int:
    """Measure and write or print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shm-dir", default=os.environ.get("MAGI_SHM_DIR", "/dev/shm"))
    ap.add_argument("--dense-mb", type=int, default=48, help="dense weights per rank (MiB, float32)")
    ap.add_argument("--experts-mb", type=int, default=16, help="expert weights per rank (MiB, bfloat16)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    shm_dir = tempfile.mkdtemp(prefix="magi-bench-", dir=args.shm_dir)
    try:
        rows = [row for world in args.ranks for row in run(world, shm_dir, args.dense_mb, args.experts_mb)]
    finally:
        left = os.listdir(shm_dir)
        if not left:
            os.rmdir(shm_dir)
    doc = {
        "what": "host bytes per node with per-tensor sharing by content, vs all-shared and all-private layouts",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "hardware": {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
                     "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "python": platform.python_version(), "torch": torch.__version__, "shm_fs": shm.fs_type(args.shm_dir),
        "model": {"dense_mb": args.dense_mb, "experts_mb": args.experts_mb},
        "results": rows, "files_left": left,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
