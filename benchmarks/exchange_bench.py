"""Weight exchange across the GPUs of one host against each rank streaming everything over its own link.

    torchrun --nproc-per-node 2 benchmarks/exchange_bench.py --out benchmarks/results/exchange_2xh200.json
    torchrun --nproc-per-node 2 benchmarks/exchange_bench.py --model llama8b --tokens 2048 --out ...  (transformers)

Every rank runs the same model (data parallel) at ratio 0 (everything streamed) from one shared host copy,
HEURISTIC, with ``OffloadConfig(exchange="off")`` (each rank copies every weight over its own host link) and
then ``exchange="on"`` (each rank copies 1/N of every unit and the ranks all-gather the rest), the same
inputs on every rank. Per configuration and rank: median step time, the weight rate it implies (streamed
bytes / step), and against the single-link ideal (streamed bytes / the measured host-to-device rate).
Outputs of the two paths are compared bit for bit. Rank 0 writes JSON with hardware, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from script_io import emit_json, start_ranks

import magi_core
from magi_core.bench.measure import main_tensor
from magi_core.bench.real import REAL_WORKLOADS, real_workload
from magi_core.bench.workloads import probe_workload
from magi_core.config import OffloadConfig


def main() -> None:
    """Run both paths on every rank and write the figures (rank 0)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("mlp", "transformer", "llama8b", "wan14b"), default="mlp",
                    help="llama8b / wan14b: the real-model workloads of `magi bench` (full size on an accelerator, "
                    "tiny on the cpu backend; --layers sets their blocks)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be, device, rank, world = start_ranks()
    dm = be.device_module
    accel = be.is_accelerator
    hidden = args.hidden or (4096 if accel else 64)
    if args.model in REAL_WORKLOADS:
        wl = real_workload(args.model, torch.bfloat16 if accel else torch.float32, "full" if accel else "tiny",
                           args.layers)
        wl.materialize_base()
    else:
        wl = probe_workload(args.model, accel, args.layers, hidden)
    call_args, call_kwargs = wl.make_inputs(args.tokens, device)
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": dm.get_device_name() if accel and hasattr(dm, "get_device_name") else platform.processor(),
        "gpus": world, "backend": be.name, "torch": torch.__version__, "python": platform.python_version(),
        "magi_core": magi_core.__version__, "model": args.model, "tokens": args.tokens, "hidden": hidden,
        "weight_bytes": wl.weight_bytes, "command": f"torchrun --nproc-per-node {world} benchmarks/exchange_bench.py "
        f"--model {args.model} --tokens {args.tokens}",
    }
    outs = {}
    for mode in ("off", "on"):
        torch._dynamo.reset()
        cfg = OffloadConfig(gpu_resident_weight_ratio=0.0, exchange=mode)
        m = magi_core.offload(wl.fresh(), cfg)
        with torch.no_grad():
            for _ in range(4):
                m(*call_args, **call_kwargs)
            times = []
            for _ in range(args.steps):
                dm.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                out = main_tensor(m(*call_args, **call_kwargs))
                dm.synchronize()
                times.append(time.perf_counter() - t0)
            outs[mode] = out.float().cpu()
        rt = magi_core.handle(m).runtime
        ex = rt.executor
        step = statistics.median(times)
        streamed = ex.actions.streamed_bytes
        link = float(rt.bandwidth_Bps) if mode == "off" else None
        entry = {"step_ms": step * 1e3, "streamed_bytes": streamed, "weight_rate_GBps": streamed / step / 1e9,
                 "transfer": type(ex.transfer).__name__, "planning_rate_GBps": rt.bandwidth_Bps / 1e9,
                 "exchanges": getattr(ex.transfer, "exchanges", 0), "predicted_step_ms": rt.plan.predicted_step_ms}
        if link is not None:
            res["link_GBps"] = link / 1e9
        per_rank = [None] * world
        dist.all_gather_object(per_rank, entry)
        res[f"exchange_{mode}"] = per_rank
        magi_core.release(m)
    same = torch.equal(outs["off"], outs["on"])
    flags = [None] * world
    dist.all_gather_object(flags, same)
    res["outputs_identical"] = flags
    link = res["link_GBps"] * 1e9  # the measured host-to-device rate
    for r in range(world):
        for mode in ("off", "on"):
            e = res[f"exchange_{mode}"][r]
            e["x_single_link_rate"] = e["weight_rate_GBps"] * 1e9 / link
            e["single_link_ideal_ms"] = e["streamed_bytes"] / link * 1e3
    res["target"] = ">= 1.6x the single-link rate per GPU with exchange on, outputs identical"
    res["ok"] = all(flags) and all(e["x_single_link_rate"] >= 1.6 for e in res["exchange_on"])
    if rank == 0:
        emit_json(res, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
