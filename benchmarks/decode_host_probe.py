"""Where a decode step's host time goes: ``generate`` of a few-layer llama8b on the active backend, per system.

    python benchmarks/decode_host_probe.py --layers 4 --out decode-host.json

For each system (eager resident, compiled resident, magi-core at ratio 0 and 1) one timed greedy ``generate`` with a
DynamicCache: the host time inside each decode forward (device synchronised before each token), the device time of a
step, and a cProfile of the timed call (top functions by own and by cumulative time). Diagnostics only: no target is
asserted here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

import torch

from magi_core import get_backend
from magi_core.bench.generate.options import GenerateOptions
from magi_core.bench.generate.prepare import prepare, quiet_generation
from magi_core.bench.generate.run import prompt
from magi_core.bench.generate.timing import generate, timed_generate
from magi_core.bench.real import real_workload
from magi_core.bench.systems import SystemSpec


def profile_text(prof: cProfile.Profile, key: str, lines: int) -> str:
    """The top ``lines`` functions of ``prof`` sorted by ``key``."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(lines)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--systems", default="resident_eager,resident_compiled,magi:0,magi:1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    backend = get_backend()
    w = real_workload("llama8b", torch.bfloat16, "full", layers=args.layers)
    options = GenerateOptions(models=("llama8b",), new_tokens=args.new_tokens, warmup=2)
    rows: list[dict[str, Any]] = []
    for name in args.systems.split(","):
        kind, _, ratio = name.partition(":")
        spec = SystemSpec(kind, policy="HEURISTIC" if kind == "magi" else None,
                          ratio=float(ratio) if ratio else None)
        p = prepare(w, backend, spec, options)
        quiet_generation(p.model)
        ids, mask = prompt(int(w.shape.vocab), 1, args.prompt_tokens, backend.device())
        for _ in range(max(p.warmups, 3)):
            generate(p.model, ids, mask, args.new_tokens, "dynamic")
        sync = backend.device_module.synchronize
        t = timed_generate(p.model, ids, mask, args.new_tokens, "dynamic", sync)
        prof = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        prof.enable()
        generate(p.model, ids, mask, args.new_tokens, "dynamic")
        prof.disable()
        sync()
        rows.append({"system": name, "decode_ms_per_token": t.decode_median_ms,
                     "decode_host_ms": t.decode_host_ms()[0],
                     "forward_host_ms": [round(x, 3) for x in t.forward_host_ms],
                     "profiled_generate_ms": (time.perf_counter() - t0) * 1e3,
                     "tottime": profile_text(prof, "tottime", 30), "cumulative": profile_text(prof, "cumulative", 45)})
        print(name, rows[-1]["decode_ms_per_token"], rows[-1]["decode_host_ms"], flush=True)
        p.close()
        del p
    doc = {"hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "layers": args.layers, "prompt_tokens": args.prompt_tokens, "rows": rows,
           "median_host_ms": {r["system"]: statistics.median(r["forward_host_ms"][1:]) for r in rows}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
