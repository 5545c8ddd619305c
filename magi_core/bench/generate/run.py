"""Runs the generate systems in this process: warm-up ``generate`` calls, then one timed, and a row of figures each.

A row holds the prefill and decode times (:mod:`.timing`), the bytes a decode step streams and what stays resident,
peak device memory (allocated and reserved, over the timed ``generate``) next to what magi-core's plans predicted,
the graphs compiled, the host time inside each decode forward, and the new token ids (compared across systems by
:mod:`.derive`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from magi_core.api import handle
from magi_core.bench import measure
from magi_core.bench.generate.derive import derive
from magi_core.bench.generate.options import GenerateOptions, generate_specs
from magi_core.bench.generate.prepare import GenerateModel, prepare
from magi_core.bench.generate.timing import GenerateTiming, generate, timed_generate
from magi_core.bench.real import missing_library, real_workload
from magi_core.bench.runner import environment, failure_reason
from magi_core.bench.systems import SystemSkipped, SystemSpec, cleanup
from magi_core.bench.workloads import Workload
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Seed of the prompts' token ids (the same prompt in every process).
PROMPT_SEED = 1234


def versions() -> dict[str, str | None]:
    """Versions of the libraries the systems come from."""
    out: dict[str, str | None] = {}
    for name in ("transformers", "accelerate"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def prompt(vocab: int, batch: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic prompt ids ``(batch, tokens)`` and an all-ones attention mask, on ``device``."""
    gen = torch.Generator().manual_seed(PROMPT_SEED + tokens)
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen)
    return ids.to(device), torch.ones_like(ids).to(device)


def record_base(model: str, spec: SystemSpec, weight_bytes: int | None, options: GenerateOptions,
                prompt_tokens: int) -> dict[str, Any]:
    """The fields every row has, run or not."""
    return {"workload": model, "system": spec.kind, "label": spec.label, "policy": spec.policy, "ratio": spec.ratio,
            "budget_fraction": spec.budget_fraction,
            "budget_bytes": (int(spec.budget_fraction * weight_bytes)
                             if spec.budget_fraction is not None and weight_bytes else None),
            "prompt_tokens": prompt_tokens, "new_tokens": options.new_tokens, "batch": options.batch,
            "cache": options.cache}


class MagiWatch:
    """magi-core's runtimes across the timed ``generate``: which graph ran the decode steps, what it streamed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.h = handle(model)
        self.before = {id(r): (int(r.executor.stats.steps), int(r.executor.transfer.bytes_copied))
                       for r in self.h.runtimes}
        self.compiles_before = self.h.compile_count
        for r in self.h.runtimes:
            r.executor.measure_host_waits = True
            r.executor.stats.host_wait_ns = 0

    def waits_ns(self) -> int:
        """ns every runtime of the model blocked on its host-lead limit so far."""
        return sum(int(r.executor.stats.host_wait_ns) for r in self.h.runtimes)

    def figures(self) -> dict[str, Any]:
        """The decode graph (the runtime that ran the most steps in the timed ``generate``) and every graph's plan."""
        live = self.h.runtimes
        for r in live:
            r.executor.measure_host_waits = False
        stats = self.h.stats()
        ran = [(int(r.executor.stats.steps) - self.before.get(id(r), (0, 0))[0],
                int(r.executor.transfer.bytes_copied) - self.before.get(id(r), (0, 0))[1], i)
               for i, r in enumerate(live)]
        steps, copied, index = max(ran)
        decode = stats[index]
        out: dict[str, Any] = {
            "compiles": self.h.compile_count, "compiles_timed": self.h.compile_count - self.compiles_before,
            "graphs": [s.to_dict() for s in stats], "decode_graph": index, "units": decode.units,
            "streamed_bytes_per_token": decode.streamed_bytes_per_step, "resident_bytes": decode.resident_bytes,
            "measured_streamed_bytes_per_token": copied / steps if steps else None,
            "plan_policy": decode.policy, "predicted_step_ms": decode.predicted_step_ms,
            "runtime_bandwidth_GBps": decode.bandwidth_GBps,
            "predicted_peak_bytes": max((s.predicted_peak_bytes or 0 for s in stats), default=0) or None,
            "measured_peak_bytes": max((s.measured_peak_bytes or 0 for s in stats), default=0) or None,
            "device_budget_bytes": decode.device_budget_bytes,
        }
        return out


@contextlib.contextmanager
def attention_kernels(options: GenerateOptions) -> Iterator[None]:
    """Inside: ``scaled_dot_product_attention`` without cuDNN unless ``options.cudnn_attention`` (see there)."""
    if options.cudnn_attention:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


def run_system(backend: Backend, w: Workload, spec: SystemSpec, options: GenerateOptions, vocab: int,
               prompt_tokens: int) -> dict[str, Any]:
    """Prepare ``spec``, warm it up and time one ``generate``; the row (failures recorded, never raised)."""
    with attention_kernels(options):
        return _run_system(backend, w, spec, options, vocab, prompt_tokens)


