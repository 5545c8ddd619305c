"""One rank of tests/host/test_host_setup_errors.py, started by torchrun (gloo, a short process-group timeout).

For each scenario one rank gets a bad input and every rank calls ``magi_core.load`` on a meta model:
``missing``    the bad rank's checkpoint does not exist
``truncated``  the bad rank's checkpoint lost its last bytes
``env``        the bad rank's environment has MAGI_PIN_CONCURRENCY=0 (its HostOptions do not resolve)
``object``     the bad rank passes a dict where HostOptions are expected
Each rank records what it raised, how long the call took, and what was left behind (files in the shm directory,
registered ranges, real tensors in the model); finally every rank loads the good checkpoint and releases it.
Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import magi_core
from magi_core.host import HostOptions
from magi_core.plugin.cpu import registered_ranges

SCENARIOS = ("missing", "truncated", "env", "object")


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).eval()


def bad_rank(scenario: str, world: int) -> int:
    return {"missing": world - 1, "truncated": 0, "env": 1, "object": world - 1}[scenario]


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    shm_dir = os.environ["MAGI_SHM_DIR"]
    good = args.ckpt
    truncated = os.path.join(os.path.dirname(good), "truncated.safetensors")
    rec: dict[str, Any] = {"rank": rank, "world": world}
    for scenario in SCENARIOS:
        bad = rank == bad_rank(scenario, world)
        path: str = good
        options: Any = HostOptions(progress=False)
        if bad and scenario == "missing":
            path = os.path.join(os.path.dirname(good), "absent.safetensors")
        elif bad and scenario == "truncated":
            path = truncated
        elif bad and scenario == "env":
            os.environ["MAGI_PIN_CONCURRENCY"] = "0"
        elif bad and scenario == "object":
            options = {"pin": False}
        model = meta_model()
        t0 = time.monotonic()
        try:
            magi_core.load(model, path, host_options=options)
            out: dict[str, Any] = {"error": None}
        except Exception as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        out["seconds"] = time.monotonic() - t0
        os.environ.pop("MAGI_PIN_CONCURRENCY", None)
        out["bad"] = bad
        out["still_meta"] = all(t.is_meta for t in model.state_dict().values())
        out["registered"] = len(registered_ranges())
        dist.barrier()  # every rank has cleaned up before anyone lists the directory
        out["files"] = sorted(os.listdir(shm_dir))
        dist.barrier()
        rec[scenario] = out
    model = meta_model()
    magi_core.load(model, good, host_options=HostOptions(progress=False))
    rec["loaded"] = bool(torch.equal(model[0].bias.detach(), torch.arange(16, dtype=torch.float32)))
    magi_core.release(model)
    dist.barrier()
    rec["dir_after"] = sorted(os.listdir(shm_dir))
    rec["registered_after"] = len(registered_ranges())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
