"""The unit split on models with several stacks of repeated blocks (issue 32): every stack split, units capped.

Generated models (:class:`strategies.StacksSpec`: 1-3 stacks, dual-stream blocks returning tuples, glue with
weights between stacks, a weight shared by two stacks, containers nested in blocks) are checked as properties;
tiny diffusers Flux and UNet and a transformers T5 (random weights, nothing downloaded) as real architectures.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import (
    StackSpec,
    StacksSpec,
    build_stacks_model,
    clone_graph_module,
    inputs_on,
    stacks_inputs,
    stacks_specs,
    trace_with,
)
from test_passes_properties import check_split
from torch import nn

import magi_core.passes.split as split_mod
from magi_core.passes.split import split_into_units
from magi_core.passes.units import OffloadUnit, SplitGraph

#: A third of the profile's examples: each one traces a model with Dynamo (about a second on a CI core).
FEWER = settings(max_examples=max(5, settings.default.max_examples // 3))
BLOCK_LABEL = re.compile(r"^s(\d+)\.(\d+)$")


def _op_weight_bytes(unit: OffloadUnit) -> int:
    """The most weight bytes one op of ``unit`` reads, directly or through ops of weights alone (``w.t()``)."""
    phs = list(unit.module.graph.find_nodes(op="placeholder"))
    nbytes = {phs[pos]: slot.nbytes for slot, pos in zip(unit.weights, unit.weight_arg_positions, strict=True)}
    derived: dict[torch.fx.Node, set[torch.fx.Node]] = {ph: {ph} for ph in nbytes}
    best = 0
    for node in unit.module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        reads = set().union(*(derived.get(i, set()) for i in node.all_input_nodes))
        best = max(best, sum(nbytes[w] for w in reads))
        if node.all_input_nodes and all(i in derived for i in node.all_input_nodes):
            derived[node] = reads
    return best


def check_cap(split: SplitGraph) -> None:
    """No unit over the cap the split used, unless one op alone reads more (then the unit is that op's weights)."""
    cap = split.max_unit_bytes
    assert cap is not None and cap > 0
    for unit in split.units:
        if unit.nbytes > cap:
            assert _op_weight_bytes(unit) == unit.nbytes, f"unit {unit.label} over the cap {cap}: {unit.nbytes}"


def _block_refs(label: str) -> list[tuple[int, int]]:
    """The (stack, block) pairs a label names: ``s1.2``, ``s1.2[1/3]``, ``s0.0..s0.2`` (ends of the run)."""
    refs = []
    for part in re.sub(r"\[\d+/\d+\]", "", label).split(".."):
        m = BLOCK_LABEL.match(part)
        if m:
            refs.append((int(m.group(1)), int(m.group(2))))
    return refs


def _model_bytes(model: nn.Module, spec: StacksSpec) -> tuple[dict[tuple[int, int], int], int]:
    """Each block's weight bytes (the shared weight included where it reads it) and the bytes outside blocks."""
    per_block: dict[tuple[int, int], int] = {}
    in_blocks = 0
    for k, stack in enumerate(spec.stacks):
        for i, block in enumerate(getattr(model, f"s{k}")):
            own = sum(p.nbytes for p in block.parameters())
            in_blocks += own
            per_block[(k, i)] = own + (model.shared.nbytes if stack.shared else 0)
    total = sum(p.nbytes for p in model.parameters())
    return per_block, total - in_blocks


def _auto_and_capped(cap: int) -> Callable[[torch.fx.GraphModule, list[Any]], dict[str, Any]]:
    def run(gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
        return {
            "original": clone_graph_module(gm),
            "auto": split_into_units(clone_graph_module(gm), inputs),
            "capped": split_into_units(gm, inputs, max_unit_bytes=cap),
        }

    return run


TWO_STACKS = StacksSpec(dim=4, batch=2, vocab=5, stacks=(
    StackSpec("dual", 2, nested=True, shared=True, glue="proj"),
    StackSpec("single", 3, shared=True, glue="norm"),
), tie_head=True)
THREE_STACKS = StacksSpec(dim=8, batch=1, vocab=3, stacks=(
    StackSpec("single", 2, glue="cast"), StackSpec("dual", 2, nested=True), StackSpec("single", 2, glue="none"),
), seed=3)


@FEWER
@given(stacks_specs(), st.integers(1, 3000))
@example(TWO_STACKS, 40)
@example(THREE_STACKS, 300)
def test_every_stack_is_split_and_units_are_capped(spec: StacksSpec, cap: int) -> None:
    """Generated multi-stack models, automatic cap and an explicit one: outputs exact, weights exact, caps kept.

    Automatic: one unit per block in graph order, each holding exactly its block's weights, and the cap is the
    largest block. Explicit: blocks cut or merged to the cap, still in graph order and each block in one unit
    or in consecutive pieces; no unit over max(largest block, cap) plus the weights outside blocks.
    """
    model = build_stacks_model(spec)
    trace = trace_with(model, stacks_inputs(spec), _auto_and_capped(cap))
    res, inputs = trace.result, trace.example_inputs
    with torch.no_grad():
        reference = res["original"](*inputs_on("cpu", inputs))
        check_split(res["auto"], res["original"], inputs, reference)
        check_split(res["capped"], res["original"], inputs, reference)
    per_block, outside = _model_bytes(model, spec)
    expected = [(k, i) for k, stack in enumerate(spec.stacks) for i in range(stack.n_blocks)]

    auto: SplitGraph = res["auto"]
    assert auto.containers == tuple(f"s{k}" for k in range(len(spec.stacks)))
    blocks = [u for u in auto.units if BLOCK_LABEL.match(u.label)]
    assert [_block_refs(u.label)[0] for u in blocks] == expected, [u.label for u in auto.units]
    for unit in blocks:
        assert unit.nbytes == per_block[_block_refs(unit.label)[0]], unit.label
    assert auto.max_unit_bytes == max(per_block.values())
    assert all(re.match(r"^(pre|glue|post)(\[\d+/\d+\])?$", u.label) for u in auto.units if u not in blocks)
    check_cap(auto)

    capped: SplitGraph = res["capped"]
    assert capped.max_unit_bytes == cap
    check_cap(capped)
    bound = max(max(per_block.values()), cap) + outside
    assert max(u.nbytes for u in capped.units) <= bound
    refs = [ref for u in capped.units for ref in _block_refs(u.label)]
    assert refs == sorted(refs), [u.label for u in capped.units]
    covered = {ref for u in capped.units for ref in _covered(_block_refs(u.label), expected)}
    assert covered == set(expected)
    for ref in expected:  # a block is one unit, a run of consecutive pieces, or inside one merged run
        holding = [n for n, u in enumerate(capped.units) if ref in _covered(_block_refs(u.label), expected)]
        assert holding == list(range(holding[0], holding[-1] + 1))


def _covered(refs: list[tuple[int, int]], expected: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every block a label's run covers: ``s0.0..s0.2`` covers ``s0.1`` too."""
    if not refs:
        return []
    return list(expected[expected.index(refs[0]) : expected.index(refs[-1]) + 1])


# -- the mechanism, on small hand-made models ---------------------------------------------------------
def _split(model: nn.Module, inputs: Sequence[Any], **kwargs: Any) -> SplitGraph:
    trace = trace_with(model, inputs, lambda gm, ex: split_into_units(gm, ex, **kwargs))
    with torch.no_grad():
        reference = trace.pristine(*inputs_on("cpu", trace.example_inputs))
        check_split(trace.result, trace.pristine, trace.example_inputs, reference)
    check_cap(trace.result)
    return trace.result


class Wide(nn.Module):
    """Blocks of two linears with a nested list of four norms' worth of weights each, and a big ``pre``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pre_a, self.pre_b, self.pre_c, self.pre_d, self.pre_e = (nn.Linear(d, d) for _ in range(5))
        self.layers = nn.ModuleList(Part(d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in (self.pre_a, self.pre_b, self.pre_c, self.pre_d, self.pre_e):
            x = torch.tanh(lin(x))
        for layer in self.layers:
            x = layer(x)
        return x


class Part(nn.Module):
    """A block whose weights sit in a nested ``ModuleList`` of parts, each a linear and a scale."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Scaled(d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = x + part(x)
        return x


class Scaled(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.scale = nn.Parameter(torch.rand(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


X8 = torch.randn(3, 8)


def test_a_big_pre_is_cut_to_the_largest_block() -> None:
    """Glue before the first block holding more than a block is cut into pieces of at most the largest block."""
    split = _split(Wide(), (X8,))
    block = 4 * (8 * 8 + 8) * 4
    assert split.max_unit_bytes == block
    labels = [u.label for u in split.units]
    assert labels[-2:] == ["layers.0", "layers.1"] and all(lbl.startswith("pre[") for lbl in labels[:-2])
    assert len(labels) - 2 == 2  # five linears of 288 bytes: four fit one block's 1152 bytes
    assert all(u.nbytes <= block for u in split.units)


def test_an_explicit_cap_cuts_a_block_along_its_nested_parts_first() -> None:
    """A block over ``max_unit_bytes`` is cut between its parts (a part's linear and scale never split apart)."""
    part = (8 * 8 + 8) * 4
    # two parts and a third part's linear fit the cap, three whole parts do not
    split = _split(Wide(), (X8,), max_unit_bytes=3 * part - 16)
    pieces = [u for u in split.units if u.label.startswith("layers.")]
    assert [u.label for u in pieces] == [f"layers.{b}[{k}/2]" for b in range(2) for k in (1, 2)]
    for unit in pieces:  # node by node, the greedy cut would take a third linear without its scale
        assert unit.nbytes == 2 * part
        assert sorted(w.shape for w in unit.weights) == [(8,), (8,), (8, 8), (8, 8)]


class NoStack(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f = (nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in (self.a, self.b, self.c, self.d, self.e, self.f):
            x = torch.relu(lin(x))
        return x


def test_a_graph_without_blocks_is_cut_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No repeated structure: the automatic cap is :data:`DEFAULT_MAX_UNIT_BYTES`, in topological order."""
    assert _split(NoStack(), (X8,)).units[0].label == "all"  # 1.7 KiB: far under 256 MiB
    linear = (8 * 8 + 8) * 4
    monkeypatch.setattr(split_mod, "DEFAULT_MAX_UNIT_BYTES", 2 * linear)
    split = _split(NoStack(), (X8,))
    assert split.max_unit_bytes == 2 * linear and split.containers == () and split.container is None
    assert [u.label for u in split.units] == ["all[1/3]", "all[2/3]", "all[3/3]"]
    assert [u.nbytes for u in split.units] == [2 * linear] * 3


class Streams(nn.Module):
    """Two stacks; between them a concat of two streams (no weights) and, optionally, a norm with a weight."""

    def __init__(self, d: int = 8, norm_between: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.dual = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.norm = nn.LayerNorm(d) if norm_between else None
        self.single = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(3))
        self.head = nn.Linear(d, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = self.proj(a)
        for blk in self.dual:
            a, b = blk(a) + b, b * 2
        x = torch.cat([a, b])
        if self.norm is not None:
            x = self.norm(x)
        for blk in self.single:
            x = x + blk(x)
        return self.head(x)


@pytest.mark.parametrize("norm_between", [False, True])
def test_glue_between_stacks(norm_between: bool) -> None:
    """Glue with weights between two stacks is a unit of its own; without weights it joins the block before it."""
    split = _split(Streams(norm_between=norm_between), (X8, X8))
    glue = ["glue"] if norm_between else []
    assert [u.label for u in split.units] == [
        "pre", "dual.0", "dual.1", *glue, "single.0", "single.1", "single.2", "post"
    ]
    assert split.containers == ("dual", "single") and split.container == "single"
    assert split.max_unit_bytes == (8 * 8 + 8) * 4


def test_one_unit_keeps_everything_together() -> None:
    """``one_unit``: the whole graph is one unit and no cap applies."""
    trace = trace_with(Streams(), (X8, X8), lambda gm, ex: split_into_units(gm, ex, one_unit=True))
    split = trace.result
    assert [u.label for u in split.units] == ["all"] and split.max_unit_bytes is None


# -- real architectures at tiny sizes (random weights, nothing downloaded) ----------------------------
class Call(nn.Module):
    """Calls ``model`` with keyword arguments and returns its first output (the units' paths start ``model.``)."""

    def __init__(self, model: nn.Module, names: Sequence[str], **fixed: Any) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.fixed = fixed

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, args, strict=True)), **self.fixed)[0]


def _check_real(wrapper: Call, inputs: Sequence[Any], stacks: dict[str, nn.ModuleList]) -> SplitGraph:
    """Split the traced ``wrapper``: each block of ``stacks`` is one unit holding exactly its weights, in order."""
    trace = trace_with(wrapper, inputs, lambda gm, ex: split_into_units(gm, ex), dynamic=False)
    split: SplitGraph = trace.result
    with torch.no_grad():
        reference = trace.pristine(*inputs_on("cpu", trace.example_inputs))
        check_split(split, trace.pristine, trace.example_inputs, reference)
    expected = {f"model.{name}.{i}": block for name, blocks in stacks.items() for i, block in enumerate(blocks)}
    blocks = [u for u in split.units if u.label in expected]
    assert [u.label for u in blocks] == list(expected), [u.label for u in split.units]
    for unit in blocks:
        assert unit.nbytes == sum(p.nbytes for p in expected[unit.label].parameters()), unit.label
    largest_block = max(u.nbytes for u in blocks)
    assert split.max_unit_bytes == largest_block
    assert max(u.nbytes for u in split.units) <= largest_block
    assert tuple(c for c in split.containers if c in {f"model.{n}" for n in stacks}) == tuple(
        f"model.{n}" for n in stacks
    )
    return split


def test_flux_each_dual_and_single_block_is_a_unit() -> None:
    """diffusers Flux (2 dual-stream + 3 single-stream blocks): pre, 5 blocks, post; no unit above one block."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    flux = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=False, axes_dims_rope=(2, 2, 4),
    ).eval()
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")
    inputs = (torch.randn(1, 4, 4), torch.randn(1, 3, 16), torch.randn(1, 8), torch.tensor([0.5]),
              torch.zeros(4, 3), torch.zeros(3, 3))
    split = _check_real(Call(flux, names, return_dict=False), inputs,
                        {"transformer_blocks": flux.transformer_blocks,
                         "single_transformer_blocks": flux.single_transformer_blocks})
    assert [u.label for u in split.units][0] == "pre" and split.units[-1].label == "post" and len(split.units) == 7


def test_t5_encoder_and_decoder_blocks_are_units() -> None:
    """transformers T5 (2 encoder + 2 decoder blocks, tied embedding): pre, encoder, glue, decoder, post."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    inputs = (torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 3)))
    split = _check_real(Call(t5, ("input_ids", "decoder_input_ids"), return_dict=False, use_cache=False), inputs,
                        {"encoder.block": t5.encoder.block, "decoder.block": t5.decoder.block})
    assert [u.label for u in split.units] == [
        "pre", "model.encoder.block.0", "model.encoder.block.1", "glue",
        "model.decoder.block.0", "model.decoder.block.1", "post",
    ]
    tied = [w for w in split.weights.values() if len(w.users) > 1]
    assert tied and all(w.users == (0, 3, 6) for w in tied)  # the shared embedding: both embeds and the head


def test_unet_down_and_up_blocks_are_units() -> None:
    """diffusers UNet2DConditionModel (3 down, mid, 3 up blocks): each down and up block is one unit."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16, 16),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4,
    ).eval()
    inputs = (torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 3, 8))
    split = _check_real(Call(unet, ("sample", "timestep", "encoder_hidden_states"), return_dict=False), inputs,
                        {"down_blocks": unet.down_blocks, "up_blocks": unet.up_blocks})
    labels = [u.label for u in split.units]
    assert labels[0] == "pre" and labels[-1] == "post"
    assert labels[4:6] == ["model.mid_block.resnets.0", "model.mid_block.resnets.1"]  # its attention joins resnet 0
