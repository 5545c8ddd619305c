"""Unit tests of :func:`magi_core.passes.device_placement.place_on_device` (target ``meta`` on CPU machines)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from strategies import fake_run_on, flat_tensors, trace_with
from torch import nn

from magi_core.passes.device_placement import place_on_device
from magi_core.passes.weights import node_value
from magi_core.plugin.manager import get_backend

META = torch.device("meta")
CPU = torch.device("cpu")


def _graph_with(build: object) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))  # type: ignore[operator]
    return torch.fx.GraphModule(nn.Module(), graph)


def test_to_spellings_keep_their_other_arguments() -> None:
    """Every CPU spelling is rewritten; dtype, non_blocking, copy and memory_format stay; ints and dtypes stay."""
    spellings = [
        ((CPU,), {}),
        (("cpu",), {}),
        (("cpu:0",), {}),
        ((), {"device": "cpu", "non_blocking": True}),
        ((CPU, torch.float16), {"non_blocking": True, "copy": True}),
        ((), {"device": CPU, "dtype": torch.float16, "memory_format": torch.preserve_format}),
    ]
    untouched = [((torch.float16,), {}), ((), {"dtype": torch.float64}), ((0,), {}), ((), {"device": 1})]

    def build(graph: torch.fx.Graph, x: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        return tuple(graph.call_method("to", (x, *a), dict(k)) for a, k in spellings + untouched)

    gm = _graph_with(build)
    report = place_on_device(gm, META, ("to",))
    assert report.to_calls == len(spellings) and report.modules_recompiled == 1
    nodes = [n for n in gm.graph.nodes if n.op == "call_method"]
    for node, (args, kwargs) in zip(nodes, spellings + untouched, strict=True):
        rewritten = node in nodes[: len(spellings)]
        expect_args = tuple(META if (rewritten and a in (CPU, "cpu", "cpu:0")) else a for a in args)
        expect_kwargs = {k: (META if (rewritten and k == "device") else v) for k, v in kwargs.items()}
        assert node.args[1:] == expect_args and dict(node.kwargs) == expect_kwargs, node.format_node()
    assert "device(type='meta')" in gm.code


def test_factories_methods_and_aten_positional_device() -> None:
    """``device=cpu`` in factories, ``new_*`` methods and an aten overload's positional device are rewritten."""
    def build(graph: torch.fx.Graph, x: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        return (
            graph.call_function(torch.zeros, ((2, 3),), {"device": CPU}),
            graph.call_function(torch.full, ((2,), 1.0), {"device": "cpu"}),
            graph.call_function(torch.ones_like, (x,), {"device": CPU}),
            graph.call_method("new_zeros", (x, (4,)), {"device": CPU}),
            graph.call_function(torch.ops.aten.to.device, (x, CPU, torch.float16)),
        )

    gm = _graph_with(build)
    report = place_on_device(gm, META, ("to",))
    assert report.factory_kwargs == 5 and report.to_calls == 0
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert [n.kwargs.get("device") for n in nodes[:4]] == [META] * 4
    assert nodes[4].args == (nodes[4].args[0], META, torch.float16)
    out = gm(torch.ones(2, 3, device=META))
    assert all(t.device == META for t in out)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.lin(x)
        parts = torch.split(y, 2, dim=-1)  # a tuple-valued node
        total = y.sum().to(x.device)  # 0-dim but computed on the device: not a host scalar
        picked = y.index_select(0, idx.to(x.device)) * (self.eps + 1)
        return parts[0] + total, picked


def test_metadata_moves_through_tuples_with_same_fake_mode_and_symbols() -> None:
    """CPU example values move (tuples too) in the same fake mode with the same symbols; Parameters stay."""
    trace = trace_with(_Model(), (torch.randn(5, 4), torch.tensor([0, 3])),
                       lambda gm, ex: place_on_device(gm, META, ("to",), example_inputs=ex))
    before = {n.name: node_value(n) for n in trace.pristine.graph.nodes}
    for node in trace.gm.graph.nodes:
        old, new = before[node.name], node_value(node)
        for o, t in zip(flat_tensors(old), flat_tensors(new), strict=True):
            if o.dim() == 0 and o.device.type == "cpu" and node.op == "placeholder":
                assert t is o  # the lifted eps: untouched
                continue
            assert t.device == META, node.name
            assert t.fake_mode is o.fake_mode
            assert [str(s) for s in t.shape] == [str(s) for s in o.shape]
            assert t.dtype == o.dtype and isinstance(t, nn.Parameter) == isinstance(o, nn.Parameter)
    assert any(isinstance(s, torch.SymInt) for n in trace.gm.graph.nodes for t in flat_tensors(node_value(n))
               for s in t.shape)
    sums = [n for n in trace.gm.graph.nodes if n.op == "call_method" and n.target == "to"
            and isinstance(node_value(n.args[0]), torch.Tensor) and node_value(n.args[0]).dim() == 0]
    assert sums and all(n.args[1] == META for n in sums)
    out = fake_run_on(META, trace.gm, trace.example_inputs)
    assert all(t.device == META for t in flat_tensors(out))


class _Cond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def yes(x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.ones(4, device=x.device)

        def no(x: torch.Tensor) -> torch.Tensor:
            return (x * 2).to(x.device)

        return torch.cond(x.sum() > 0, yes, no, (x,))


def test_nested_graph_modules_are_rewritten_and_recompiled() -> None:
    """Branches of ``torch.cond`` (nested GraphModules) are rewritten and recompiled too; idempotent."""
    trace = trace_with(_Cond(), (torch.randn(3, 4),),
                       lambda gm, ex: place_on_device(gm, META, ("to",), example_inputs=ex), dynamic=False)
    report = trace.result
    assert report.modules_recompiled == 2 and report.to_calls == 1 and report.factory_kwargs == 1
    children = [m for _, m in trace.gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert len(children) == 2 and all("device(type='cpu')" not in c.code for c in children)
    assert not place_on_device(trace.gm, META, ("to",), example_inputs=trace.example_inputs).changed
    out = fake_run_on(META, trace.gm, trace.example_inputs)  # eager meta cannot read the predicate
    assert flat_tensors(out)[0].device == META


def test_active_backend_target() -> None:
    """With the active backend's device and aliases (as the compile backend passes them); on the CPU backend
    the pass changes nothing. The pass never looks the backend up itself."""
    backend = get_backend()

    def build(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
        return graph.call_method("to", (x, CPU))

    gm = _graph_with(build)
    with pytest.raises(TypeError):
        place_on_device(gm)  # type: ignore[call-arg]
    report = place_on_device(gm, backend.device(), backend.to_method_aliases)
    assert report.device.type == backend.device().type
    if not backend.is_accelerator:
        assert not report.changed and "device(type='cpu')" in gm.code
    else:
        assert report.to_calls == 1


def test_report_counts_and_host_scalar_nodes() -> None:
    """A host scalar's ``.to(cpu)`` and a 0-dim CPU factory stay; the report counts by kind."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    s = graph.placeholder("s")
    s_cpu = graph.call_method("to", (s, CPU))
    z = graph.call_function(torch.tensor, (2.0,), {"device": CPU})
    item = graph.call_method("item", (s_cpu,))
    y = graph.call_function(operator.mul, (x, item))
    graph.output((y, z))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.ones(2)), mode.from_tensor(torch.tensor(3.0)))
    report = place_on_device(gm, META, ("to",))
    assert report.to_calls == 0 and report.factory_kwargs == 0
    assert s_cpu.args[1] == CPU and z.kwargs["device"] == CPU
    assert node_value(y).device == META and node_value(s).device == CPU
    assert report.as_dict()["example_values"] == report.example_values > 0
