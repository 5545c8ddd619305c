"""Property tests (issue 3) for the device placement rewrite and the unit split, on random graphs.

Target device ``meta`` stands in for the accelerator on CPU machines: any CPU tensor left where the
rewritten graph meets a meta tensor raises a device mismatch, so property 5 is a real check here.
Profiles: ``HYPOTHESIS_PROFILE=ci`` (default, bounded, derandomized) or ``dev`` (tests/conftest.py).
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import (
    FxSpec,
    ModelSpec,
    all_graph_modules,
    build_fx_graph,
    build_model,
    fake_run_on,
    flat_tensors,
    fx_specs,
    inputs_on,
    model_inputs,
    model_specs,
    orig_to_installed,
    trace_with,
)
from torch import nn

from magi_core.passes.device_placement import PlacementReport, is_cpu_device, place_on_device
from magi_core.passes.split import split_into_units
from magi_core.passes.units import SplitGraph
from magi_core.passes.weights import node_value

META = torch.device("meta")
ALIASES = ("to", "orig_to")
#: Chain ops that read a weight (a parameter or a static buffer).
WEIGHT_OPS = frozenset({"linear", "embed", "rms", "buffer", "shared_t"})


def _snapshot(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Per node of the root graph: (op, target, args, kwargs, example value object)."""
    return {n.name: (n.op, n.target, n.args, dict(n.kwargs), node_value(n)) for n in gm.graph.nodes}


def _is_dtype_to(node: torch.fx.Node) -> bool:
    if node.op != "call_method" or node.target not in ALIASES:
        return False
    rest = list(node.args[1:]) + list(node.kwargs.values())
    return all(not isinstance(a, (torch.device, str, int)) or isinstance(a, bool) for a in rest) and any(
        isinstance(a, torch.dtype) for a in rest
    )


def _devices_in(value: Any) -> list[Any]:
    if isinstance(value, (torch.device, str)):
        return [value]
    if isinstance(value, (tuple, list)):
        return [d for v in value for d in _devices_in(v)]
    if isinstance(value, dict):
        return [d for v in value.values() for d in _devices_in(v)]
    return []


def check_placement(gm: torch.fx.GraphModule, inputs: list[Any], before: dict[str, Any], report: PlacementReport,
                    ) -> None:
    """Properties 1-4 on a graph that :func:`place_on_device` rewrote onto ``meta``."""
    host_scalars = {name for name, (op, _, _, _, v) in before.items()
                    if op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 0
                    and v.device.type == "cpu" and not isinstance(v, nn.Parameter)}
    for mod in all_graph_modules(gm):
        for node in mod.graph.nodes:
            value = node_value(node)
            # 1. nothing but 0-dim host scalars stays on the CPU, in metadata or in device arguments
            for t in flat_tensors(value):
                if t.device.type == "cpu":
                    assert t.dim() == 0 and not isinstance(t, nn.Parameter), f"{node.name}: CPU value {t.shape}"
            cpu_args = [d for d in _devices_in((node.args, node.kwargs)) if is_cpu_device(d)]
            if cpu_args:
                assert isinstance(value, torch.Tensor) and value.dim() == 0, f"{node.format_node()} keeps the CPU"
    after = _snapshot(gm)
    for name, (op, target, args, kwargs, value) in before.items():
        node_after = after[name]
        # 2. 0-dim host scalars and .to(dtype) calls are untouched
        if name in host_scalars:
            assert node_after[4] is value, f"host scalar {name} metadata changed"
        if op == "call_method" and target in ALIASES and not _devices_in((args[1:], kwargs)):
            assert node_after[2] == args and node_after[3] == kwargs, f".to(dtype) {name} changed"
    # 3. weights still report nn.Parameter, on the target
    for node, real in zip(gm.graph.find_nodes(op="placeholder"), inputs, strict=True):
        if isinstance(real, nn.Parameter):
            ev = node_value(node)
            assert isinstance(ev, nn.Parameter), f"weight {node.name} lost its Parameter wrapping"
            assert ev.device == META
    # 4. idempotent
    code = [m.code for m in all_graph_modules(gm)]
    again = place_on_device(gm, META, ALIASES, example_inputs=inputs)
    assert not again.changed, f"second rewrite changed {again.as_dict()}"
    assert [m.code for m in all_graph_modules(gm)] == code
    assert report.modules_recompiled >= (1 if report.to_calls + report.factory_kwargs else 0)


