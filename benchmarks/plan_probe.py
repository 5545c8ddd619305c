"""Why a plan runs slower than predicted: per policy (and HEURISTIC variants), the plan, the step and the copy
stream's gaps.

    python benchmarks/plan_probe.py --model llama8b --tokens 2048 --ratio 0 --out plan_probe.json

For each variant: ``magi_core.offload`` a fresh model, warm it up, time ``--steps`` calls (median), and record
the plan (resident units, copy positions, next-step carry), the unit profiles it was built from, the unit
transfer's buffer bytes and fallbacks, and from one profiled step the copy stream's busy share and its
largest gaps (which copy waited, after what). Variants ``HEURISTIC-nocarry`` and ``HEURISTIC-nobusy`` switch
off the cross-call carry search and the busy-copy-stream rule of :mod:`magi_core.plan.heuristic` for that run
only. Diagnostics: nothing is asserted; results JSON with hardware and date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from script_io import emit_json  # type: ignore[import-not-found]

import magi_core
from magi_core import OffloadConfig
from magi_core.api import handle, release
from magi_core.bench.real import REAL_WORKLOADS, real_workload
from magi_core.bench.workloads import probe_workload
from magi_core.plan import heuristic


@contextlib.contextmanager
def variant(name: str) -> Iterator[str]:
    """Patch :mod:`magi_core.plan.heuristic` for a HEURISTIC variant; yields the policy to configure."""
    saved = (heuristic._earlier_carry, heuristic.BUSY_SHARE)
    try:
        if name == "HEURISTIC-nocarry":
            heuristic._earlier_carry = lambda plan, *a, **k: plan  # type: ignore[assignment]
        elif name == "HEURISTIC-nobusy":
            heuristic.BUSY_SHARE = float("inf")
        yield name.split("-")[0]
    finally:
        heuristic._earlier_carry, heuristic.BUSY_SHARE = saved


def copy_gaps(prof: Any, top: int = 8) -> dict[str, Any]:
    """Host-to-device copies of one profiled step: busy share of the copy span and the largest gaps."""
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sorted((e for e in ev if "Memcpy HtoD" in e.name), key=lambda e: e.time_range.start)
    if not copies:
        return {}
    busy = sum(e.time_range.end - e.time_range.start for e in copies)
    span = copies[-1].time_range.end - copies[0].time_range.start
    pairs = enumerate(zip(copies, copies[1:], strict=False), 1)
    gaps = [(b.time_range.start - a.time_range.end, i) for i, (a, b) in pairs]
    gaps.sort(reverse=True)
    return {
        "copies": len(copies), "busy_us": busy, "span_us": span, "busy_share": busy / span if span else 1.0,
        "copy_us": [round(e.time_range.end - e.time_range.start, 1) for e in copies[:40]],
        "largest_gaps_us": [{"gap_us": g, "before_copy": i} for g, i in gaps[:top]],
        "sum_gaps_us": sum(g for g, _ in gaps),
    }


def run_variant(wl: Any, name: str, ratio: float, args: argparse.Namespace, dm: Any) -> dict[str, Any]:
    """Offload, warm up, time, profile one step; the plan and transfer facts of this variant."""
    call_args, call_kwargs = wl.make_inputs(args.tokens, magi_core.get_backend().device())
    with variant(name) as policy:
        torch._dynamo.reset()
        m = magi_core.offload(wl.fresh(), OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio))
        with torch.no_grad():
            for _ in range(6):
                m(*call_args, **call_kwargs)
            dm.synchronize()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                m(*call_args, **call_kwargs)
                dm.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m(*call_args, **call_kwargs)
                dm.synchronize()
    rt = handle(m).runtimes[-1]
    plan = rt.plan
    tr = rt.executor.transfer
    out = {
        "variant": name, "ratio": ratio, "step_ms": statistics.median(times), "steps_ms": times,
        "predicted_step_ms": plan.predicted_step_ms,
        "plan": {"resident": sorted(plan.resident), "next_step": list(plan.next_step),
                 "next_step_at": plan.next_step_at,
                 "prefetch_at": {str(k): list(v) for k, v in plan.prefetch_at.items() if v},
                 "notes": dict(plan.notes)},
        "bandwidth_GBps": rt.bandwidth_Bps / 1e9 if rt.bandwidth_Bps else None,
        "transfer": type(tr).__name__, "buffer_bytes": getattr(tr, "buffer_bytes", None),
        "fallbacks": getattr(tr, "fallbacks", None), "copy_calls": getattr(tr, "copy_calls", None),
        "peak_alloc_bytes": dm.max_memory_allocated(),
        "copy_stream": copy_gaps(prof),
    }
    if args.profiles:
        out["profiles"] = [{"bytes": p.weight_bytes, "compute_ms": round(p.compute_ms, 4), "last_use": p.last_use}
                           for p in rt.profiles or []]
    release(m)
    del m
    dm.synchronize()
    dm.empty_cache()
    dm.reset_peak_memory_stats()
    return out


def main() -> None:
    """Run each variant on one workload and token count."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.0)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default="BASE,HEURISTIC,HEURISTIC-nocarry,HEURISTIC-nobusy")
    ap.add_argument("--profiles", action="store_true", help="also record the unit profiles of each variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be = magi_core.get_backend()
    dm = be.device_module
    accel = be.is_accelerator
    if args.model in REAL_WORKLOADS:
        wl = real_workload(args.model, torch.bfloat16 if accel else torch.float32, "full" if accel else "tiny",
                           args.layers)
        wl.materialize_base()
    else:
        wl = probe_workload(args.model, accel, args.layers)
    runs = [run_variant(wl, v, args.ratio, args, dm) for v in args.variants.split(",")]
    hardware = dm.get_device_name() if accel and hasattr(dm, "get_device_name") else platform.processor()
    emit_json({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "hardware": hardware,
               "torch": torch.__version__, "magi_core": magi_core.__version__, "model": args.model,
               "tokens": args.tokens, "ratio": args.ratio, "runs": runs,
               "command": f"python benchmarks/plan_probe.py --model {args.model} --tokens {args.tokens} "
                          f"--ratio {args.ratio}"}, args.out)


if __name__ == "__main__":
    main()
