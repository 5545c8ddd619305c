"""Unit tests of :func:`magi_core.passes.split.split_into_units` on graphs Dynamo traces on the CPU."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx
from strategies import inputs_on, trace_with
from torch import nn

from magi_core.errors import MagiError
from magi_core.passes.blocks import module_path_tokens
from magi_core.passes.split import DEFAULT_MAX_UNIT_BYTES, split_into_units
from magi_core.passes.units import SplitGraph
from magi_core.passes.weights import node_value


class Block(nn.Module):
    def __init__(self, dim: int, shared: nn.Parameter | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = 0.5
        self._shared = [shared] if shared is not None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        if self._shared:
            y = y @ self._shared[0].t()
        return x + y


class Net(nn.Module):
    def __init__(self, n: int = 3, dim: int = 8, tie: bool = False, shared: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, dim)
        self.shared = nn.Parameter(torch.randn(dim, dim)) if shared else None
        self.layers = nn.ModuleList(Block(dim, self.shared) for _ in range(n))
        self.head = nn.Linear(dim, 10, bias=False)
        self.reuse = reuse
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        if self.reuse:
            x = self.layers[0](x)
        return self.head(x)


def _split(model: nn.Module, *inputs: Any, **kwargs: Any) -> tuple[SplitGraph, Any, list[Any]]:
    trace = trace_with(model, inputs, lambda gm, ex: split_into_units(gm, ex, **kwargs))
    with torch.no_grad():
        ref = trace.pristine(*inputs_on("cpu", trace.example_inputs))
        out = trace.result.graph_module(*inputs_on("cpu", trace.example_inputs))
    assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
    return trace.result, trace, trace.example_inputs


IDS = torch.tensor([1, 2, 3, 4])


def test_module_path_tokens() -> None:
    """Module paths in every Dynamo spelling become the same names."""
    assert module_path_tokens("L['self'].layers.0") == ("self", "layers", "0")
    assert module_path_tokens("L['self']._modules['layers']._modules['12'].mlp") == ("self", "layers", "12", "mlp")
    assert module_path_tokens("self.blocks[3]") == ("self", "blocks", "3")


def test_one_unit_per_block_with_pre_and_post() -> None:
    """Three blocks give pre, layers.0-2, post; weights map to the unit that uses them."""
    split, _, inputs = _split(Net(3), IDS)
    assert [u.label for u in split.units] == ["pre", "layers.0", "layers.1", "layers.2", "post"]
    assert split.container == "layers" and split.containers == ("layers",)
    assert split.max_unit_bytes == 8 * 8 * 4 + 8 * 4  # automatic: the largest block
    assert [len(u.weights) for u in split.units] == [1, 2, 2, 2, 1]
    for u in split.units[1:4]:
        assert u.nbytes == 8 * 8 * 4 + 8 * 4
        for slot, pos in zip(u.weights, u.weight_arg_positions, strict=True):
            assert u.node.args[pos].op == "placeholder"
            assert isinstance(inputs[slot.input_index], nn.Parameter)
            assert slot.users == (u.index,) and slot.shape in ((8, 8), (8,)) and slot.dtype == torch.float32
    assert split.weight_bytes == sum(w.nbytes for w in split.weights.values())


def test_tied_embedding_reaches_first_and_last_unit() -> None:
    """A tied embedding/head weight is one slot used by the first and the last unit, each as its own arg."""
    split, _, _ = _split(Net(2, tie=True), IDS)
    tied = [w for w in split.weights.values() if len(w.users) > 1]
    assert len(tied) == 1 and tied[0].users == (0, len(split.units) - 1)


def test_weight_used_through_a_view_in_every_block() -> None:
    """``shared.t()`` in every block: each block unit takes ``shared`` itself and computes ``t()`` inside."""
    split, _, _ = _split(Net(3, shared=True), IDS)
    shared = [w for w in split.weights.values() if w.shape == (8, 8) and len(w.users) == 3]
    assert len(shared) == 1
    for u in split.units[1:4]:
        assert shared[0] in u.weights
        assert any(n.op == "call_method" and n.target == "t" for n in u.module.graph.nodes)
    # no unit receives a tensor derived from a weight out of another unit: unit outputs feed only activations
    for u in split.units:
        for arg in u.node.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "call_function":
                producer = arg.args[0]
                assert producer.op == "call_module"


def test_lifted_scalars_pass_through_to_each_unit() -> None:
    """Each block gets the lifted ``scale`` as its own 0-dim input and reads it with ``.item()`` inside."""
    split, trace, inputs = _split(Net(2), IDS)
    phs = list(split.graph_module.graph.find_nodes(op="placeholder"))
    scalars = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor) and v.dim() == 0]
    assert len(scalars) >= 2  # the two block scales (and the embedding's norm_type)
    for i in scalars:
        users = [u for u in split.units if phs[i] in u.node.args]
        assert len(users) == 1
        assert any(n.target == "item" for n in users[0].module.graph.nodes)
        assert i not in split.weights


def test_block_called_twice_gives_two_units_sharing_weights() -> None:
    """A block run twice (shared layers) becomes two units that take the same weights."""
    split, _, _ = _split(Net(2, reuse=True), IDS)
    labels = [u.label for u in split.units]
    assert labels.count("layers.0") == 2
    first = split.units[labels.index("layers.0")]
    for slot in first.weights:
        assert len(slot.users) == 2


def test_budget_merges_and_splits() -> None:
    """``max_unit_bytes`` merges consecutive blocks that fit and cuts a block that does not."""
    block_bytes = 8 * 8 * 4 + 8 * 4
    merged, _, _ = _split(Net(4), IDS, max_unit_bytes=2 * block_bytes)
    assert [u.label for u in merged.units] == ["pre", "layers.0..layers.1", "layers.2..layers.3", "post"]
    assert all(u.nbytes <= 2 * block_bytes for u in merged.units[1:3])
    cut, _, _ = _split(Net(2), IDS, max_unit_bytes=8 * 8 * 4)
    assert len(cut.units) >= len(merged.units)
    with pytest.raises(MagiError, match="max_unit_bytes"):
        split_into_units(torch.fx.symbolic_trace(nn.Linear(2, 2)), max_unit_bytes=0)


class NoBlocks(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, idx) * 2


def test_no_blocks_and_no_weights() -> None:
    """A graph without repeated blocks under the default cap is one unit; a unit without weights is fine."""
    split, _, _ = _split(NoBlocks(), torch.randn(4, 3), torch.tensor([3, 1]))
    assert len(split.units) == 1 and split.units[0].weights == () and split.weights == {}
    assert split.container is None and split.containers == () and split.max_unit_bytes == DEFAULT_MAX_UNIT_BYTES


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.register_buffer("freqs", torch.randn(4))
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        for layer in self.layers:
            x = layer(x) + self.freqs
        return x + self.steps


def test_static_buffers_are_weights_mutated_ones_are_not() -> None:
    """A buffer the graph never writes is a weight slot (``is_buffer``); a mutated buffer stays a plain input."""
    def both(gm: torch.fx.GraphModule, ex: list[Any]) -> tuple[SplitGraph, SplitGraph]:
        from strategies import clone_graph_module

        return split_into_units(clone_graph_module(gm), ex), split_into_units(gm, ex, include_buffers=False)

    model = WithBuffers()
    trace = trace_with(model, (torch.randn(2, 4),), both)
    with_buffers, without = trace.result
    buffers = [w for w in with_buffers.weights.values() if w.is_buffer]
    assert len(buffers) == 1 and buffers[0].shape == (4,) and len(buffers[0].users) == 2
    assert not any(w.is_buffer for w in without.weights.values())
    assert len(without.weights) == len(with_buffers.weights) - 1
    assert model.steps[0].item() == 1  # the trace ran the mutation once


def test_top_level_graph_holds_only_unit_calls() -> None:
    """The top-level graph keeps the inputs (same order) and holds only unit calls, getitems and the output."""
    split, trace, _ = _split(Net(3, tie=True, shared=True), IDS)
    original = [n.name for n in trace.pristine.graph.find_nodes(op="placeholder")]
    top = list(split.graph_module.graph.find_nodes(op="placeholder"))
    assert [node_value(n) for n in top] == [node_value(n) for n in trace.pristine.graph.find_nodes(op="placeholder")]
    assert len(top) == len(original)
    for node in split.graph_module.graph.nodes:
        assert node.op in ("placeholder", "call_module", "output") or node.target is operator.getitem
    assert [u.node for u in split.units] == list(split.graph_module.graph.find_nodes(op="call_module"))
    assert all(u.module is split.graph_module.get_submodule(u.attr) for u in split.units)


class Counted(nn.Module):
    """A cache-like counter: a position read before the counter advances in place, used after other blocks."""

    def __init__(self, n: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        position = torch.arange(x.shape[0]) + length  # pure, from a host scalar and a size
        length.add_(x.shape[0])
        for layer in self.layers:
            x = layer(x)
        return x + position[:, None].to(x.dtype)


def test_a_value_written_in_place_is_read_where_the_graph_reads_it() -> None:
    """A pure node computed from a host value the graph advances in place stays before the write; the split
    would otherwise move it to its first user, after the write, and read the advanced value."""
    model = Counted()
    trace = trace_with(model, (torch.randn(4, 8), torch.tensor(3)), lambda gm, ex: split_into_units(gm, ex))
    assert len(trace.result.units) >= 3

    def run(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, int]:
        inputs = [v.clone() if isinstance(v, torch.Tensor) else v for v in trace.example_inputs]
        length = next(v for v in inputs if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point())
        before = int(length)
        with torch.no_grad():
            out = gm(*inputs_on("cpu", inputs))
        return out[0], int(length) - before

    ref, advanced_ref = run(trace.pristine)
    out, advanced = run(trace.result.graph_module)
    assert advanced == advanced_ref == 4
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
