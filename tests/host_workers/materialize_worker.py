"""One rank of a host-materialisation scenario, started by torchrun from tests/test_host_distributed.py.

Writes ``<out>/rank<R>.json`` with what the test checks. Scenarios:
``ep``       every rank builds its own experts; EP size from MAGI_EP_SIZE (or --unsafe to force one file)
``shared``   identical weights on every rank (EP 1): one file per node
``mismatch`` EP 1 but different experts: error expected, then on_mismatch='per_rank'
``crash``    rank 0 kills itself in the middle of copying (the test then checks the cleanup)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import stat

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from magi_core import get_backend
from magi_core.host import HostOptions, materialize
from magi_core.host.memstat import process_memory
from magi_core.plugin.cpu import registered_ranges


class Model(nn.Module):
    """A dense trunk (same on every rank) and an expert shard (rank-specific when ``own_experts``)."""

    def __init__(self, rank: int, own_experts: bool, dense_mb: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        n = int((dense_mb * 2**20 / 4) ** 0.5)
        self.dense = nn.Linear(n, n, bias=True)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(n, n, generator=g))
            self.dense.bias.copy_(torch.randn(n, generator=g))
        eg = torch.Generator().manual_seed(1000 + rank if own_experts else 1000)
        self.experts = nn.Parameter(torch.randn(4, 64, 64, generator=eg).to(torch.bfloat16))
        self.register_buffer("router", torch.randn(64, 4, generator=g))
        self.head = nn.Linear(64, 8)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(8, 64, generator=g))
            self.head.bias.zero_()
        self.tied = self.head  # the same module (and weights) reachable twice


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (all of them)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dense-mb", type=int, default=2)
    ap.add_argument("--unsafe", action="store_true")
    ap.add_argument("--device", action="store_true", help="use the accelerator (NCCL etc.) instead of gloo")
    args = ap.parse_args()
    if args.device:
        be = get_backend()
        be.device_module.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(device_id=be.device(int(os.environ["LOCAL_RANK"])),
                                timeout=datetime.timedelta(seconds=90))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    shm_dir = os.environ["MAGI_SHM_DIR"]
    own = args.scenario in ("ep", "mismatch")
    model = Model(rank, own, args.dense_mb)
    rec: dict[str, object] = {"rank": rank, "world": dist.get_world_size()}
    rec["experts_before"] = digest(model.experts)
    rec["dense_before"] = digest(model.dense.weight)
    expert_param = model.experts
    seen_modes: list[int] = []

    def on_progress(phase: str, done: int, total: int) -> None:
        for name in os.listdir(shm_dir):
            try:
                seen_modes.append(stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode))
            except FileNotFoundError:  # another rank unlinked its file (mapped) since the listing
                continue
        if args.scenario == "crash" and rank == 0 and phase == "copy":
            os.kill(os.getpid(), signal.SIGKILL)

    opts = HostOptions(_unsafe_share_across_ranks=args.unsafe, progress=False)
    if args.scenario == "mismatch":
        ptr_before = model.experts.data_ptr()
        try:
            materialize(model, options=opts, on_progress=on_progress)
            rec["error"] = None
        except Exception as exc:
            rec["error"] = type(exc).__name__
            rec["message"] = str(exc)
        rec["unchanged_after_error"] = (model.experts.data_ptr() == ptr_before
                                        and digest(model.experts) == rec["experts_before"])
        rec["files_after_error"] = sorted(os.listdir(shm_dir))
        opts = HostOptions(on_mismatch="per_rank", progress=False)
    hw = materialize(model, options=opts, on_progress=on_progress)
    rec["identity_kept"] = model.experts is expert_param and model.tied.weight is model.head.weight
    rec["mode"] = hw.report["mode"]
    rec["inodes"] = sorted(f["inode"] for f in hw.report["files"])
    rec["files_unlinked"] = all(not os.path.exists(p) for p in hw.files)
    rec["file_modes"] = sorted(set(seen_modes))
    if args.device:  # the host weights reach the device intact (non_blocking from the pinned mapping)
        dev = torch.device(get_backend().device_type, int(os.environ["LOCAL_RANK"]))
        on_dev = model.dense.weight.to(dev, non_blocking=True)
        model.to(dev)
        rec["device_copy_ok"] = bool(torch.equal(on_dev.cpu(), model.dense.weight))
        rec["host_after_to"] = model.dense.weight.device.type == "cpu"
    rec["experts_after"] = digest(model.experts)
    rec["dense_after"] = digest(model.dense.weight)
    rec["weight_bytes"] = hw.weight_bytes
    rec["pinned_bytes"] = hw.pinned_bytes
    rec["registered"] = len(registered_ranges())
    rec["pin"] = hw.report.get("pin")
    with torch.no_grad():  # touch every page so each rank's share of the mapping is resident
        for p in model.parameters():
            p.float().sum()
    dist.barrier()
    rec["pss_shmem"] = process_memory().get("Pss_Shmem", 0)  # whole process (drivers' mappings too): for logs only
    arena = hw.mapping_memory()  # only the arena mappings: what the sharing tests compare
    rec["arena_pss"], rec["arena_rss"], rec["arena_mappings"] = arena["Pss"], arena["Rss"], arena["mappings"]
    rec["arenas"] = len(hw.mapped_ranges)
    dist.barrier()
    hw.release()
    rec["registered_after_release"] = len(registered_ranges())
    dist.barrier()
    rec["dir_after"] = sorted(os.listdir(shm_dir))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
