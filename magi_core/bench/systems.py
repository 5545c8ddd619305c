"""The systems under test: resident eager / compiled, magi-core offload, diffusers and accelerate offloading.

Each system turns a fresh model copy into a :class:`Prepared` callable on the active backend and
knows how to tear it down again. Peers are imported lazily and reported as skipped when missing.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from magi_core.api import handle, offload, release
from magi_core.bench.workloads import Workload
from magi_core.config import OffloadConfig
from magi_core.plugin.facade import Backend

POLICIES = ("BASE", "COST_EFFECTIVE", "HEURISTIC")


class SystemSkipped(Exception):
    """The system cannot run here (a peer not installed, compile disabled on this backend); the message says why."""


@dataclass(frozen=True)
class SystemSpec:
    """One system configuration: its kind and, for magi-core, the policy and residency ratio or budget."""

    kind: str  # resident_eager | resident_compiled | magi | diffusers | accelerate
    policy: str | None = None
    ratio: float | None = None
    budget_fraction: float | None = None

    @property
    def is_magi_default(self) -> bool:
        """magi-core with its default ``OffloadConfig()``: no policy, ratio or budget chosen (the plan fits the card).
        """
        return self.kind == "magi" and self.policy is None and self.ratio is None and self.budget_fraction is None

    @property
    def label(self) -> str:
        """Short human-readable name, unique within a run."""
        if self.kind != "magi":
            return self.kind
        if self.is_magi_default:
            return "magi default"
        if self.budget_fraction is not None:
            return f"magi {self.policy} budget={self.budget_fraction:g}W"
        return f"magi {self.policy} r={self.ratio:g}"


@dataclass
class Prepared:
    """A runnable system: the callable, its setup time, what it knows about its memory, and its teardown."""

    fn: Callable[..., Any]
    """Called with the workload's inputs: ``fn(*args, **kwargs)``."""
    setup_s: float
    warmup_calls: int
    info: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    stats: Callable[[], dict[str, Any]] = dict
    host_timing: bool = True
    """Also time single calls on an idle device (host overhead); off for the slow peers."""


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def _reset_dynamo() -> None:
    """Forget compiled frames so fresh copies of one model class never hit Dynamo's recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()


def prepare_resident(workload: Workload, backend: Backend, compiled: bool, compile_on_cpu: bool,
                     compile_backend: str = "inductor") -> Prepared:
    """The whole model on the device, run eagerly or through ``torch.compile`` (``compile_backend``: Inductor)."""
    if compiled and not backend.is_accelerator and not compile_on_cpu:
        raise SystemSkipped("Inductor compile skipped on the cpu backend (pass --compile-on-cpu to force it)")
    t0 = time.perf_counter()
    model: nn.Module = workload.fresh().to(backend.device())
    fn: Callable[..., Any] = model
    info: dict[str, Any] = {"resident_bytes": workload.weight_bytes, "streamed_bytes": 0,
                            "units": len(workload.block_bytes)}
    if compiled:
        _reset_dynamo()
        # one static graph per token count, as magi-core below
        fn = torch.compile(model, dynamic=False, backend=compile_backend)
        info["compile_backend"] = compile_backend
    backend.device_module.synchronize()
    return Prepared(_no_grad(fn), time.perf_counter() - t0, 1 if not compiled else 2, info=info)


def _magi_config(spec: SystemSpec, weight_bytes: int) -> OffloadConfig:
    if spec.is_magi_default:
        return OffloadConfig()
    assert spec.policy is not None, "magi configurations name a policy, or none of policy, ratio and budget"
    if spec.budget_fraction is not None:
        return OffloadConfig(policy=spec.policy, device_memory_budget_bytes=int(spec.budget_fraction * weight_bytes))
    return OffloadConfig(policy=spec.policy, gpu_resident_weight_ratio=float(spec.ratio or 0.0))


def prepare_magi(workload: Workload, backend: Backend, spec: SystemSpec) -> Prepared:
    """``magi_core.offload(fresh model, OffloadConfig(...))`` with the spec's policy and ratio or budget."""

    _reset_dynamo()
    config = _magi_config(spec, workload.weight_bytes)
    t0 = time.perf_counter()
    model = offload(workload.fresh(), config, dynamic=False)
    backend.device_module.synchronize()
    setup = time.perf_counter() - t0

    def close() -> None:
        release(model)

    return Prepared(_no_grad(model), setup, int(config.warmup_calls) + 1, info=magi_static_info(model),
                    close=close, stats=lambda: magi_step_info(model))


