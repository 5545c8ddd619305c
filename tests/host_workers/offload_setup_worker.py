"""One rank of tests/api/test_offload_setup_errors.py, started by torchrun (gloo, a short process-group timeout).

For each scenario one rank passes a bad argument and every rank calls ``magi_core.offload`` (or ``load``):
``dict``      the bad rank passes a dict where an OffloadConfig belongs
``env``       the bad rank's environment names a policy no scheduler answers to (MAGI_OFFLOAD_POLICY)
``kwarg``     the bad rank passes policy=... to offload() instead of an OffloadConfig
``methods``   the bad rank asks for a method the model does not have
``load``      the bad rank passes the config where load() takes the checkpoint
Each rank records what it raised, how long the call took and what was left behind; finally every rank offloads
the model for real and releases it. Writes ``<out>/rank<R>.json``.
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
from magi_core import OffloadConfig
from magi_core.host import HostOptions
from magi_core.plugin.cpu import registered_ranges

SCENARIOS = ("dict", "env", "kwarg", "methods", "load")
CFG = OffloadConfig(unit_compiler="eager", warmup_calls=1)


def bad_rank(scenario: str, world: int) -> int:
    return {"dict": 0, "env": world - 1, "kwarg": 1, "methods": 0, "load": world - 1}[scenario]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).eval()


def call(scenario: str, bad: bool, ckpt: str) -> None:
    opts = HostOptions(progress=False)
    m = model()
    if scenario == "load":
        with torch.device("meta"):
            meta = model()
        source: Any = CFG if bad else ckpt
        magi_core.load(meta, source, CFG, host_options=opts)
        magi_core.release(meta)
        return
    kwargs: dict[str, Any] = {}
    config: Any = CFG
    if bad and scenario == "dict":
        config = {"policy": "BASE"}
    elif bad and scenario == "kwarg":
        kwargs["policy"] = "BASE"
    elif bad and scenario == "methods":
        kwargs["methods"] = ("decode",)
    magi_core.offload(m, config, host_options=opts, **kwargs)
    magi_core.release(m)


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
    rec: dict[str, Any] = {"rank": rank, "world": world}
    for scenario in SCENARIOS:
        bad = rank == bad_rank(scenario, world)
        if bad and scenario == "env":
            os.environ["MAGI_OFFLOAD_POLICY"] = "fastest"
        t0 = time.monotonic()
        try:
            call(scenario, bad, args.ckpt)
            out: dict[str, Any] = {"error": None}
        except Exception as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        out["seconds"] = time.monotonic() - t0
        os.environ.pop("MAGI_OFFLOAD_POLICY", None)
        out["registered"] = len(registered_ranges())
        dist.barrier()  # every rank has cleaned up before anyone lists the directory
        out["files"] = sorted(os.listdir(shm_dir))
        dist.barrier()
        rec[scenario] = out
    m = model()
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = m(x)
        magi_core.offload(m, CFG, host_options=HostOptions(progress=False))
        rec["offloaded"] = bool(torch.allclose(m(x), ref))
    magi_core.release(m)
    dist.barrier()
    rec["dir_after"] = sorted(os.listdir(shm_dir))
    rec["registered_after"] = len(registered_ranges())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
