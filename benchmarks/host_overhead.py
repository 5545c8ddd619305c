"""Where the offload executor's host time goes, per unit and per step, on the active backend.

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead.json [--model mlp|transformer]

Host time of one call issued onto an idle device (synchronised before and after, so the call never blocks
on a full launch queue), for one model and token count:

- the whole model compiled resident with Inductor, and magi-core with every unit resident (nothing streamed,
  units kept split by a budget that holds them all) with direct
  and with wrapped unit calls, all alive at once and measured in interleaved rounds (the median of per-round
  differences is the executor's host overhead over the compiled model, per unit);
- the executor's own loop at ratio 1, with every unit replaced by a cached result (no kernels);
- each unit's installed callable alone, and the Inductor code under it;
- magi-core at ratio 0 (everything streamed): host time per call minus the time the host blocks on its
  unit-done events (the host-lead limit that keeps allocations bounded), i.e. the host work of a streamed step;
- a cProfile of ten ratio-1 calls (top functions by own time).

Writes JSON with hardware, versions and date. Diagnostics only: no target is asserted here (the bench's
analysis reports the target). Run it alone on the machine: other load on the host skews host timings.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import magi_core
from magi_core import get_backend
from magi_core.bench.workloads import probe_workload
from magi_core.config import OffloadConfig
from magi_core.execute.unit_compile import output_code


def host_us(fn: Callable[[], Any], sync: Callable[[], None], calls: int = 20) -> float:
    """Median host time (us) of ``fn`` called on an idle device."""
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def unit_args(ex: Any, model_call: Callable[[], Any]) -> list[list[Any]]:
    """The argument lists of every unit in one real call (captured by wrapping the unit callables)."""
    captured: list[list[Any]] = [[] for _ in ex.fns]
    orig = list(ex.fns)

    def wrap(u: int, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(a: list[Any]) -> Any:
            captured[u] = list(a)
            return f(a)

        return g

    ex.fns = [wrap(u, f) for u, f in enumerate(orig)]
    model_call()
    ex.fns = orig
    return captured


def loop_only_us(ex: Any, call: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Host us of one call whose units return cached results (the executor's own per-step work)."""
    orig = list(ex.fns)
    cache: dict[int, Any] = {}

    def mk(u: int, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(a: list[Any]) -> Any:
            if u not in cache:
                cache[u] = f(a)
            return cache[u]

        return g

    ex.fns = [mk(u, f) for u, f in enumerate(orig)]
    try:
        call()
        return host_us(call, sync)
    finally:
        ex.fns = orig


def per_unit_calls(ex: Any, call: Callable[[], Any], sync: Callable[[], None]) -> list[dict[str, Any]]:
    """Host us of each unit's installed callable alone, and of the Inductor code under it when found."""
    rows = []
    for u, a in enumerate(unit_args(ex, call)):
        f = ex.fns[u]
        row: dict[str, Any] = {"unit": u, "callable_us": host_us(lambda f=f, a=a: f(list(a)), sync),
                               "direct": ex.direct_units[u]}
        inner = f if ex.direct_units[u] else output_code(f)
        if inner is not None:
            row["inductor_call_us"] = host_us(lambda inner=inner, a=a: inner(list(a)), sync)
        rows.append(row)
    return rows


def profile(call: Callable[[], Any], sync: Callable[[], None]) -> list[str]:
    """cProfile of ten calls, top 30 functions by own time."""
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(10):
        call()
    prof.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return buf.getvalue().splitlines()


def main() -> int:
    """Run the measurements and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--tokens", type=int, default=None, help="default 2048 on a device, 16 on cpu")
    ap.add_argument("--layers", type=int, default=None, help="default 24 (mlp) / 8 (transformer) on a device")
    ap.add_argument("--hidden", type=int, default=None, help="default 4096 on a device, 64 on cpu")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved measurement rounds (5 calls each)")
    ap.add_argument("--out", default=None, help="JSON path (printed when omitted)")
    args = ap.parse_args()

    be = get_backend()
    dm = be.device_module
    device = be.device()
    accel = be.is_accelerator
    hidden = args.hidden or (4096 if accel else 64)
    tokens = args.tokens or (2048 if accel else 16)
    wl = probe_workload(args.model, accel, args.layers, hidden)
    x = wl.make_input(tokens, device)
    sync = dm.synchronize
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": dm.get_device_name() if accel and hasattr(dm, "get_device_name") else platform.processor(),
        "backend": be.name, "torch": torch.__version__, "python": platform.python_version(),
        "magi_core": magi_core.__version__, "model": args.model, "tokens": tokens, "hidden": hidden,
    }
    with torch.no_grad():
        torch._dynamo.reset()
        resident = torch.compile(wl.fresh().to(device), dynamic=False)
        calls: dict[str, Callable[[], Any]] = {"resident_compiled": lambda r=resident: r(x)}
        models: dict[str, Any] = {}
        for key, direct in (("ratio1", True), ("ratio1_wrapped", False)):
            # every unit resident through a budget that holds them all: the units stay split (ratio 1 compiles
            # the graph whole, one unit, which would not show the per-unit overhead)
            cfg = OffloadConfig(device_memory_budget_bytes=4 * wl.weight_bytes + (1 << 30), unit_compiler="auto",
                                direct_unit_calls=direct)
            models[key] = m = magi_core.offload(wl.fresh(), cfg)
            calls[key] = lambda m=m: m(x)
            for _ in range(4):
                m(x)
            ex = magi_core.handle(m).runtime.executor
            res["units"] = ex.n_units
            res[f"{key}_direct_units"] = sum(bool(d) for d in ex.direct_units)
            res[f"{key}_loop_only_us"] = loop_only_us(ex, calls[key], sync)
            if direct:
                res["per_unit"] = per_unit_calls(ex, calls[key], sync)
                res["cprofile_ratio1_top"] = profile(calls[key], sync)
        for fn in calls.values():
            fn()
        # interleaved rounds: drift of the host (clocks, other load) hits every variant alike
        rounds: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, fn in calls.items():
                rounds[k].append(host_us(fn, sync, calls=5))
        for k, v in rounds.items():
            res[f"{k}_call_us"] = statistics.median(v)
        for key in ("ratio1", "ratio1_wrapped"):
            diffs = [a - b for a, b in zip(rounds[key], rounds["resident_compiled"], strict=True)]
            res[f"overhead_us_per_unit_{key}"] = statistics.median(diffs) / res["units"]
        for m in models.values():
            magi_core.release(m)
        del models, calls, resident
        gc.collect()
        torch._dynamo.reset()
        # everything streamed: the executor's host work per step, without the time it blocks on copies,
        # with one copy per unit into the planned device buffer (the default) and with one copy per weight
        for kind in ("unit", "per_tensor"):
            gc.collect()
            torch._dynamo.reset()
            cfg = OffloadConfig(gpu_resident_weight_ratio=0.0, unit_compiler="auto", transfer=kind)
            m = magi_core.offload(wl.fresh(), cfg)
            for _ in range(4):
                m(x)
            ex = magi_core.handle(m).runtime.executor
            pre = "ratio0" if kind == "unit" else "ratio0_per_tensor"
            res[f"{pre}_direct_units"] = sum(bool(d) for d in ex.direct_units)
            ex.measure_host_waits = True
            totals, blocked = [], []
            calls0, weights0 = ex.transfer.copy_calls, ex.transfer.copies
            for _ in range(args.rounds * 5):
                sync()
                ex.stats.host_wait_ns = 0
                t0 = time.perf_counter_ns()
                m(x)
                totals.append((time.perf_counter_ns() - t0) / 1e3)
                blocked.append(ex.stats.host_wait_ns / 1e3)
            sync()
            steps = args.rounds * 5
            res[f"{pre}_copy_calls_per_step"] = (ex.transfer.copy_calls - calls0) / steps
            res[f"{pre}_weights_per_step"] = (ex.transfer.copies - weights0) / steps
            res[f"{pre}_call_us"] = statistics.median(totals)
            res[f"{pre}_blocked_us"] = statistics.median(blocked)
            res[f"{pre}_host_work_us"] = statistics.median(t - b for t, b in zip(totals, blocked, strict=True))
            res[f"{pre}_host_work_over_resident_us_per_unit"] = (
                (res[f"{pre}_host_work_us"] - res["resident_compiled_call_us"]) / res["units"])
            magi_core.release(m)
    n = res["units"]
    res["loop_us_per_unit"] = {k: res[f"{k}_loop_only_us"] / n for k in ("ratio1", "ratio1_wrapped")}
    if res.get("per_unit"):
        c = [r["callable_us"] for r in res["per_unit"]]
        i = [r["inductor_call_us"] for r in res["per_unit"] if "inductor_call_us" in r]
        res["unit_callable_us_median"] = statistics.median(c)
        if i:
            res["unit_inductor_call_us_median"] = statistics.median(i)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: v for k, v in res.items() if k not in ("per_unit", "cprofile_ratio1_top")}
    print(json.dumps(summary, indent=1))
    print("\n".join(res.get("cprofile_ratio1_top", [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
