"""One regression test per origin case (origin.md sections 1-3) for the device placement and split passes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from strategies import clone_graph_module, fake_run_on, flat_tensors, inputs_on, trace_with
from torch import nn

from magi_core.passes.device_placement import place_on_device
from magi_core.passes.split import split_into_units
from magi_core.passes.weights import node_value

META = torch.device("meta")
TESTS = Path(__file__).resolve().parents[1]


def _move_metadata_only(gm: torch.fx.GraphModule) -> None:
    """What the old path did: move CPU example values to the device, leave the nodes as traced."""
    for node in gm.graph.nodes:
        v = node.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0:
            with torch.no_grad(), v.fake_mode:
                node.meta["example_value"] = v.to(META)


class IndexSelect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
        return self.proj(x).index_select(0, mapping.to(x.device))


def test_index_select_with_index_moved_to_x_device() -> None:
    """``x.index_select(0, mapping.to(cpu))``: metadata-only fails, the full rewrite passes, no ``.to(cpu)`` left."""
    inputs = (torch.randn(5, 4), torch.tensor([4, 0, 2]))
    meta_only = trace_with(IndexSelect(), inputs, lambda gm, ex: _move_metadata_only(gm))
    assert any(n.target == "to" and n.args[1] == torch.device("cpu") for n in meta_only.gm.graph.nodes)
    with pytest.raises(RuntimeError, match="found at least two devices, meta and cpu"):
        fake_run_on(META, meta_only.gm, meta_only.example_inputs)

    full = trace_with(IndexSelect(), inputs, lambda gm, ex: place_on_device(gm, META, ("to",), example_inputs=ex))
    assert full.result.to_calls == 1
    to_nodes = [n for n in full.gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert to_nodes and all(n.args[1] == META for n in to_nodes)
    out = fake_run_on(META, full.gm, full.example_inputs)
    assert flat_tensors(out)[0].device == META and flat_tensors(out)[0].shape == (3, 4)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_lifted_rmsnorm_eps_stays_a_host_scalar() -> None:
    """A lifted ``eps`` stays a 0-dim CPU input (node and metadata); moving it like the old path breaks ``.item()``."""
    trace = trace_with(RMSNorm(8), (torch.randn(3, 8),),
                       lambda gm, ex: place_on_device(gm, META, ("to",), example_inputs=ex))
    eps_nodes = [n for n in trace.gm.graph.find_nodes(op="placeholder")
                 if isinstance(node_value(n), torch.Tensor) and node_value(n).dim() == 0]
    assert len(eps_nodes) == 1, "Dynamo should lift the float eps (dynamic=True)"
    eps = eps_nodes[0]
    assert node_value(eps).device.type == "cpu"
    assert any(u.op == "call_method" and u.target == "item" for u in eps.users)
    index = list(trace.gm.graph.find_nodes(op="placeholder")).index(eps)
    assert trace.example_inputs[index].item() == pytest.approx(1e-6)

    out = trace.gm(*inputs_on(META, trace.example_inputs))  # eps stays on the CPU; .item() works
    assert flat_tensors(out)[0].device == META
    old_way = [v.to(META) if isinstance(v, torch.Tensor) else v for v in trace.example_inputs]
    with pytest.raises((RuntimeError, NotImplementedError)):
        trace.gm(*old_way)  # every input moved: the scalar cannot be read back


def test_weight_that_lost_its_parameter_wrapping() -> None:
    """A weight whose fake value lost ``nn.Parameter`` is still a weight, and the placement restores the wrapping."""
    def strip_then_place(gm: torch.fx.GraphModule, ex: list[Any]) -> dict[str, Any]:
        stripped = []
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node_value(node)
            if isinstance(v, nn.Parameter):
                with torch.no_grad(), v.fake_mode:
                    node.meta["example_value"] = v.detach()  # a plain FakeTensor now
                assert not isinstance(node.meta["example_value"], nn.Parameter)
                stripped.append(node.name)
        # without example inputs, Dynamo's grapharg still knows the real Parameter
        split_no_inputs = split_into_units(clone_graph_module(gm), None)
        report = place_on_device(gm, META, ("to",), example_inputs=ex)
        return {"stripped": stripped, "split": split_no_inputs, "report": report}

    trace = trace_with(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), (torch.randn(2, 4),),
                       strip_then_place)
    res = trace.result
    assert len(res["stripped"]) == 4
    assert res["report"].parameters_restored == 4
    assert len(res["split"].weights) == 4
    for node in trace.gm.graph.find_nodes(op="placeholder"):
        if node.name in res["stripped"]:
            assert isinstance(node_value(node), nn.Parameter) and node_value(node).device == META
    # after Dynamo dropped its grapharg metadata, the real inputs still identify the weights
    for node in trace.gm.graph.find_nodes(op="placeholder"):
        if node.name in res["stripped"]:
            with torch.no_grad(), node_value(node).fake_mode:
                node.meta["example_value"] = node_value(node).detach()
            node.meta.pop("grapharg", None)
    split = split_into_units(clone_graph_module(trace.gm), trace.example_inputs)
    assert len(split.weights) == 4


class Arange(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[0], device=x.device)[:, None].to(x.dtype)


def test_arange_with_device_of_x_and_symbolic_length() -> None:
    """``torch.arange(n, device=x.device)`` with a symbolic ``n`` is rewritten, keeping the symbolic shape."""
    trace = trace_with(Arange(), (torch.randn(5, 3),),
                       lambda gm, ex: place_on_device(gm, META, ("to",), example_inputs=ex))
    aranges = [n for n in trace.gm.graph.nodes if n.target is torch.arange]
    assert len(aranges) == 1 and aranges[0].kwargs["device"] == META
    value = node_value(aranges[0])
    assert value.device == META and isinstance(value.shape[0], torch.SymInt)
    original = node_value(next(n for n in trace.pristine.graph.nodes if n.target is torch.arange))
    assert value.shape[0] is original.shape[0] or str(value.shape[0]) == str(original.shape[0])
    assert value.fake_mode is original.fake_mode
    out = trace.gm(*inputs_on(META, trace.example_inputs))
    assert flat_tensors(out)[0].device == META


ORIG_TO_CHILD = r"""
import torch, torch_musa
from torch import nn
assert torch_musa.EMULATED and hasattr(torch.Tensor, "orig_to")
import magi_core
from magi_core.passes.device_placement import place_on_device, is_cpu_device
from magi_core.passes.split import split_into_units

