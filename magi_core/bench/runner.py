"""Runs every selected system on every model and token count in one process and collects the JSON result."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import magi_core
from magi_core.bench import analysis, measure
from magi_core.bench.models import TransformerSpec
from magi_core.bench.options import BenchOptions, Sizes
from magi_core.bench.systems import Prepared, SystemSkipped, SystemSpec, cleanup, prepare
from magi_core.bench.workloads import MLPShape, Workload, mlp_workload, transformer_workload
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
NOT_MEANINGFUL = ("cpu backend: tiny models on the host, no accelerator; the figures exercise the harness and are "
                  "not meaningful as performance results")


def system_specs(options: BenchOptions) -> list[SystemSpec]:
    """The configurations to run, most important first (a time budget skips from the end).

    Residents first (the error reference and the ideal), then diffusers, the first magi-core policy at its
    budgets and ratios, the all-resident overhead probe, the other policies (``core`` grid: at the budgets
    only; ``full``: at every ratio and budget), and accelerate (the slowest) last.
    """
    specs: list[SystemSpec] = []
    for kind in ("resident_eager", "resident_compiled", "diffusers"):
        if kind in options.systems:
            specs.append(SystemSpec(kind))
    if "magi" in options.systems and options.policies:
        first, *others = (p.upper() for p in options.policies)
        specs += [SystemSpec("magi", policy=first, budget_fraction=b) for b in options.budgets]
        specs += [SystemSpec("magi", policy=first, ratio=r) for r in options.ratios]
        if options.overhead_probe and 1.0 not in options.ratios:
            # everything resident: no copies and no host waits, so the host call time is the executor's own cost
            specs.append(SystemSpec("magi", policy=first, ratio=1.0))
        for policy in others:
            specs += [SystemSpec("magi", policy=policy, budget_fraction=b) for b in options.budgets]
            if options.grid == "full":
                specs += [SystemSpec("magi", policy=policy, ratio=r) for r in options.ratios]
    if "accelerate" in options.systems:
        specs.append(SystemSpec("accelerate"))
    return specs


def workloads(options: BenchOptions, sizes: Sizes) -> Iterator[Workload]:
    """The selected models at ``sizes`` (built lazily, one at a time)."""
    for name in options.models:
        if name == "mlp":
            yield mlp_workload(MLPShape(sizes.mlp_hidden, sizes.mlp_layers), options.torch_dtype)
        else:
            yield transformer_workload(TransformerSpec(layers=sizes.tf_layers, hidden=sizes.tf_hidden,
                                                       heads=sizes.tf_heads, ffn_mult=sizes.tf_ffn_mult,
                                                       dtype=options.torch_dtype))


def environment(backend: Backend) -> dict[str, Any]:
    """Hardware, software versions, date and backend of this run."""
    return {
        "hardware": measure.hardware_name(backend),
        "backend": {"name": backend.name, "package": backend.package, "version": backend.version,
                    "device_type": backend.device_type, "is_accelerator": backend.is_accelerator},
        "torch": torch.__version__,
        "magi_core": magi_core.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "meaningful": backend.is_accelerator,
        "note": None if backend.is_accelerator else NOT_MEANINGFUL,
    }


def default_out_path(env: dict[str, Any], models: tuple[str, ...] = (), root: Path | None = None) -> Path:
    """``benchmarks/results/<date>-<hardware>[-<models>].json`` under ``root`` (default the working directory)."""
    root = root if root is not None else Path.cwd()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", env["hardware"]).strip("-").lower()[:40] or "unknown"
    suffix = "".join(f"-{m}" for m in models)
    return root / "benchmarks" / "results" / f"{env['date'][:10]}-{slug}{suffix}.json"


def shm_note(backend: Backend, largest_weights: int) -> str | None:
    """A warning when the shared-memory directory magi-core maps weights into cannot hold the largest model."""
    from magi_core.host.config import HostOptions

    opts = HostOptions().resolve()
    if opts.skip_shm or not backend.is_accelerator or opts.shm_dir is None:
        return None
    try:
        st = os.statvfs(opts.shm_dir)
    except OSError as exc:
        return f"cannot stat the shared-memory directory {opts.shm_dir}: {exc}"
    free = st.f_bavail * st.f_frsize
    if free >= 1.05 * largest_weights:
        return None
    return (f"{opts.shm_dir} has {free / 1e9:.2f} GB free but a model has {largest_weights / 1e9:.2f} GB of weights: "
            "magi-core configurations will fail; enlarge it (docker --shm-size) or set MAGI_SHM_DIR to a larger "
            "tmpfs")


def _record_base(w: Workload, spec: SystemSpec, tokens: int) -> dict[str, Any]:
    return {
        "workload": w.name, "tokens": tokens, "system": spec.kind, "label": spec.label, "policy": spec.policy,
        "ratio": spec.ratio, "budget_fraction": spec.budget_fraction,
        "budget_bytes": int(spec.budget_fraction * w.weight_bytes) if spec.budget_fraction is not None else None,
    }


def _run_tokens(backend: Backend, w: Workload, p: Prepared, tokens: int, options: BenchOptions,
                reference: dict[int, tuple[torch.Tensor, str]], label: str, host_timing: bool) -> dict[str, Any]:
    """Warm up, time ``options.steps`` steps at ``tokens`` and collect every per-configuration figure."""
    x = w.make_input(tokens, backend.device())
    dm = backend.device_module
    dm.synchronize()
    t0 = time.perf_counter()
    p.fn(x)
    dm.synchronize()
    first_call_s = time.perf_counter() - t0
    for _ in range(max(options.warmup, p.warmup_calls) - 1):
        p.fn(x)
    graphs_before = measure.dynamo_graphs()
    measure.reset_peak(backend)
    times, out = measure.time_steps(backend, lambda: p.fn(x), options.steps, warmup=0)
    peak_alloc, peak_reserved = measure.peak_memory(backend)
    recompiles = measure.dynamo_graphs() - graphs_before
    if tokens not in reference:
        reference[tokens] = (out.detach().to("cpu", copy=True), label)
    rec: dict[str, Any] = {
        "status": "ok",
        "step_ms": times.median_ms,
        "steps_ms": [round(t, 4) for t in times.device_ms],
        "host_call_ms": measure.host_call_ms(backend, lambda: p.fn(x)) if p.host_timing and host_timing else None,
        "host_call_backtoback_ms": times.host_median_ms,
        "peak_alloc_bytes": peak_alloc,
        "peak_reserved_bytes": peak_reserved,
        "setup_s": p.setup_s,
        "first_call_s": first_call_s,
        "recompiles": recompiles,
        "max_rel_err": measure.max_rel_error(out, reference[tokens][0]),
        "error_reference": reference[tokens][1],
        "weight_bytes": w.weight_bytes,
    }
    rec.update({k: v for k, v in p.info.items()})
    rec.update({k: v for k, v in p.stats().items() if v is not None})
    return rec


def run_benchmark(options: BenchOptions, backend: Backend | None = None) -> dict[str, Any]:
    """Run the whole benchmark and return the result document (also written to ``options.out`` when set)."""
    backend = backend if backend is not None else get_backend()
    threads = torch.get_num_threads()
    if not backend.is_accelerator:
        torch.set_num_threads(1)  # tiny host models: more threads only add OpenMP barrier waits
    try:
        return _run(options, backend)
    finally:
        torch.set_num_threads(threads)


def _run(options: BenchOptions, backend: Backend) -> dict[str, Any]:
    env = environment(backend)
    sizes = options.sizes(backend.is_accelerator)
    start = time.perf_counter()
    logger.info("magi bench on %s (%s backend)%s", env["hardware"], backend.name,
                "" if backend.is_accelerator else " - " + NOT_MEANINGFUL)
    h2d, h2d_method = measure.measure_h2d_gbps(backend, options.h2d_probe_bytes(backend.is_accelerator))
    logger.info("pinned H2D bandwidth: %.2f GB/s (%s)", h2d, h2d_method)
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "env": env, "options": options.as_json(), "sizes": sizes.__dict__,
        "h2d_GBps": h2d, "h2d_probe_bytes": options.h2d_probe_bytes(backend.is_accelerator), "h2d_method": h2d_method,
        "host_call_method": measure.HOST_CALL_METHOD, "workloads": {}, "runs": [], "notes": [],
    }
    specs = system_specs(options)
    budget = options.time_budget(backend.is_accelerator)
    doc["time_budget_s"] = budget
    deadlines = _deadlines(options, sizes, start, budget)
    for w, deadline in zip(workloads(options, sizes), deadlines, strict=True):
        if "magi" in options.systems:
            with torch.device("meta"):
                note = shm_note(backend, sum(p.numel() * p.element_size() for p in w.build().parameters()))
            if note is not None:
                logger.warning("%s", note)
                doc["notes"].append(note)
        t0 = time.perf_counter()
        w.materialize_base()
        doc["workloads"][w.name] = {
            "shape": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in w.shape.__dict__.items()},
            "dtype": str(options.torch_dtype), "weight_bytes": w.weight_bytes, "block_bytes": w.block_bytes,
            "materialize_base_s": time.perf_counter() - t0,
        }
        logger.info("%s: %.3f GB of weights, %d blocks", w.name, w.weight_bytes / 1e9, len(w.block_bytes))
        reference: dict[int, tuple[torch.Tensor, str]] = {}
        for spec in specs:
            doc["runs"] += _run_system(backend, w, spec, sizes.tokens, options, reference, deadline)
            if options.out is not None:
                write_json(analysis.finalize(doc), options.out)
        w.release()
        reference.clear()
    analysis.finalize(doc)
    if options.out is not None:
        write_json(doc, options.out)
    logger.info("magi bench finished in %.1f s", time.perf_counter() - start)
    return doc


def _deadlines(options: BenchOptions, sizes: Sizes, start: float, budget: float | None) -> list[float | None]:
    """When each model's configurations stop being started: the budget split half evenly, half by weight bytes.

    The deadlines are cumulative, so time a model leaves unused goes to the next one.
    """
    names = list(options.models)
    if budget is None:
        return [None] * len(names)
    sizes_b = []
    for w in workloads(options, sizes):
        with torch.device("meta"):
            sizes_b.append(sum(p.numel() * p.element_size() for p in w.build().parameters()))
    total = sum(sizes_b) or 1
    out: list[float | None] = []
    acc = 0.0
    for b in sizes_b:
        acc += 0.5 / len(names) + 0.5 * b / total
        out.append(start + budget * acc)
    return out


def skip_reason(spec: SystemSpec, tokens: int, tokens_list: tuple[int, ...], options: BenchOptions,
                 deadline: float | None) -> str | None:
    """Why this configuration is not run at ``tokens`` (time budget, accelerate at one token count), or None."""
    if deadline is not None and time.perf_counter() > deadline:
        return "time budget spent (--time-budget; 0 for no limit)"
    if spec.kind == "accelerate" and not options.accelerate_all_tokens and tokens != min(tokens_list):
        return "accelerate runs at the smallest token count only (--accelerate-all-tokens for every count)"
    return None


def _run_system(backend: Backend, w: Workload, spec: SystemSpec, tokens_list: tuple[int, ...], options: BenchOptions,
                reference: dict[int, tuple[torch.Tensor, str]], deadline: float | None) -> list[dict[str, Any]]:
    """Prepare one system and run it at every token count; failures are recorded, never raised."""
    records = [_record_base(w, spec, t) for t in tokens_list]
    if all(skip_reason(spec, t, tokens_list, options, deadline) for t in tokens_list):
        for r in records:
            r.update(status="skipped", reason=skip_reason(spec, r["tokens"], tokens_list, options, deadline))
        return records
    p: Prepared | None = None
    try:
        p = prepare(w, backend, spec, compile_on_cpu=options.compile_on_cpu)
        for r in records:
            why = skip_reason(spec, r["tokens"], tokens_list, options, deadline)
            if why is not None:
                r.update(status="skipped", reason=why)
                continue
            try:
                # host timing (idle-device calls) at the smallest token count only: launch cost does not grow with it
                r.update(_run_tokens(backend, w, p, r["tokens"], options, reference, spec.label,
                                     host_timing=r["tokens"] == min(tokens_list)))
                logger.info("%-12s %6d tok  %-34s %9.3f ms", w.name, r["tokens"], spec.label, r["step_ms"])
            except Exception as exc:  # OOM and friends: record and continue with the next configuration
                r.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
                logger.warning("%s %d tokens %s failed: %s", w.name, r["tokens"], spec.label, r["reason"])
                measure.free_device_memory(backend)
    except SystemSkipped as exc:
        for r in records:
            r.update(status="skipped", reason=str(exc))
        logger.info("%s %s skipped: %s", w.name, spec.label, exc)
    except Exception as exc:
        for r in records:
            r.update(status="failed", reason=f"setup: {type(exc).__name__}: {str(exc)[:400]}")
        logger.warning("%s %s setup failed: %s", w.name, spec.label, exc)
    finally:
        if p is not None:
            try:
                backend.device_module.synchronize()
                p.close()
            except Exception as exc:
                logger.warning("%s %s teardown failed: %s", w.name, spec.label, exc)
        del p
        cleanup(backend)
    return records


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write the result document as indented JSON (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
