"""How far each way of running the demo transformer is from a float32 reference, on the active backend.

    python benchmarks/numerics.py --out benchmarks/results/numerics.json [--layers 16 --hidden 4096 --tokens 4096]

Runs the same low-precision weights and input: float32 eager (the reference: the low-precision weights upcast),
low-precision eager, the whole model compiled with Inductor (with and without ``emulate_precision_casts``),
and magi-core offloaded (Inductor units and eager units, ratios 0, 0.5 and 1). Prints and writes the norm-wise
relative error ||out - ref|| / ||ref|| of each against the float32 reference and against the compiled
resident run, so one can tell error that streaming adds from error that the dtype and the compiler add.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
from collections.abc import Callable
from typing import Any

import torch

import magi_core
from magi_core import get_backend
from magi_core.api import compile_offloaded
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.config import OffloadConfig
from magi_core.execute.unit_compile import like_with_like
from magi_core.host.materialize import materialize


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of ``out`` against ``ref`` (in float32)."""
    r = ref.float()
    return float(torch.linalg.vector_norm(out.float() - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))


def main() -> int:
    """Run every mode once (after warm-up) and write the errors."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    be = get_backend()
    accel = be.is_accelerator
    ap.add_argument("--layers", type=int, default=16 if accel else 4)
    ap.add_argument("--hidden", type=int, default=4096 if accel else 256)
    ap.add_argument("--heads", type=int, default=32 if accel else 4)
    ap.add_argument("--tokens", type=int, default=4096 if accel else 64)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = TransformerSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, dtype=dtype)
    device = be.device()
    dm = be.device_module
    x = example_input(spec, args.tokens)
    xd = x.to(device)
    outs: dict[str, torch.Tensor] = {}

    def keep(name: str, fn: Callable[[], Any], warm: int = 2) -> None:
        for _ in range(warm):
            fn()
        outs[name] = fn().detach().float().cpu()
        dm.synchronize()

    with torch.no_grad():
        m32 = build_transformer(spec).float().to(device)
        keep("fp32_eager", lambda m32=m32: m32(xd.float()), warm=0)
        del m32
        gc.collect()
        dm.empty_cache()
        m = build_transformer(spec).to(device)
        keep("eager", lambda m=m: m(xd), warm=0)
        for emulate in (False, True):
            torch._dynamo.reset()
            with like_with_like("inductor") if emulate else torch.autograd.grad_mode.no_grad():
                c = torch.compile(m, dynamic=False)
                keep(f"compiled{'_emulate' if emulate else ''}", lambda c=c: c(xd))
            del c
        del m
        torch._dynamo.reset()
        gc.collect()
        dm.empty_cache()
        host_model = build_transformer(spec)
        host = materialize(host_model)
        try:
            for compiler in ("inductor", "eager"):
                for emulate in (False, True) if compiler == "inductor" else (False,):
                    for ratio in (1.0, 0.5, 0.0):  # 1: the graph compiled whole; 0.5, 0: split into units
                        torch._dynamo.reset()
                        ctx = like_with_like(compiler) if emulate else torch.autograd.grad_mode.no_grad()
                        with ctx:
                            f = compile_offloaded(host_model, OffloadConfig(gpu_resident_weight_ratio=ratio,
                                                                            unit_compiler=compiler))
                            name = f"magi_{compiler}{'_emulate' if emulate else ''}_r{ratio:g}"
                            keep(name, lambda f=f: f(xd), warm=3)
                        del f
                        gc.collect()
                        dm.empty_cache()
        finally:
            torch._dynamo.reset()
            host.release(restore=False)
    ref = outs["fp32_eager"]
    table = {k: {"vs_fp32": rel(v, ref), "vs_compiled": rel(v, outs["compiled"]),
                 "vs_compiled_emulate": rel(v, outs["compiled_emulate"]), "vs_eager": rel(v, outs["eager"])}
             for k, v in outs.items()}
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "hardware": dm.get_device_name() if accel and hasattr(dm, "get_device_name") else platform.processor(),
           "backend": be.name, "torch": torch.__version__, "magi_core": magi_core.__version__,
           "spec": {"layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads, "tokens": args.tokens,
                    "dtype": args.dtype}, "errors": table}
    w = max(len(k) for k in table)
    print(f"{'run'.ljust(w)}  vs_fp32    vs_compiled vs_comp_emul vs_eager")
    for k, e in table.items():
        print(f"{k.ljust(w)}  {e['vs_fp32']:.3e}  {e['vs_compiled']:.3e}  {e['vs_compiled_emulate']:.3e}  "
              f"{e['vs_eager']:.3e}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
