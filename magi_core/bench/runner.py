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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import magi_core
from magi_core.bench import analysis, measure
from magi_core.bench.models import TransformerSpec
from magi_core.bench.options import BenchOptions, Sizes
from magi_core.bench.real import REAL_WORKLOADS, default_tokens, missing_library, real_workload, regime
from magi_core.bench.systems import Prepared, SystemSkipped, SystemSpec, cleanup, prepare
from magi_core.bench.workloads import MLPShape, Workload, mlp_workload, transformer_workload
from magi_core.plugin.device_limit import device_memory_from_env, limit_device_memory
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Systems whose outputs every later run is also compared with (``max_rel_err_vs``), besides the first run: an
#: offloaded run's error is judged against the compiled resident run too.
RESIDENTS = ("resident_eager", "resident_compiled")
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
    if "magi" in options.systems and options.magi_default:
        specs.append(SystemSpec("magi"))  # OffloadConfig(): the plan fits the card
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


@dataclass(frozen=True)
class Unavailable:
    """A selected model that cannot be built here (its library is missing); its runs are recorded as skipped."""

    name: str
    reason: str
    tokens: tuple[int, ...]


def workloads(options: BenchOptions, sizes: Sizes, preset: str = "full") -> Iterator[Workload | Unavailable]:
    """The selected models at ``sizes`` (built lazily, one at a time); real-library models at ``preset`` size.

    A real model's token counts are its preset's (its three regimes at full size) unless ``--tokens`` is given.
    """
    for name in options.models:
        if name == "mlp":
            yield mlp_workload(MLPShape(sizes.mlp_hidden, sizes.mlp_layers), options.torch_dtype)
        elif name == "transformer":
            yield transformer_workload(TransformerSpec(layers=sizes.tf_layers, hidden=sizes.tf_hidden,
                                                       heads=sizes.tf_heads, ffn_mult=sizes.tf_ffn_mult,
                                                       dtype=options.torch_dtype))
        elif name in REAL_WORKLOADS:
            tokens = tuple(options.tokens) if options.tokens else default_tokens(name, preset)
            why = missing_library(name)
            if why is not None:
                yield Unavailable(name, why, tokens)
                continue
            layers = {"llama8b": options.llama_layers, "wan14b": options.wan_layers,
                      "flux": options.flux_layers}[name]
            w = real_workload(name, options.torch_dtype, preset, layers)
            w.tokens = tokens
            yield w
        else:
            raise ValueError(f"unknown model {name!r}")


def token_counts(w: Workload, sizes: Sizes) -> tuple[int, ...]:
    """The token counts ``w`` runs at: its own when it has them, else the run's."""
    return w.tokens if w.tokens else sizes.tokens


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


def default_out_path(env: dict[str, Any], models: tuple[str, ...] = (), root: Path | None = None,
                     device_memory: str | None = None) -> Path:
    """``benchmarks/results/<date>-<hardware>[-<models>][-mem<cap>].json`` under ``root`` (default the working
    directory)."""
    root = root if root is not None else Path.cwd()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", env["hardware"]).strip("-").lower()[:40] or "unknown"
    suffix = "".join(f"-{m}" for m in models)
    if device_memory:
        suffix += "-mem" + (re.sub(r"[^A-Za-z0-9]+", "", device_memory.replace("%", "pct")).lower() or "cap")
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


def _record_base_named(name: str, spec: SystemSpec, tokens: int, weight_bytes: int | None = None) -> dict[str, Any]:
    budget = None
    if spec.budget_fraction is not None and weight_bytes is not None:
        budget = int(spec.budget_fraction * weight_bytes)
    return {
        "workload": name, "tokens": tokens, "system": spec.kind, "label": spec.label, "policy": spec.policy,
        "ratio": spec.ratio, "budget_fraction": spec.budget_fraction, "budget_bytes": budget,
    }


def _record_base(w: Workload, spec: SystemSpec, tokens: int) -> dict[str, Any]:
    return _record_base_named(w.name, spec, tokens, w.weight_bytes)


