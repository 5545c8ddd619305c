"""Time to first step and host memory when a checkpoint is loaded for offloaded inference: magi-core against the
loaders users would otherwise reach for, each system in a process of its own.

    python benchmarks/first_step_vs_peers.py --model wan14b --tokens 2184 --dir /var/tmp/wan-ckpt --out out.json

``--model wan14b`` (diffusers ``WanTransformer3DModel``) or ``llama8b`` (transformers ``LlamaForCausalLM``), the
bench's real workloads (``--layers`` blocks; full size in bf16 on an accelerator, tiny in float32 on the host).
The checkpoint is written once into ``--dir`` with the library's own ``save_pretrained`` (random weights), then
read from the page cache (warmed first) by:

``magi``        the model built on the meta device, ``magi_core.load(model, dir)`` (straight into the shared
                host arena, pinned), ``OffloadConfig(gpu_resident_weight_ratio=0)``
``diffusers``   (wan14b) ``from_pretrained(dir, torch_dtype=...)`` then ``enable_group_offload`` at block level,
                one block per group, with a copy stream on an accelerator
``accelerate``  ``init_empty_weights`` + ``load_checkpoint_and_dispatch`` with every weight on the CPU and the
                accelerator as execution device (its CPU offload)

For each: seconds to the first step's output (load, set-up, compilation where there is one), the second step,
the process's peak resident memory (VmHWM), the peak anonymous memory sampled every 10 ms, and the bytes in
shared memory (magi's arena). One JSON document with hardware, versions and date; nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from script_io import AnonPeak, emit_json

from magi_core.host.memstat import peak_rss_bytes

SYSTEMS = ("magi", "diffusers", "accelerate")


def _workload(args: argparse.Namespace) -> Any:
    from magi_core import get_backend
    from magi_core.bench.real import real_workload

    accel = get_backend().is_accelerator
    return real_workload(args.model, torch.bfloat16 if accel else torch.float32, "full" if accel else "tiny",
                         args.layers)


def write_checkpoint(args: argparse.Namespace) -> int:
    """Save the workload's model with its library's ``save_pretrained`` into ``args.dir``; its bytes on disk."""
    wl = _workload(args)
    model = wl.fresh()
    model.save_pretrained(args.dir, safe_serialization=True)
    wl.release()
    return sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))


def _meta_model(wl: Any) -> torch.nn.Module:
    """The workload's model on the meta device, each parameter in the dtype ``from_pretrained`` would give it."""
    with torch.device("meta"):
        model = wl.build()
    for name, p in model.named_parameters():
        p.data = p.data.to(wl.dtype_of(name))
    return model.eval()


