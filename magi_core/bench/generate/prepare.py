"""Each system as a model that ``generate``\\ s: resident (eager or ``torch.compile``'d forward), magi-core offloaded,
accelerate's device map with the rest offloaded to the host.

The bench's :mod:`~magi_core.bench.systems` prepares a callable for one forward; ``generate`` needs the model itself,
with its forward replaced where the system compiles it, so the same fresh copies are prepared here as models.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from magi_core.api import offload, release
from magi_core.bench.generate.options import GenerateOptions
from magi_core.bench.systems import (
    SystemSkipped,
    SystemSpec,
    _magi_config,
    _reset_dynamo,
    dispatch_accelerate,
    magi_static_info,
)
from magi_core.bench.workloads import Workload
from magi_core.plugin.facade import Backend

#: Host memory accelerate may fill beyond the weights it offloads there (its ``max_memory["cpu"]``).
HOST_SLACK_BYTES = 1 << 30


@dataclass
class GenerateModel:
    """A model ready to ``generate`` on the active backend, how long it took, and how to tear it down."""

    model: nn.Module
    setup_s: float
    warmups: int
    """Warm-up ``generate`` calls before the timed one."""
    info: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    offloaded: bool = False
    """magi-core: the model has a handle with runtimes and statistics."""


def quiet_generation(model: nn.Module) -> None:
    """Generate exactly the tokens asked for, greedily: no end-of-sequence token (random weights would stop at it
    sometimes), padding id 0, the KV cache on, and never transformers' own ``torch.compile`` of the forward (it
    compiles a static cache's decode by itself on CUDA; each system here compiles as it does, or not at all)."""
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        raise SystemSkipped(f"{type(model).__name__} has no generation_config: it does not generate")
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    cfg.do_sample = False
    cfg.use_cache = True
    if hasattr(cfg, "disable_compile"):
        cfg.disable_compile = True


def prepare_resident(workload: Workload, backend: Backend, compiled: bool, options: GenerateOptions) -> GenerateModel:
    """The whole model on the device; ``compiled``: its forward through ``torch.compile`` (default dynamic shapes:
    the decode graph turns dynamic in the KV length at its second length, as magi-core's)."""
    if compiled and not backend.is_accelerator and not options.compile_on_cpu:
        raise SystemSkipped("Inductor compile skipped on the cpu backend (pass --compile-on-cpu to force it)")
    t0 = time.perf_counter()
    model = workload.fresh().to(backend.device())
    info: dict[str, Any] = {"resident_bytes": workload.weight_bytes, "streamed_bytes": 0}
    if compiled:
        import torch

        _reset_dynamo()
        model.forward = torch.compile(model.forward, backend=options.compile_backend)
        info["compile_backend"] = options.compile_backend
    backend.device_module.synchronize()
    return GenerateModel(model, time.perf_counter() - t0, options.warmup, info=info)


def prepare_magi(workload: Workload, backend: Backend, spec: SystemSpec, options: GenerateOptions) -> GenerateModel:
    """``magi_core.offload(fresh model, OffloadConfig(policy, ratio or budget))`` with the compile defaults (the decode
    graph dynamic in the KV length)."""
    _reset_dynamo()
    config = _magi_config(spec, workload.weight_bytes)
    t0 = time.perf_counter()
    model = offload(workload.fresh(), config)
    backend.device_module.synchronize()
    setup = time.perf_counter() - t0

    def close() -> None:
        release(model)

    # the prefill graph plans in its warm-up calls + 1st generate; a graph planned earlier may plan again once the
    # later ones did (graphs of one model share the budget): two more generates leave every graph planned
    warmups = max(options.warmup, int(config.warmup_calls) + 2)
    info = magi_static_info(model)
    info["budget_bytes"] = config.device_memory_budget_bytes
    return GenerateModel(model, setup, warmups, info=info, close=close, offloaded=True)


def prepare_accelerate(workload: Workload, backend: Backend, options: GenerateOptions) -> GenerateModel:
    """accelerate ``device_map="auto"`` with ``max_memory`` of ``--accelerate-budget`` times the weights on the
    device and the rest on the host (big-model inference: offloaded modules run on the device, their weights copied
    in for each call), dispatched as the bench's accelerate peer is."""
    if importlib.util.find_spec("accelerate") is None:
        raise SystemSkipped("accelerate is not installed (pip install 'magi-core[bench]')")
    if not backend.is_accelerator:
        raise SystemSkipped("accelerate's device_map places weights on an accelerator: the cpu backend has none")
    t0 = time.perf_counter()
    weights = workload.weight_bytes
    max_memory: dict[int | str, int] = {backend.device_index(): int(options.accelerate_budget * weights),
                                        "cpu": 2 * weights + HOST_SLACK_BYTES}
    model, info = dispatch_accelerate(workload, backend, max_memory)
    info["accelerate_budget_fraction"] = options.accelerate_budget
    return GenerateModel(model, time.perf_counter() - t0, 1, info=info)


def prepare(workload: Workload, backend: Backend, spec: SystemSpec, options: GenerateOptions) -> GenerateModel:
    """Set up ``spec`` on a fresh copy of ``workload``'s model, ready to ``generate`` greedily."""
    if spec.kind in ("resident_eager", "resident_compiled"):
        p = prepare_resident(workload, backend, spec.kind == "resident_compiled", options)
    elif spec.kind == "magi":
        p = prepare_magi(workload, backend, spec, options)
    elif spec.kind == "accelerate":
        p = prepare_accelerate(workload, backend, options)
    else:
        raise ValueError(f"unknown system kind {spec.kind!r}")
    quiet_generation(p.model)
    return p

