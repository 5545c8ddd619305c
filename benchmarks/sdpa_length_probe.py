"""Host time of one decode-shaped ``scaled_dot_product_attention`` call at each new key length, per kernel choice.

    python benchmarks/sdpa_length_probe.py --out sdpa-lengths.json

A query of one token against keys of a length that grows by one per call (a KV cache in ``generate``), with the
default kernels and with cuDNN excluded: a kernel that builds a plan per shape pays it on every new length.
Diagnostics only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from magi_core import get_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    backend = get_backend()
    dev, sync = backend.device(), backend.device_module.synchronize
    kinds = {"default": None,
             "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}
    rows = {}
    for offset, (name, kernels) in enumerate(kinds.items()):
        q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
        times_new, times_seen = [], []
        for i in range(args.steps):
            n = args.start + offset * 1000 + i  # lengths neither run has seen
            k = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
            for out in (times_new, times_seen):  # the first call at this length, then the same length again
                sync()
                t0 = time.perf_counter()
                if kernels is None:
                    torch.nn.functional.scaled_dot_product_attention(q, k, k)
                else:
                    with sdpa_kernel(kernels):
                        torch.nn.functional.scaled_dot_product_attention(q, k, k)
                sync()
                out.append((time.perf_counter() - t0) * 1e3)
        rows[name] = {"new_length_ms": statistics.median(times_new), "seen_length_ms": statistics.median(times_seen),
                      "new_all_ms": [round(t, 3) for t in times_new]}
        print(name, rows[name]["new_length_ms"], rows[name]["seen_length_ms"], flush=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