#: A 1-element host buffer the bench adds to a model that holds no weights outside its block lists (see below).
DIFFUSERS_ANCHOR = "_bench_diffusers_prefetch_anchor"


def block_lists(model: nn.Module) -> list[str]:
    """Names of ``model``'s direct ``ModuleList``/``Sequential`` children: what diffusers' block level offloads."""
    return [name for name, child in model.named_children() if isinstance(child, nn.ModuleList | nn.Sequential)]


def has_top_level_group(model: nn.Module) -> bool:
    """True when diffusers block-level offloading would form its top-level group for ``model``.

    That group holds every direct child that is not a block list and every parameter or buffer outside the
    block lists; diffusers 0.42 installs its lazy prefetch hook (which records the execution order on the
    first call and then chains the stream prefetches) only on that group. Without it, ``use_stream=True``
    gives every block a self-onloading group whose copy runs on the transfer stream while the block's
    kernels already read the weights: the output is garbage.
    """
    blocks = set(block_lists(model))
    if any(name not in blocks for name, _ in model.named_children()):
        return True
    return any(True for _ in model.parameters(recurse=False)) or any(True for _ in model.buffers(recurse=False))


def prefetch_hook_missing(model: nn.Module) -> bool:
    """True when diffusers' hook registry on ``model`` lacks the lazy prefetch hook (False if it cannot tell)."""
    registry = getattr(model, "_diffusers_hook", None)
    if registry is None:  # hooks on the blocks but none on the model itself: no top-level group, no prefetch chain
        return any(getattr(m, "_diffusers_hook", None) is not None for m in model.modules())
    get_hook = getattr(registry, "get_hook", None)
    if get_hook is None:
        return False
    try:
        return get_hook("lazy_prefetch_group_offloading") is None
    except Exception:  # another diffusers layout: the error check against resident still guards the output
        return False


def _has_own_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def block_holder(model: nn.Module, block_prefix: str) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """The module holding the block list named by ``block_prefix``, and the weight-holding modules outside it.

    ``blocks`` (diffusers models, the bench's own) is held by the model itself: nothing is outside. For
    ``model.layers`` (transformers' ``LlamaForCausalLM``) the holder is ``model`` and the LM head is outside. Raises
    :class:`SystemSkipped` when a module on the way holds weights of its own (no group could own them).
    """
    path = block_prefix.split(".")[:-1]
    outside: list[tuple[str, nn.Module]] = []
    node, prefix = model, ""
    for part in path:
        if _has_own_weights(node):
            raise SystemSkipped(f"{type(node).__name__} holds weights outside its children: no diffusers group owns "
                                "them when the blocks are nested")
        outside += [(prefix + name, child) for name, child in node.named_children()
                    if name != part and (any(True for _ in child.parameters()) or any(True for _ in child.buffers()))]
        node, prefix = node.get_submodule(part), prefix + part + "."
    return node, outside


def prepare_diffusers(workload: Workload, backend: Backend) -> Prepared:
    """diffusers group offloading: block level, one block per group, copy stream and ``record_stream``.

    Applied as diffusers documents it (``apply_group_offloading``, what ``ModelMixin.enable_group_offload`` calls):
    the blocks are a ``ModuleList`` that is a direct child of the module offloaded, and everything outside them
    (embeddings, final norm) becomes the top-level group that is onloaded for each call. A model with nothing
    outside its blocks (the MLP stack) gets a 1-element host buffer so that diffusers forms that group and its
    prefetch hook (see :func:`has_top_level_group`), as it does for every diffusers model. The first call records
    the execution order (blocking copies); later calls prefetch the next block on the copy stream. On the cpu
    backend the stream variant cannot run: the same offloading runs with ``use_stream=False`` (checks correctness,
    not speed).

    Blocks one level down (transformers' ``LlamaForCausalLM.model.layers``): the offloading is applied to the module
    holding the block list (``LlamaModel``, whose embeddings and final norm form its top-level group), and each
    weight-holding module outside it (the LM head) is a block-level group of its own, onloaded when called, blocking
    and without the stream, as diffusers onloads a model's top-level group. diffusers 0.42 cannot nest stream groups:
    ``block_modules=["model"]`` on the whole model raises "Hook with name layer_execution_tracker already exists".
    """
    if importlib.util.find_spec("diffusers") is None:
        raise SystemSkipped("diffusers is not installed (pip install 'magi-core[bench]')")
    from diffusers.hooks import apply_group_offloading

    use_stream = backend.is_accelerator
    t0 = time.perf_counter()
    model = workload.fresh()
    holder, outside = block_holder(model, workload.block_prefix)
    if not block_lists(holder):
        raise SystemSkipped(f"{type(holder).__name__} has no ModuleList/Sequential child for block-level offloading")
    anchored = use_stream and not has_top_level_group(holder)
    if anchored:
        holder.register_buffer(DIFFUSERS_ANCHOR, torch.zeros(1, dtype=workload.dtype), persistent=False)
    device, host = backend.device(), torch.device("cpu")
    apply_group_offloading(holder, onload_device=device, offload_device=host, offload_type="block_level",
                           num_blocks_per_group=1, use_stream=use_stream, record_stream=use_stream)
    for _, module in outside:
        apply_group_offloading(module, onload_device=device, offload_device=host, offload_type="block_level",
                               num_blocks_per_group=1)
    if use_stream and prefetch_hook_missing(holder):
        raise RuntimeError("diffusers installed no lazy prefetch hook on the model: its stream copies would race the "
                           "blocks' kernels; check has_top_level_group() against this diffusers version")
    backend.device_module.synchronize()
    return Prepared(_no_grad(model), time.perf_counter() - t0, 2,
                    info={"resident_bytes": 0, "streamed_bytes": workload.weight_bytes,
                          "units": len(workload.block_bytes), "diffusers_use_stream": use_stream,
                          "diffusers_prefetch_anchor": anchored,
                          "diffusers_separate_groups": [name for name, _ in outside]}, host_timing=False)


