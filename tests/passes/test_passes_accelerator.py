"""Property 5 on the real accelerator: the rewritten graph runs there and its outputs equal the CPU run.

Skipped cleanly unless the active magi backend is an accelerator with a device present.
Run on the GPU host: ``pytest -m accelerator tests/passes/test_passes_accelerator.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import example, given, settings
from strategies import (
    FxSpec,
    ModelSpec,
    build_fx_graph,
    build_model,
    clone_graph_module,
    flat_tensors,
    fx_specs,
    inputs_on,
    model_inputs,
    model_specs,
    orig_to_installed,
    trace_with,
)

from magi_core.passes.device_placement import place_on_device
from magi_core.passes.split import split_into_units
from magi_core.plugin.manager import get_backend


def _why_no_accelerator() -> str | None:
    try:
        backend = get_backend()
    except Exception as exc:  # no usable backend at all
        return f"no magi backend: {exc}"
    if not backend.is_accelerator:
        return f"active magi backend {backend.name!r} is not an accelerator"
    if not backend.device_module.is_available():
        return f"backend {backend.name!r} reports no device"
    return None


_SKIP = _why_no_accelerator()
pytestmark = [pytest.mark.accelerator, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def _device() -> torch.device:
    return get_backend().device()


def _close(got: Any, want: Any) -> None:
    g, w = flat_tensors(got), flat_tensors(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        assert a.device.type != "cpu" or a.dim() == 0
        torch.testing.assert_close(a.cpu(), b, rtol=2e-3, atol=2e-3)


def _place_and_split(gm: torch.fx.GraphModule, ex: list[Any]) -> dict[str, Any]:
    report = place_on_device(gm, _device(), get_backend().to_method_aliases, example_inputs=ex)
    split = split_into_units(clone_graph_module(gm), ex)
    return {"report": report, "split": split}


@settings(max_examples=15)
@given(model_specs())
@example(ModelSpec(dim=4, batch=3, vocab=5, pre=("scalar", "rms"),
                   block=("linear", "index_select", "arange", "cast16", "shared_t", "buffer"), n_blocks=3,
                   post=("gather", "full", "embed", "cast64", "zeros"), tie_head=True, reuse_first_block=True))
def test_dynamo_graphs_run_on_the_accelerator(spec: ModelSpec) -> None:
    """Dynamo graphs traced on the CPU, rewritten by the pass, run on the device and match the CPU run."""
    device = _device()
    trace = trace_with(build_model(spec), model_inputs(spec), _place_and_split)
    assert trace.result["report"].device == device
    with torch.no_grad():
        reference = trace.pristine(*inputs_on("cpu", trace.example_inputs))
        on_device = inputs_on(device, trace.example_inputs)
        _close(trace.gm(*on_device), reference)
        _close(trace.result["split"].graph_module(*on_device), reference)


@settings(max_examples=15)
@given(fx_specs())
@example(FxSpec(dim=3, batch=2, ops=("index_select", "gather", "scalar", "cast16", "arange", "zeros", "full"),
                blocks=(None, 0, 0, 1, 1, None, None), to_alias=("to",) * 7, to_spelling=(0, 1, 2, 3, 4, 5, 5)))
def test_fx_graphs_run_on_the_accelerator(spec: FxSpec) -> None:
    """Graphs built with torch.fx, rewritten with the backend's aliases, run on the device and match the CPU run."""
    device = _device()
    aliases = get_backend().to_method_aliases
    if "orig_to" not in aliases:
        spec = FxSpec(spec.dim, spec.batch, spec.ops, spec.blocks, ("to",) * len(spec.ops), spec.to_spelling,
                      spec.seed)
    with orig_to_installed(), torch.no_grad():
        gm, inputs = build_fx_graph(spec)
        reference = clone_graph_module(gm)(*inputs)
        place_on_device(gm, device, aliases, example_inputs=inputs)
        _close(gm(*inputs_on(device, inputs)), reference)
