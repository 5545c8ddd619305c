"""One torchrun rank (gloo) calling an offloaded model as data-parallel code does: its own number of calls and its
own shapes. A model call is no collective: no rank waits for another inside it (planning, the bandwidth probe)."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import magi_core


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank: one shared host copy
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))).eval()
    ref = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))).eval()
    ref.load_state_dict(model.state_dict())
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=0.5, warmup_calls=2,
                                                     unit_compiler="eager"), dynamic=False)
    # rank 0 plans its first shape (third call) and a second shape; rank 1 never gets that far
    shapes = [3, 3, 3, 3, 5, 5, 5] if rank == 0 else [3, 3]
    worst = 0.0
    with torch.no_grad():
        for n in shapes:
            x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
            worst = max(worst, float((model(x).cpu() - ref(x)).abs().max()))
    dist.barrier()  # both ranks get here: neither waited for the other inside a call
    phases = [r.phase for r in magi_core.handle(model).runtimes]
    magi_core.release(model)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "calls": len(shapes), "max_abs_diff": worst, "phases": phases}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
