"""Dump what the planner saw under a half-weights budget: unit profiles, weights per unit, plan, copy buffer.

    python benchmarks/budget_fit_probe.py --policies HEURISTIC --out budget-probe.json

Builds Wan2.1-14B's 20-block bench workload (``magi_core.bench.real``), offloads it with
``device_memory_budget_bytes = 0.5 x weights``, runs the warm-up and two planned calls at each token count in
one handle (the runtimes share the budget), and writes per runtime the profiles, each unit's weights (input
index, bytes), the bandwidth, the installed plan's resident units and notes, and the copy buffer's bytes, so a
planning decision can be replayed on a CPU (tests/plan/test_schedulers.py's Wan case came from it).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import torch

import magi_core
from magi_core import OffloadConfig, Policy, handle, offload
from magi_core.bench.real import real_workload


def main() -> None:
    """Run the probe and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="HEURISTIC", help="comma list of policies")
    parser.add_argument("--preset", default="full", choices=("full", "quick", "tiny"))
    parser.add_argument("--budget", type=float, default=0.5, help="budget as a fraction of the weight bytes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log = logging.getLogger("budget_fit_probe")
    w = real_workload("wan14b", torch.bfloat16, args.preset)
    w.materialize_base()
    backend = magi_core.get_backend()
    dev = backend.device()
    tokens = w.tokens[::2] if w.tokens and len(w.tokens) > 2 else w.tokens or ()
    res: dict[str, Any] = {}
    for pol in args.policies.split(","):
        cfg = OffloadConfig(policy=Policy[pol], device_memory_budget_bytes=int(args.budget * w.weight_bytes))
        torch._dynamo.reset()
        m = offload(w.fresh(), cfg, dynamic=False)
        for n in tokens:
            a, k = w.make_inputs(n, dev)
            with torch.no_grad():
                for _ in range(cfg.warmup_calls + 2):
                    m(*a, **k)
            backend.device_module.synchronize()
            rt = handle(m).runtimes[-1]
            ex = rt.executor
            assert rt.profiles is not None and rt.plan is not None
            res[f"{pol}-{n}"] = {
                "profiles": [[p.index, p.weight_bytes, p.compute_ms, p.last_use] for p in rt.profiles],
                "units": [[[s.input_index, s.nbytes] for s in u.weights] for u in ex.units],
                "bandwidth_Bps": rt.bandwidth_Bps, "resident": sorted(rt.plan.resident),
                "buffer": getattr(ex.transfer, "buffer_bytes", None), "budget": cfg.device_memory_budget_bytes,
                "notes": {key: v for key, v in rt.plan.notes.items() if isinstance(v, int | float | str)},
            }
            got = res[f"{pol}-{n}"]
            log.info("%s %d tokens: resident units %s, copy buffer %s bytes", pol, n, got["resident"], got["buffer"])
        magi_core.release(m)
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