def _run_tokens(backend: Backend, w: Workload, p: Prepared, tokens: int, options: BenchOptions,
                reference: dict[int, dict[str, torch.Tensor]], label: str, host_timing: bool) -> dict[str, Any]:
    """Warm up, time ``options.steps`` steps at ``tokens`` and collect every per-configuration figure.

    The output compared against the reference is the call's main tensor (:func:`measure.main_tensor`: a
    ModelOutput's ``logits`` or ``sample``).
    """
    args, kwargs = w.make_inputs(tokens, backend.device())

    def call() -> Any:
        return p.fn(*args, **kwargs)

    dm = backend.device_module
    dm.synchronize()
    t0 = time.perf_counter()
    call()
    dm.synchronize()
    first_call_s = time.perf_counter() - t0
    for _ in range(max(options.warmup, p.warmup_calls) - 1):
        call()
    graphs_before = measure.dynamo_graphs()
    measure.reset_peak(backend)
    times, result = measure.time_steps(backend, call, options.steps, warmup=0)
    peak_alloc, peak_reserved = measure.peak_memory(backend)
    recompiles = measure.dynamo_graphs() - graphs_before
    out = measure.main_tensor(result)
    finite = bool(torch.isfinite(out).all())
    if not finite:
        logger.warning("%s %d tokens %s: the output holds non-finite values", w.name, tokens, label)
    refs = reference.setdefault(tokens, {})
    if not refs or label in RESIDENTS:  # the first run is the error reference; both residents are kept as well
        refs.setdefault(label, out.detach().to("cpu", copy=True))
    first_label, first = next(iter(refs.items()))
    rec: dict[str, Any] = {
        "status": "ok",
        "step_ms": times.median_ms,
        "steps_ms": [round(t, 4) for t in times.device_ms],
        "host_call_ms": (measure.host_call_ms(backend, call)
                         if p.host_timing and host_timing and options.host_timing else None),
        "host_call_backtoback_ms": times.host_median_ms,
        "peak_alloc_bytes": peak_alloc,
        "peak_reserved_bytes": peak_reserved,
        "setup_s": p.setup_s,
        "first_call_s": first_call_s,
        "recompiles": recompiles,
        "max_rel_err": measure.max_rel_error(out, first),
        "error_reference": first_label,
        "max_rel_err_vs": {ref: measure.max_rel_error(out, t) for ref, t in refs.items() if ref != label},
        "output_finite": finite,
        "weight_bytes": w.weight_bytes,
    }
    if w.flops is not None and times.median_ms > 0:
        rec["achieved_TFLOPs"] = w.flops(tokens) / (times.median_ms / 1e3) / 1e12
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


def apply_device_memory(options: BenchOptions, backend: Backend) -> dict[str, Any] | None:
    """Cap the process's device memory as ``options.device_memory`` (else ``MAGI_DEVICE_MEMORY``) asks, before
    anything is allocated; what the result document records about it (None without a cap: the device as seen).

    Raises :class:`~magi_core.errors.BackendError` where the backend cannot cap (the cpu backend).
    """
    requested = options.device_memory or device_memory_from_env()
    if requested is None:
        if not backend.is_accelerator:
            return None
        seen = backend.device_memory()
        return {"requested": None, "cap_bytes": None,
                "seen": {"free": seen.free, "total": seen.total} if seen is not None else None}
    cap = limit_device_memory(requested, backend=backend)
    seen = backend.device_memory()
    logger.info("device memory capped at %.2f GiB (%s)", cap / (1 << 30), requested)
    return {"requested": requested, "cap_bytes": cap,
            "seen": {"free": seen.free, "total": seen.total} if seen is not None else None}


def _run(options: BenchOptions, backend: Backend) -> dict[str, Any]:
    memory = apply_device_memory(options, backend)  # before the first allocation: a smaller card from the start
    cap = memory["cap_bytes"] if memory is not None else None
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
        "device_memory": memory,
    }
    # accelerate places what fits on the device: within the cap, or the whole card when asked for a device map
    seen = (memory or {}).get("seen") or {}
    accelerate_bytes = cap if cap is not None else seen.get("total") if options.accelerate_device_map else None
    specs = system_specs(options)
    budget = options.time_budget(backend.is_accelerator)
    doc["time_budget_s"] = budget
    preset = options.real_preset(backend.is_accelerator)
    deadlines = _deadlines(options, sizes, start, budget, preset)
    for w, deadline in zip(workloads(options, sizes, preset), deadlines, strict=True):
        if isinstance(w, Unavailable):
            logger.warning("%s skipped: %s", w.name, w.reason)
            doc["workloads"][w.name] = {"status": "skipped", "reason": w.reason}
            doc["runs"] += [{**_record_base_named(w.name, spec, t), "status": "skipped", "reason": w.reason}
                            for spec in specs for t in w.tokens]
            continue
        if "magi" in options.systems:
            note = shm_note(backend, w.planned_bytes())
            if note is not None:
                logger.warning("%s", note)
                doc["notes"].append(note)
        t0 = time.perf_counter()
        w.materialize_base()
        doc["workloads"][w.name] = workload_info(w, token_counts(w, sizes), time.perf_counter() - t0)
        logger.info("%s: %.3f GB of weights, %d blocks, set up in %.1f s", w.name, w.weight_bytes / 1e9,
                    len(w.block_bytes), doc["workloads"][w.name]["materialize_base_s"])
        reference: dict[int, dict[str, torch.Tensor]] = {}
        for spec in specs:
            runs = _run_system(backend, w, spec, token_counts(w, sizes), options, reference, deadline,
                               accelerate_bytes)
            doc["runs"] += [{**r, "device_cap_bytes": cap} for r in runs]
            if options.out is not None:
                write_json(analysis.finalize(doc), options.out)
        w.release()
        reference.clear()
    analysis.finalize(doc)
    if options.out is not None:
        write_json(doc, options.out)
    logger.info("magi bench finished in %.1f s", time.perf_counter() - start)
    return doc