#: What accelerate's ``max_memory`` leaves free on the device for activations and the offloaded weights it moves in
#: for each call: this many bytes, or this fraction of the device's capacity when that is more.
ACCELERATE_SLACK_BYTES = 2 << 30
ACCELERATE_SLACK_FRACTION = 0.05


def accelerate_max_memory(device_bytes: int, weight_bytes: int, index: int) -> dict[int | str, int]:
    """accelerate's ``max_memory`` for a device of ``device_bytes``: the device less the slack, the host for the rest.

    The slack (:data:`ACCELERATE_SLACK_BYTES`, or :data:`ACCELERATE_SLACK_FRACTION` of the device) is working memory:
    activations, and the offloaded module accelerate copies in for each call.
    """
    slack = max(ACCELERATE_SLACK_BYTES, int(ACCELERATE_SLACK_FRACTION * device_bytes))
    return {index: max(0, device_bytes - slack), "cpu": 2 * weight_bytes + (1 << 30)}


def prepare_accelerate(workload: Workload, backend: Backend, device_bytes: int | None = None) -> Prepared:
    """accelerate: ``cpu_offload`` with the backend's device as execution device, or, given ``device_bytes`` (a
    card's capacity: the cap of a capped process), ``device_map="auto"`` with ``max_memory`` at that size (what fits
    stays on the device, the rest is offloaded to the host and copied in for each call, accelerate's big-model
    inference)."""
    if importlib.util.find_spec("accelerate") is None:
        raise SystemSkipped("accelerate is not installed (pip install 'magi-core[bench]')")
    if device_bytes is not None:
        return _prepare_accelerate_device_map(workload, backend, device_bytes)
    from accelerate import cpu_offload

    t0 = time.perf_counter()
    model = workload.fresh()
    cpu_offload(model, execution_device=backend.device())
    backend.device_module.synchronize()
    return Prepared(_no_grad(model), time.perf_counter() - t0, 1,
                    info={"resident_bytes": 0, "streamed_bytes": workload.weight_bytes,
                          "units": sum(1 for m in model.modules() if not list(m.children()))}, host_timing=False)


def _prepare_accelerate_device_map(workload: Workload, backend: Backend, device_bytes: int) -> Prepared:
    """accelerate's ``infer_auto_device_map`` + ``dispatch_model`` within ``device_bytes`` of the device."""
    if not backend.is_accelerator:
        raise SystemSkipped("accelerate's device_map places weights on an accelerator: the cpu backend has none")
    t0 = time.perf_counter()
    max_memory = accelerate_max_memory(device_bytes, workload.weight_bytes, backend.device_index())
    model, info = dispatch_accelerate(workload, backend, max_memory)
    return Prepared(_no_grad(model), time.perf_counter() - t0, 1, info=info, host_timing=False)