backend = magi_core.use_backend("musa")
assert "orig_to" in backend.to_method_aliases, backend.to_method_aliases

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
    def forward(self, x, mapping):
        return self.proj(x).index_select(0, mapping.to(device=x.device)).to(torch.float16)

seen = {}
def backend_fn(gm, ex):
    seen["targets"] = [(n.op, n.target) for n in gm.graph.nodes]
    seen["report"] = place_on_device(gm, backend.device(), backend.to_method_aliases, example_inputs=ex)
    seen["gm"], seen["ex"] = gm, ex
    split_into_units(gm, ex)
    return lambda *a: (torch.zeros(3, 4, dtype=torch.float16),)

torch._dynamo.reset()
torch.compile(M(), backend=backend_fn, fullgraph=True)(torch.randn(5, 4), torch.tensor([1, 0, 2]))
assert ("call_method", "orig_to") in seen["targets"], seen["targets"]
r = seen["report"]
assert r.device == torch.device("musa", 0) and r.to_calls == 1, r
gm = seen["gm"]
for n in gm.graph.nodes:
    if n.op == "call_method" and n.target in ("to", "orig_to"):
        devs = [a for a in list(n.args[1:]) + list(n.kwargs.values()) if isinstance(a, torch.device)]
        assert not any(is_cpu_device(d) for d in devs), n.format_node()
    v = n.meta.get("example_value")
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        assert v.device.type == "musa", (n.name, v.device)
weights = [n for n in gm.graph.find_nodes(op="placeholder") if isinstance(n.meta["example_value"], nn.Parameter)]
assert len(weights) == 2
print("ORIG_TO_OK", r.as_dict())
"""


@pytest.mark.emulated
def test_orig_to_under_emulated_torch_musa() -> None:
    """Under the emulated torch_musa wrapper Dynamo records ``orig_to``; the registry's aliases get it rewritten."""
    fakes = TESTS / "fakes"
    if not (fakes / "torch_musa").is_dir():
        pytest.skip("tests/fakes/torch_musa (the emulation) is not present")
    sys.path.insert(0, str(fakes))
    try:
        from run_emulated import run_emulated
    finally:
        sys.path.remove(str(fakes))
    proc = run_emulated(ORIG_TO_CHILD, env={"MAGI_BACKEND": "musa"})
    assert "ORIG_TO_OK" in proc.stdout