def _run_system(backend: Backend, w: Workload, spec: SystemSpec, options: GenerateOptions, vocab: int,
                prompt_tokens: int) -> dict[str, Any]:
    row = record_base(w.name, spec, w.weight_bytes, options, prompt_tokens)
    p: GenerateModel | None = None
    dm = backend.device_module
    try:
        graphs0 = measure.dynamo_graphs()
        p = prepare(w, backend, spec, options)
        ids, mask = prompt(vocab, options.batch, prompt_tokens, backend.device())
        t0 = time.perf_counter()
        for _ in range(p.warmups):
            generate(p.model, ids, mask, options.warmup_new_tokens() if spec.kind != "accelerate" else 2,
                     options.cache)
        dm.synchronize()
        warmup_s = time.perf_counter() - t0
        watch = MagiWatch(p.model) if p.offloaded else None
        graphs1 = measure.dynamo_graphs()
        extra = {"max_time": options.accelerate_max_time} if spec.kind == "accelerate" else {}
        measure.reset_peak(backend)
        timing = timed_generate(p.model, ids, mask, options.new_tokens, options.cache, dm.synchronize,
                                watch.waits_ns if watch is not None else None,
                                step_synchronize=lambda: dm.current_stream().synchronize(), **extra)
        peak_alloc, peak_reserved = measure.peak_memory(backend)
        row.update(status="ok", **timing_fields(timing, options.batch), setup_s=p.setup_s, warmup_s=warmup_s,
                   warmup_generates=p.warmups, peak_alloc_bytes=peak_alloc, peak_reserved_bytes=peak_reserved,
                   weight_bytes=w.weight_bytes, dynamo_graphs=graphs1 - graphs0,
                   recompiles_timed=measure.dynamo_graphs() - graphs1)
        row.update(p.info)
        if watch is not None:
            row.update(watch.figures())
        else:
            row["streamed_bytes_per_token"] = row.pop("streamed_bytes", 0)
            row["compiles"] = graphs1 - graphs0  # Dynamo graphs: the compiled resident's, none for the others
        host, blocked = timing.decode_host_ms()
        row["decode_host_ms"] = host
        if watch is not None and host is not None and row.get("units"):
            row["decode_host_blocked_ms"] = blocked
            row["decode_host_work_ms"] = host - (blocked or 0.0)
            row["host_us_per_unit"] = row["decode_host_work_ms"] * 1e3 / row["units"]
        logger.info("%-34s prefill %9.2f ms, decode %9.3f ms/token, %8.1f tokens/s", spec.label, row["prefill_ms"],
                    row["decode_ms_per_token"] or float("nan"), row["decode_tokens_per_s"] or float("nan"))
    except SystemSkipped as exc:
        row.update(status="skipped", reason=str(exc))
        logger.info("%s skipped: %s", spec.label, exc)
    except Exception as exc:  # out of device memory and friends: a failed row, the next system still runs
        row.update(status="failed", reason=failure_reason(exc))
        logger.warning("%s failed: %s", spec.label, row["reason"])
    finally:
        if p is not None:
            try:
                dm.synchronize()
                p.close()
            except Exception as exc:
                logger.warning("%s teardown failed: %s", spec.label, exc)
        del p
        cleanup(backend)
    return row


def timing_fields(t: GenerateTiming, batch: int) -> dict[str, Any]:
    """Row fields of one timed ``generate``: prefill, decode per token, tokens per second, the new tokens."""
    decode = t.decode_median_ms
    generated = len(t.tokens[0]) if t.tokens else 0
    return {
        "prefill_ms": t.prefill_ms, "decode_ms_per_token": decode,
        "decode_steps_ms": [round(x, 4) for x in t.decode_ms],
        "decode_tokens_per_s": batch * 1e3 / decode if decode else None,
        "generate_ms": t.total_ms, "new_tokens_generated": generated,
        "e2e_tokens_per_s": batch * generated * 1e3 / t.total_ms if t.total_ms > 0 else None,
        "tokens": t.tokens,
    }


def run_in_process(options: GenerateOptions, backend: Backend,
                   specs: list[SystemSpec] | None = None) -> dict[str, Any]:
    """Run ``specs`` (default: every selected system) one after the other in this process; the result document."""
    specs = specs if specs is not None else generate_specs(options)
    start = time.perf_counter()
    env = {**environment(backend), **versions()}
    preset = "tiny" if not backend.is_accelerator else "quick" if options.quick else "full"
    prompt_tokens = options.prompt_length(backend.is_accelerator)
    probe = options.probe_bytes or ((1 << 30) if backend.is_accelerator else (16 << 20))
    h2d, method = measure.measure_h2d_gbps(backend, probe)
    logger.info("pinned H2D bandwidth: %.2f GB/s (%s)", h2d, method)
    doc: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": "generate", "env": env, "options": options.as_json(),
                           "commands": [], "rows": []}
    for name in options.models:
        why = missing_library(name)
        if why is not None:
            doc["rows"] += [{**record_base(name, s, None, options, prompt_tokens), "status": "skipped", "reason": why}
                            for s in specs]
            continue
        w = real_workload(name, options_dtype(options), preset, options.llama_layers)
        w.materialize_base()
        vocab = int(w.shape.vocab)
        for spec in specs:
            budget = options.time_budget_s
            if budget and time.perf_counter() - start > budget:
                row = {**record_base(name, spec, w.weight_bytes, options, prompt_tokens), "status": "skipped",
                       "reason": "time budget spent (--time-budget; 0 for no limit)"}
            else:
                row = run_system(backend, w, spec, options, vocab, prompt_tokens)
            row.update(h2d_GBps=h2d, h2d_method=method, h2d_probe_bytes=probe)
            doc["rows"].append(row)
        w.release()
    derive(doc)
    return doc


def options_dtype(options: GenerateOptions) -> torch.dtype:
    """The models' torch dtype."""
    from magi_core.bench.options import DTYPES

    return DTYPES[options.dtype]