def check_runs_on_meta(gm: torch.fx.GraphModule, inputs: list[Any], reference: Any) -> None:
    """Property 5: the rewritten graph runs with meta inputs (host scalars on the CPU); shapes match the CPU run."""
    out = gm(*inputs_on(META, inputs))
    for got, want in zip(flat_tensors(out), flat_tensors(reference), strict=True):
        assert got.device == META and got.shape == want.shape and got.dtype == want.dtype
    fake_out = fake_run_on(META, gm, inputs)  # fake tensors raise on any CPU/meta mix eager meta lets through
    assert all(t.device == META for t in flat_tensors(fake_out))


def check_split(split: SplitGraph, original: torch.fx.GraphModule, inputs: list[Any], reference: Any,
                *, exact: bool = True) -> None:
    """Property 6: same outputs as the unsplit graph; each weight reaches exactly the units that use it."""
    top = split.graph_module
    placeholders = list(top.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(list(original.graph.find_nodes(op="placeholder")))
    for node in top.graph.nodes:
        assert node.op in ("placeholder", "call_module", "output") or node.target is operator.getitem
    if exact:
        out = top(*inputs_on("cpu", inputs))
        for got, want in zip(flat_tensors(out), flat_tensors(reference), strict=True):
            assert torch.equal(got, want)
    index_of = {p: i for i, p in enumerate(placeholders)}
    for i, real in enumerate(inputs):
        if isinstance(real, nn.Parameter):
            assert i in split.weights, f"parameter input {i} is not a weight slot"
    for i, slot in split.weights.items():
        reaching = []
        for unit in split.units:
            unit_phs = list(unit.module.graph.find_nodes(op="placeholder"))
            positions = [p for p, a in enumerate(unit.node.args)
                         if isinstance(a, torch.fx.Node) and index_of.get(a) == i]
            assert len(positions) <= 1
            if positions:
                assert unit_phs[positions[0]].users, f"unit {unit.index} receives weight {i} but does not use it"
                assert slot in unit.weights
                assert unit.weight_arg_positions[unit.weights.index(slot)] == positions[0]
                reaching.append(unit.index)
            else:
                assert slot not in unit.weights
        assert tuple(reaching) == slot.users
        used_in_original = bool(original.graph.find_nodes(op="placeholder")[i].users)
        assert bool(reaching) == used_in_original


def _all_passes(trace_gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
    """Inside the Dynamo backend: split a clone on the CPU, then place + split the graph onto meta."""
    from strategies import clone_graph_module

    results: dict[str, Any] = {}
    cpu_copy = clone_graph_module(trace_gm)
    results["cpu_original"] = clone_graph_module(trace_gm)
    results["cpu_split"] = split_into_units(cpu_copy, inputs)
    results["before"] = _snapshot(trace_gm)
    results["report"] = place_on_device(trace_gm, META, ALIASES, example_inputs=inputs)
    return results


EXAMPLE_ALL_OPS = ModelSpec(
    dim=4, batch=3, vocab=5, pre=("scalar", "rms"),
    block=("linear", "index_select", "arange", "cast16", "shared_t", "buffer"), n_blocks=3,
    post=("gather", "full", "embed", "cast64", "zeros"), tie_head=True, reuse_first_block=True,
)


@given(model_specs())
@example(EXAMPLE_ALL_OPS)
@example(ModelSpec(dim=4, batch=2, vocab=3, pre=(), block=("scalar",), n_blocks=0, post=(), seed=1))
def test_dynamo_graphs_properties(spec: ModelSpec) -> None:
    """Properties 1-6 on graphs Dynamo traced on the CPU from random models."""
    model = build_model(spec)
    trace = trace_with(model, model_inputs(spec), _all_passes)
    inputs, res = trace.example_inputs, trace.result
    with torch.no_grad():
        reference = res["cpu_original"](*inputs_on("cpu", inputs))
        check_split(res["cpu_split"], res["cpu_original"], inputs, reference)
        check_placement(trace.gm, inputs, res["before"], res["report"])
        check_runs_on_meta(trace.gm, inputs, reference)
    if spec.n_blocks >= 2 and WEIGHT_OPS.intersection(spec.block):  # blocks reading no weight need no unit
        labels = [u.label for u in res["cpu_split"].units]
        assert sum(lbl.startswith("layers.") for lbl in labels) >= spec.n_blocks


@given(model_specs(min_blocks=1), st.integers(1, 4000))
def test_dynamo_split_with_budget(spec: ModelSpec, budget: int) -> None:
    """Property 6 with ``max_unit_bytes``: outputs equal; no unit over budget unless one op needs more."""
    def split(gm: torch.fx.GraphModule, inputs: list[Any]) -> SplitGraph:
        return split_into_units(gm, inputs, max_unit_bytes=budget)

    trace = trace_with(build_model(spec), model_inputs(spec), split)
    with torch.no_grad():
        reference = trace.pristine(*inputs_on("cpu", trace.example_inputs))
        check_split(trace.result, trace.pristine, trace.example_inputs, reference)
    for unit in trace.result.units:
        if unit.nbytes > budget:  # allowed only when a single op reads more than the budget
            biggest_op = max(
                sum(
                    s.nbytes for s in unit.weights
                    if unit.module.graph.find_nodes(op="placeholder")[unit.weight_arg_positions[unit.weights.index(s)]]
                    in n.all_input_nodes
                )
                for n in unit.module.graph.nodes
            )
            assert biggest_op > budget or len(unit.weights) == 1, f"unit {unit.label} over budget"


@given(fx_specs())
@example(FxSpec(dim=3, batch=2, ops=("index_select", "gather", "scalar", "cast16", "arange", "zeros", "full"),
                blocks=(None, 0, 0, 1, 1, None, None), to_alias=("orig_to",) * 7, to_spelling=(0, 1, 2, 3, 4, 5, 5)))
@example(FxSpec(dim=3, batch=2, ops=("scalar_to", "index_select", "scalar_to"), blocks=(None, 0, 0),
                to_alias=("to", "orig_to", "orig_to"), to_spelling=(0, 2, 4)))
def test_fx_graphs_properties(spec: FxSpec) -> None:
    """Properties 1-6 on graphs built directly with torch.fx (every ``.to`` spelling, ``to`` and ``orig_to``)."""
    from strategies import clone_graph_module

    with orig_to_installed(), torch.no_grad():
        gm, inputs = build_fx_graph(spec)
        original = clone_graph_module(gm)
        reference = original(*inputs)
        split = split_into_units(clone_graph_module(gm), inputs)
        check_split(split, original, inputs, reference)
        before = _snapshot(gm)
        report = place_on_device(gm, META, ALIASES, example_inputs=inputs)
        n_to = sum(1 for k, op in enumerate(spec.ops) if op in ("index_select", "gather"))
        assert report.to_calls == n_to
        assert report.factory_kwargs == sum(op in ("arange", "zeros", "full") for op in spec.ops)
        check_placement(gm, inputs, before, report)
        check_runs_on_meta(gm, inputs, reference)
        # placement then split (the order the compile backend uses) still runs on meta
        placed_split = split_into_units(gm, inputs)
        out = placed_split.graph_module(*inputs_on(META, inputs))
        assert all(t.device == META for t in flat_tensors(out))


@pytest.mark.parametrize("aliases", [("to",), ("to", "orig_to")])
def test_only_backend_aliases_are_rewritten(aliases: tuple[str, ...]) -> None:
    """A ``.orig_to(cpu)`` is rewritten only when the backend lists ``orig_to`` among its aliases."""
    spec = FxSpec(dim=3, batch=2, ops=("index_select", "gather"), blocks=(None, None), to_alias=("to", "orig_to"),
                  to_spelling=(0, 0))
    with orig_to_installed():
        gm, inputs = build_fx_graph(spec)
        report = place_on_device(gm, META, aliases, example_inputs=inputs)
    assert report.to_calls == len(aliases)
    kept = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "orig_to"]
    assert is_cpu_device(kept[0].args[1]) == ("orig_to" not in aliases)