def workload_info(w: Workload, tokens: tuple[int, ...], setup_s: float) -> dict[str, Any]:
    """What the result JSON says about a workload: shape, weight bytes (by dtype), blocks, and each token count.

    For a model with a FLOP count, each token count carries its FLOPs and the regime it makes on an H200
    (:func:`magi_core.bench.real.regime`) next to what the inputs are (e.g. the latent video shape).
    """
    by_dtype: dict[str, int] = {}
    for weight in w.base.values():
        key = str(weight.dtype)
        by_dtype[key] = by_dtype.get(key, 0) + weight.numel() * weight.element_size()
    info: dict[str, Any] = {
        "shape": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in w.shape.__dict__.items()},
        "dtype": str(w.dtype), "weight_bytes": w.weight_bytes, "weight_bytes_by_dtype": by_dtype,
        "block_bytes": w.block_bytes, "outside_block_bytes": w.outside_bytes, "materialize_base_s": setup_s,
    }
    per_token: dict[str, Any] = {}
    for t in tokens:
        entry = dict(w.describe(t)) if w.describe is not None else {}
        if w.flops is not None:
            entry.update(regime(w.flops(t), w.weight_bytes))
        if entry:
            per_token[str(t)] = entry
    if per_token:
        info["tokens"] = per_token
    return info


def _deadlines(options: BenchOptions, sizes: Sizes, start: float, budget: float | None,
               preset: str = "full") -> list[float | None]:
    """When each model's configurations stop being started: the budget split half evenly, half by weight bytes.

    The deadlines are cumulative, so time a model leaves unused goes to the next one (a skipped model weighs
    nothing).
    """
    names = list(options.models)
    if budget is None:
        return [None] * len(names)
    sizes_b = [0 if isinstance(w, Unavailable) else w.planned_bytes() for w in workloads(options, sizes, preset)]
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
                reference: dict[int, dict[str, torch.Tensor]], deadline: float | None,
                accelerate_bytes: int | None = None) -> list[dict[str, Any]]:
    """Prepare one system and run it at every token count; failures (out of device memory under a cap among them)
    are recorded, never raised."""
    records = [_record_base(w, spec, t) for t in tokens_list]
    if all(skip_reason(spec, t, tokens_list, options, deadline) for t in tokens_list):
        for r in records:
            r.update(status="skipped", reason=skip_reason(spec, r["tokens"], tokens_list, options, deadline))
        return records
    p: Prepared | None = None
    try:
        p = prepare(w, backend, spec, compile_on_cpu=options.compile_on_cpu, compile_backend=options.compile_backend,
                    accelerate_device_bytes=accelerate_bytes)
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
                r.update(status="failed", reason=failure_reason(exc))
                logger.warning("%s %d tokens %s failed: %s", w.name, r["tokens"], spec.label, r["reason"])
                measure.free_device_memory(backend)
    except SystemSkipped as exc:
        for r in records:
            r.update(status="skipped", reason=str(exc))
        logger.info("%s %s skipped: %s", w.name, spec.label, exc)
    except Exception as exc:
        for r in records:
            r.update(status="failed", reason="setup: " + failure_reason(exc))
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


def failure_reason(exc: BaseException) -> str:
    """``Type: message`` of a failed run, with the error it came from when that one says more (a module's
    ``_apply()`` failing to swap a weight because the device ran out of memory)."""
    reason = f"{type(exc).__name__}: {str(exc)[:400]}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip()[:80] not in str(exc):
        reason += f" (from {type(cause).__name__}: {str(cause)[:300]})"
    return reason


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write the result document as indented JSON (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
