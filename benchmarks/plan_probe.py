"""Why a plan runs slower than predicted: per policy (and HEURISTIC variants), the plan, the step and the copy
stream's gaps.

    python benchmarks/plan_probe.py --model llama8b --tokens 2048 --ratio 0 --out plan_probe.json
    python benchmarks/plan_probe.py --model flux --tokens 4096 --ratio default --device-memory 24GiB \
        --variants HEURISTIC,HEURISTIC-nospread --out plan_probe.json

For each variant: ``magi_core.offload`` a fresh model, warm it up, time ``--steps`` calls (median), and record the
plan (resident units, copy positions, next-step carry), the unit profiles it was built from, the unit transfer's
buffer bytes and fallbacks, and from one profiled step the copy stream's busy share and its largest gaps (which copy
waited, after what), and the compute kernels' idle time (a step that waits for copies or for the host shows it
there). Variants ``HEURISTIC-nocarry``, ``HEURISTIC-nobusy`` and ``HEURISTIC-nospread`` switch off the cross-call
carry search, the busy-copy-stream rule and the spreading of streamed blocks of :mod:`magi_core.plan.heuristic` for
that run only; ``HEURISTIC-notrim`` keeps the fastest plan that fits the card as it is (no trimming of resident
weights its predicted step does not need). ``NAME@RATIO`` runs a variant at another ratio: ``HEURISTIC@1`` is the
whole graph compiled as one unit, next to the split plans of the same process; ``NAME#SIZE`` splits with
``max_unit_bytes=SIZE`` (consecutive blocks joined while they fit), e.g. ``HEURISTIC-notrim#2GiB``: fewer unit
boundaries, the same resident weights. ``resident`` is the whole model on the device, ``torch.compile``'d (the
compute ideal, measured in the same process). Timed steps run with the garbage collector off; ``host_ms`` is the
median host time of a call issued onto an idle device (up to its return, before the device finishes). ``--ratio
default`` plans as ``OffloadConfig()`` does (fit the card, the policy of the variant); ``--device-memory`` caps the
process's device memory first, as ``magi bench --device-memory`` does. ``--interleave`` keeps every variant alive
(device and host memory for each) and times them one step each in rotating rounds, so that the device's drift over
the run (clocks, temperature) falls on all alike. ``--trace DIR`` keeps each variant's profiled step as a gzipped
Chrome trace (``--trace-stacks``: with Python stacks, which slow the host several times); ``host_syncs`` lists the
synchronising calls of one step where the device has a sync debug mode. Diagnostics: nothing is asserted; results
JSON with hardware and date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import gzip
import pathlib
import platform
import re
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from script_io import emit_json  # type: ignore[import-not-found]

import magi_core
from magi_core import OffloadConfig
from magi_core.api import handle, release
from magi_core.bench.real import REAL_WORKLOADS, real_workload
from magi_core.bench.workloads import probe_workload
from magi_core.compile.runtime import OffloadRuntime
from magi_core.plan import heuristic
from magi_core.plugin.device_limit import limit_device_memory


@contextlib.contextmanager
def variant(name: str) -> Iterator[str]:
    """Patch :mod:`magi_core.plan.heuristic` for a HEURISTIC variant; yields the policy to configure."""
    saved = (heuristic._earlier_carry, heuristic.BUSY_SHARE, heuristic._spread_if_faster)
    least_memory = OffloadRuntime._least_memory
    try:
        if name == "HEURISTIC-nocarry":
            heuristic._earlier_carry = lambda plan, *a, **k: plan  # type: ignore[assignment]
        elif name == "HEURISTIC-nobusy":
            heuristic.BUSY_SHARE = float("inf")
        elif name == "HEURISTIC-nospread":
            heuristic._spread_if_faster = lambda plan, *a, **k: plan  # type: ignore[assignment]
        elif name == "HEURISTIC-notrim":
            OffloadRuntime._least_memory = lambda self, fastest, *a, **k: fastest  # type: ignore[method-assign]
        yield name.split("-")[0]
    finally:
        heuristic._earlier_carry, heuristic.BUSY_SHARE, heuristic._spread_if_faster = saved
        OffloadRuntime._least_memory = least_memory  # type: ignore[method-assign]


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


def compute_gaps(prof: Any, top: int = 8, min_us: float = 20.0) -> dict[str, Any]:
    """Kernels (not copies) of one profiled step: the time no kernel ran between the first and the last, and the
    largest such gaps with the kernel each delayed (gaps under ``min_us`` are launch spacing, left out)."""
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
          and "Memset" not in e.name]
    ev.sort(key=lambda e: e.time_range.start)
    if not ev:
        return {}
    gaps: list[tuple[float, str]] = []
    end = ev[0].time_range.end
    for e in ev[1:]:
        if e.time_range.start - end >= min_us:
            gaps.append((e.time_range.start - end, e.name[:60]))
        end = max(end, e.time_range.end)
    gaps.sort(reverse=True)
    span = end - ev[0].time_range.start
    return {"kernels": len(ev), "span_us": span, "idle_us": sum(g for g, _ in gaps),
            "largest_idle_us": [{"gap_us": round(g, 1), "before": n} for g, n in gaps[:top]]}


@dataclasses.dataclass
class Prepared:
    """One variant offloaded (or compiled resident) and warmed up, with its timings so far."""

    label: str
    name: str
    ratio: float | None
    model: Any
    held_bytes: int
    inputs: tuple[Any, dict[str, Any]]
    times: list[float] = dataclasses.field(default_factory=list)
    host: list[float] = dataclasses.field(default_factory=list)


def prepare(wl: Any, label: str, ratio: float | None, tokens: int, dm: Any) -> Prepared:
    """Offload (or compile resident) a fresh model for variant ``label`` and warm it up (it plans here)."""
    call_args, call_kwargs = wl.make_inputs(tokens, magi_core.get_backend().device())
    name, _, unit_cap = label.partition("#")  # NAME#SIZE: units of whole blocks up to SIZE (max_unit_bytes)
    name, _, at = name.partition("@")  # NAME@RATIO: this variant at another gpu_resident_weight_ratio
    ratio = float(at) if at else ratio
    before = dm.memory_allocated()
    with variant(name) as policy:
        if name == "resident":  # the whole model on the device, torch.compile'd: the compute ideal, same process
            m = torch.compile(wl.fresh().to(magi_core.get_backend().device()), dynamic=False)
        else:
            cfg = OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio, max_unit_bytes=unit_cap or None)
            m = magi_core.offload(wl.fresh(), cfg)
        with torch.no_grad():
            for _ in range(6):
                m(*call_args, **call_kwargs)
            dm.synchronize()
    return Prepared(label, name, ratio, m, dm.memory_allocated() - before, (call_args, call_kwargs))


def time_steps(p: Prepared, steps: int, dm: Any) -> None:
    """Time ``steps`` calls of ``p`` (step time to the device's end, then the host's own time per call) with the
    garbage collector off (a collection inside a timed step is noise of the process, not of the plan)."""
    call_args, call_kwargs = p.inputs
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            for _ in range(steps):
                t0 = time.perf_counter()
                p.model(*call_args, **call_kwargs)
                dm.synchronize()
                p.times.append((time.perf_counter() - t0) * 1e3)
            for _ in range(steps):  # a step whose host time reaches its step time is host-bound
                t0 = time.perf_counter()
                p.model(*call_args, **call_kwargs)
                p.host.append((time.perf_counter() - t0) * 1e3)
                dm.synchronize()
    finally:
        gc.enable()


def host_syncs(p: Prepared, dm: Any) -> list[str] | None:
    """The synchronizing calls one step of ``p`` makes (the device's sync debug mode, where it has one): each
    stalls the host until the device is idle, so the kernels after it wait for their launches."""
    set_mode = getattr(dm, "set_sync_debug_mode", None)
    if set_mode is None:
        return None
    call_args, call_kwargs = p.inputs
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            p.model(*call_args, **call_kwargs)
        finally:
            set_mode("default")
        dm.synchronize()
    return [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message)]


def finish(p: Prepared, args: argparse.Namespace, dm: Any) -> dict[str, Any]:
    """Profile one step of ``p``; its timings, plan and transfer facts; release it."""
    call_args, call_kwargs = p.inputs
    from torch.profiler import ProfilerActivity, profile
    syncs = host_syncs(p, dm)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                  with_stack=args.trace_stacks) as prof:
        p.model(*call_args, **call_kwargs)
        dm.synchronize()
    if args.trace:
        path = pathlib.Path(args.trace) / (re.sub(r"[^A-Za-z0-9_.-]", "_", p.label) + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    out: dict[str, Any] = {
        "variant": p.label, "step_ms": statistics.median(p.times), "steps_ms": p.times,
        "host_ms": statistics.median(p.host), "held_bytes": p.held_bytes,
        "peak_alloc_bytes": dm.max_memory_allocated(), "compute_stream": compute_gaps(prof), "host_syncs": syncs,
    }
    if p.name != "resident":
        rt = handle(p.model).runtimes[-1]
        plan = rt.plan
        assert plan is not None
        tr = rt.executor.transfer
        out.update({
            "ratio": p.ratio, "units": rt.executor.n_units,
            "predicted_step_ms": plan.predicted_step_ms,
            "plan": {"resident": sorted(plan.resident), "next_step": list(plan.next_step),
                     "next_step_at": plan.next_step_at,
                     "prefetch_at": {str(k): list(v) for k, v in plan.prefetch_at.items() if v},
                     "notes": dict(plan.notes)},
            "bandwidth_GBps": rt.bandwidth_Bps / 1e9 if rt.bandwidth_Bps else None,
            "transfer": type(tr).__name__, "buffer_bytes": getattr(tr, "buffer_bytes", None),
            "fallbacks": getattr(tr, "fallbacks", None), "copy_calls": getattr(tr, "copy_calls", None),
            "copy_stream": copy_gaps(prof), "device_budget_bytes": rt.device_budget_bytes,
        })
        if args.profiles:
            out["profiles"] = [{"bytes": q.weight_bytes, "compute_ms": round(q.compute_ms, 4), "last_use": q.last_use}
                               for q in rt.profiles or []]
        release(p.model)
    p.model = None
    return out


def _clean(dm: Any, forget_compiled: bool) -> None:
    """Give the device memory of what ran back (``forget_compiled``: Dynamo's compiled code too) and restart the
    peak statistic."""
    if forget_compiled:
        torch._dynamo.reset()
    dm.synchronize()
    dm.empty_cache()
    dm.reset_peak_memory_stats()


def run_variants(wl: Any, labels: list[str], ratio: float | None, args: argparse.Namespace,
                 dm: Any) -> list[dict[str, Any]]:
    """Each variant in turn, or (``--interleave``) all alive at once and timed one step each per round, in an order
    that rotates, so that the device's drift over the run (clocks, temperature) falls on every variant alike."""
    if not args.interleave:
        outs = []
        for label in labels:
            torch._dynamo.reset()
            p = prepare(wl, label, ratio, args.tokens, dm)
            time_steps(p, args.steps, dm)
            outs.append(finish(p, args, dm))
            _clean(dm, forget_compiled=True)
        return outs
    torch._dynamo.reset()
    prepared = [prepare(wl, label, ratio, args.tokens, dm) for label in labels]
    for r in range(args.steps):
        for k in range(len(prepared)):
            time_steps(prepared[(r + k) % len(prepared)], 1, dm)
    outs = []
    for p in prepared:
        outs.append(finish(p, args, dm))
        _clean(dm, forget_compiled=False)
    return outs


def main() -> None:
    """Run each variant on one workload and token count."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", default="0", help="gpu_resident_weight_ratio, or 'default' (fit the card)")
    ap.add_argument("--device-memory", default=None, metavar="SIZE", help="cap the device memory first (24GiB)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default="BASE,HEURISTIC,HEURISTIC-nocarry,HEURISTIC-nobusy")
    ap.add_argument("--profiles", action="store_true", help="also record the unit profiles of each variant")
    ap.add_argument("--interleave", action="store_true",
                    help="keep every variant alive and time them in rotating rounds (device memory for all)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write each variant's profiled step as a gzipped Chrome trace into DIR")
    ap.add_argument("--trace-stacks", action="store_true",
                    help="with Python stacks in the traces (the host runs several times slower under them)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be = magi_core.get_backend()
    dm = be.device_module
    cap = limit_device_memory(args.device_memory, backend=be) if args.device_memory else None
    ratio = None if args.ratio == "default" else float(args.ratio)
    accel = be.is_accelerator
    if args.model in REAL_WORKLOADS:
        wl = real_workload(args.model, torch.bfloat16 if accel else torch.float32, "full" if accel else "tiny",
                           args.layers)
        wl.materialize_base()
    else:
        wl = probe_workload(args.model, accel, args.layers)
    runs = run_variants(wl, args.variants.split(","), ratio, args, dm)
    hardware = dm.get_device_name() if accel and hasattr(dm, "get_device_name") else platform.processor()
    emit_json({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "hardware": hardware,
               "torch": torch.__version__, "magi_core": magi_core.__version__, "model": args.model,
               "tokens": args.tokens, "ratio": ratio, "device_memory": args.device_memory, "cap_bytes": cap,
               "runs": runs, "command": "python benchmarks/plan_probe.py " + " ".join(sys.argv[1:])}, args.out)


if __name__ == "__main__":
    main()
