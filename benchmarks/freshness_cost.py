"""Host cost of noticing weight edits between calls (``magi_core.execute.freshness.WeightWatch``), per weight.

Every call checks the weights whose device copies outlive a call (resident ones, the next call's prefetched
first ones): identity, data pointer and version counter of each, plus one gather of sampled elements per
host arena. This measures that check for N weights laid out in one arena (as ``offload`` lays them out) and
writes a JSON document with hardware and date. Small weights (4096 elements) stay in the caches between calls:
the check's own cost. ``--large-mib`` adds rows of weights that size, with the caches flushed between calls (as
between two steps of a real model): each sample is then a memory access of its own, and the gather dominates.
Target (correctness issue): <= 1 us per small weight.

    python benchmarks/freshness_cost.py --out benchmarks/results/<date>-freshness-<host>.json
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from typing import Any

import torch
from script_io import emit_json

from magi_core.execute.freshness import WeightWatch

#: Bytes written between two cold calls: larger than a server's last-level cache.
FLUSH_BYTES = 512 << 20


def measure(n_weights: int, numel: int, dtype: torch.dtype, repeats: int, cold: bool = False) -> dict[str, Any]:
    """Median ns per ``changed`` call and per weight, for ``n_weights`` unchanged weights of one arena (``cold``:
    the caches flushed before each call)."""
    item = torch.empty(0, dtype=dtype).element_size()
    arena = torch.ones(n_weights * numel * item, dtype=torch.uint8)  # written: every page is mapped
    weights = [arena[k * numel * item:(k + 1) * numel * item].view(dtype) for k in range(n_weights)]
    watch = WeightWatch(tuple(range(n_weights)))
    watch.changed(weights)
    flush = torch.zeros(FLUSH_BYTES, dtype=torch.uint8) if cold else None
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1)
            t0 = time.perf_counter_ns()
            watch.changed(weights)
            samples.append(time.perf_counter_ns() - t0)
            continue
        t0 = time.perf_counter_ns()
        for _ in range(10):
            watch.changed(weights)
        samples.append((time.perf_counter_ns() - t0) / 10)
    call = statistics.median(samples)
    return {"weights": n_weights, "numel": numel, "cold": cold, "call_us": call / 1e3,
            "us_per_weight": call / 1e3 / n_weights}


def main() -> int:
    """Measure a few model sizes and write or print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--large-mib", type=int, default=0,
                    help="also 64 and 291 weights of this many MiB each, caches flushed between calls (0: not)")
    args = ap.parse_args()
    rows = [measure(n, 4096, torch.bfloat16, args.repeats) for n in (16, 64, 291, 1024)]
    if args.large_mib:
        numel = (args.large_mib << 20) // 2
        rows += [measure(n, numel, torch.bfloat16, max(args.repeats // 5, 3), cold=True) for n in (64, 291)]
    doc = {
        "what": "WeightWatch.changed per call, unchanged weights in one arena (the steady-state cost)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": platform.processor() or platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "target_us_per_weight": 1.0, "rows": rows,
        "command": "python benchmarks/freshness_cost.py " + " ".join(sys.argv[1:]),
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