def dispatch_accelerate(workload: Workload, backend: Backend,
                        max_memory: dict[int | str, int]) -> tuple[nn.Module, dict[str, Any]]:
    """A fresh model placed by accelerate's ``infer_auto_device_map`` within ``max_memory`` and dispatched with
    ``dispatch_model`` (modules placed on the host run on the device, their weights copied in for each call); the
    model and what the result records about it (resident and streamed bytes, the offloaded modules)."""
    from accelerate import dispatch_model, infer_auto_device_map

    model = workload.fresh()
    index = backend.device_index()
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    skip = getattr(model, "_skip_keys_device_placement", None)
    # the device runs everything, also modules offloaded to the host (accelerate would run on the host otherwise)
    model = dispatch_model(model, device_map=device_map, main_device=backend.device(index), skip_keys=skip,
                           force_hooks=True)
    backend.device_module.synchronize()
    sizes = {name: t.numel() * t.element_size() for name, t in workload.base.items()}
    on_host = [m for m, d in device_map.items() if d in ("cpu", "disk")]
    streamed = sum(n for name, n in sizes.items()
                   if any(m == "" or name == m or name.startswith(m + ".") for m in on_host))
    return model, {"resident_bytes": workload.weight_bytes - streamed, "streamed_bytes": streamed,
                   "units": len(device_map), "accelerate_device_map": True,
                   "accelerate_max_memory": {str(k): v for k, v in max_memory.items()},
                   "accelerate_offloaded_modules": len(on_host)}


def prepare(workload: Workload, backend: Backend, spec: SystemSpec, compile_on_cpu: bool = False,
            compile_backend: str = "inductor", accelerate_device_bytes: int | None = None) -> Prepared:
    """Set up ``spec`` on a fresh copy of ``workload``'s model (accelerate with a device map of
    ``accelerate_device_bytes`` when given)."""
    if spec.kind in ("resident_eager", "resident_compiled"):
        return prepare_resident(workload, backend, spec.kind == "resident_compiled", compile_on_cpu, compile_backend)
    if spec.kind == "magi":
        return prepare_magi(workload, backend, spec)
    if spec.kind == "diffusers":
        return prepare_diffusers(workload, backend)
    if spec.kind == "accelerate":
        return prepare_accelerate(workload, backend, accelerate_device_bytes)
    raise ValueError(f"unknown system kind {spec.kind!r}")


def cleanup(backend: Backend) -> None:
    """Collect garbage, forget Dynamo frames and return cached device memory after a system ran."""
    _reset_dynamo()
    gc.collect()
    dm = backend.device_module
    dm.synchronize()
    empty = getattr(dm, "empty_cache", None)
    if empty is not None:
        empty()


def magi_step_info(model: nn.Module) -> dict[str, Any]:
    """Units, resident / streamed bytes per step, plan and bandwidth of the model's newest runtime (empty if none)."""
    h = handle(model)
    live = h.runtimes
    if not live:
        return {}
    rt = live[-1]
    s = h.stats()[-1]
    info: dict[str, Any] = {"units": s.units, "magi_phase": s.phase, "compile_count": h.compile_count}
    # the model's runtimes for other token counts keep their copy buffers (one shared buffer, of their largest
    # plan's size, where the transfer shares it): what the device holds for copies beyond this plan's own
    info["transfer_buffer_bytes"] = s.transfer_buffer_bytes
    bufs = {b.data_ptr(): b.numel() for r in live
            if (b := getattr(r.executor.transfer, "device_buffer", None)) is not None}
    info["other_runtimes_buffer_bytes"] = max(0, sum(bufs.values()) - s.transfer_buffer_bytes)
    if s.resident_bytes is not None and s.streamed_bytes_per_step is not None:
        info["resident_bytes"] = s.resident_bytes
        info["streamed_bytes"] = s.streamed_bytes_per_step
    plan = rt.plan
    if plan is not None:
        info["plan_policy"] = str(plan.policy)
        info["plan_resident_units"] = len(plan.resident)
        info["predicted_step_ms"] = plan.predicted_step_ms
        info["predicted_stall_ms"] = plan.predicted_stall_ms
    if s.bandwidth_GBps is not None:
        info["runtime_bandwidth_GBps"] = s.bandwidth_GBps
    return info


def magi_static_info(model: nn.Module) -> dict[str, Any]:
    """Figures known once set up: pinned and weight bytes of the host arena and its setup timings."""
    hw = handle(model).host
    if hw is None:
        return {}
    info: dict[str, Any] = {"pinned_bytes": int(hw.pinned_bytes), "host_weight_bytes": int(hw.weight_bytes)}
    timings = hw.report.get("timings")
    if isinstance(timings, dict):
        info["host_timings_s"] = {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}
    return info