def _load(system: str, args: argparse.Namespace, wl: Any, backend: Any) -> torch.nn.Module:
    """The model loaded from ``args.dir`` and set up for offloaded inference the way ``system`` does it."""
    import magi_core

    device = backend.device()
    if system == "magi":
        return magi_core.load(_meta_model(wl), args.dir, magi_core.OffloadConfig(gpu_resident_weight_ratio=0.0))
    if system == "diffusers":
        if args.model != "wan14b":
            raise SystemExit("diffusers loads diffusers models: use --model wan14b")
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel.from_pretrained(args.dir, torch_dtype=wl.dtype).eval()
        stream = backend.is_accelerator
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=stream,
                                   record_stream=stream)
        return model
    if system == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = wl.build()
        index = sorted(Path(args.dir).glob("*.safetensors.index.json"))
        shards = sorted(Path(args.dir).glob("*.safetensors"))
        ckpt = str(index[0] if index else shards[0])  # accelerate finds only transformers' file names in a folder
        model = load_checkpoint_and_dispatch(model, ckpt, device_map={"": "cpu"}, dtype=wl.dtype).eval()
        if backend.is_accelerator:
            from accelerate import cpu_offload

            cpu_offload(model, execution_device=device)
        return model
    raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def run_system(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """One system: load from ``args.dir``, two steps; its timings and memory."""
    import magi_core

    backend = magi_core.get_backend()
    dm = backend.device_module
    wl = _workload(args)
    call_args, call_kwargs = wl.make_inputs(args.tokens, backend.device())
    steps = []
    with AnonPeak() as anon:
        t0 = time.perf_counter()
        model = _load(system, args, wl, backend)
        loaded = time.perf_counter() - t0
        with torch.no_grad():
            for _ in range(2):
                s = time.perf_counter()
                out = model(*call_args, **call_kwargs)
                dm.synchronize()
                steps.append(time.perf_counter() - s)
        first = time.perf_counter() - t0
    out = out[0] if isinstance(out, tuple) else getattr(out, "sample", getattr(out, "logits", out))
    if args.output is not None:
        torch.save(out.detach().float().cpu(), args.output)
    host = magi_core.handle(model).host if system == "magi" else None
    shm = int(host.weight_bytes) if host is not None else 0
    cache = magi_core.handle(model).runtime.executor.compiled_units if system == "magi" else None
    compiles = {"compiled": cache.compiles, "reused": cache.reused} if cache is not None else None
    return {"system": system, "seconds_to_loaded": loaded, "seconds_to_first_output": loaded + steps[0],
            "first_step_s": steps[0], "second_step_s": steps[1], "wall_s": first,
            "peak_rss_bytes": peak_rss_bytes(), "anon_peak_extra_bytes": anon.extra,
            "shm_weight_bytes": shm, "unit_compiles": compiles,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main() -> int:
    """Write the checkpoint if needed, run each system in a fresh process, print or write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan14b", choices=("wan14b", "llama8b"))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="default: the workload's smallest token count")
    ap.add_argument("--dir", required=True, help="checkpoint directory (written there when it holds none)")
    ap.add_argument("--systems", default=None, help="comma list (default: magi and the model's peers)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-timeout", type=float, default=None,
                    help="seconds one system may take (it is then reported as timed out and the next one runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tokens is None:
        args.tokens = min(_workload(args).tokens)
    if args.worker is not None:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
        print(json.dumps(run_system(args.worker, args)))
        return 0
    os.makedirs(args.dir, exist_ok=True)
    written = None
    if not list(Path(args.dir).glob("*.safetensors")):
        t0 = time.perf_counter()
        write_checkpoint(args)
        written = time.perf_counter() - t0
        print(f"checkpoint written in {written:.1f} s", file=sys.stderr, flush=True)
    files = sorted(Path(args.dir).glob("*.safetensors"))
    for f in files:  # warm the page cache: every system then reads the same hot files
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    default = ("magi", "diffusers", "accelerate") if args.model == "wan14b" else ("magi", "accelerate")
    systems = args.systems.split(",") if args.systems else list(default)
    rows = []
    outputs: dict[str, torch.Tensor] = {}
    for system in systems:
        out_file = os.path.join(args.dir, f".first-step-{system}.pt")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--model", args.model,
               "--dir", args.dir, "--tokens", str(args.tokens), "--output", out_file]
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            rows.append({"system": system, "status": "timed out", "reason": f"--worker-timeout {args.worker_timeout} s",
                         "log_tail": err.strip()[-1500:]})  # where it was (the worker logs at INFO)
            _save(_doc(args, files, rows, written), args.out)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            rows.append({"system": system, "status": "failed", "reason": proc.stderr.strip()[-800:]})
            _save(_doc(args, files, rows, written), args.out)
            continue
        row = {**json.loads(lines[-1]), "status": "ok"}
        outputs[system] = torch.load(out_file)
        os.unlink(out_file)
        if systems[0] in outputs:  # the first system's output is the reference (when it ran)
            ref = outputs[systems[0]]
            row["max_rel_err_vs_" + systems[0]] = float((outputs[system] - ref).abs().max() / ref.abs().max())
        rows.append(row)
        print(f"{system}: first output after {row['seconds_to_first_output']:.1f} s", file=sys.stderr, flush=True)
        _save(_doc(args, files, rows, written), args.out)  # after each system: a cut-off run keeps what ran
    emit_json(_doc(args, files, rows, written), args.out)
    return 0


def _save(doc: dict[str, Any], path: str | None) -> None:
    """Write ``doc`` to ``path`` (when given) without printing it."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _doc(args: argparse.Namespace, files: list[Path], rows: list[dict[str, Any]], written: float | None
         ) -> dict[str, Any]:
    """The result document for the systems run so far."""
    import magi_core
    from magi_core.bench.measure import cpu_name

    backend = magi_core.get_backend()
    dm = backend.device_module
    accel = backend.is_accelerator
    doc = {
        "what": "time to first step and host memory: magi_core.load against the peers' loaders, one process each",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": dm.get_device_name() if accel and hasattr(dm, "get_device_name") else cpu_name(),
        "cpu": cpu_name(), "torch": torch.__version__, "python": platform.python_version(),
        "magi_core": magi_core.__version__, "model": args.model, "layers": args.layers, "tokens": args.tokens,
        "checkpoint_bytes": sum(f.stat().st_size for f in files), "checkpoint_write_s": written,
        "meaningful": accel, "command": " ".join(["python", "benchmarks/first_step_vs_peers.py", *sys.argv[1:]]),
        "rows": rows,
    }
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
