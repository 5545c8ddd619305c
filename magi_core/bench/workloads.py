"""Benchmark workloads (the bf16 MLP stack, the synthetic transformer, real library models) and weights.

A :class:`Workload` creates its weights once on the host; every system under test gets a fresh
module whose parameters are new ``nn.Parameter`` objects viewing those shared base tensors, so a
fresh copy costs no memory and no time, and no system can see another's device state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from magi_core.bench.models import SyntheticTransformer, TransformerSpec

#: Elements of the random pool the base weights are tiled from.
POOL_ELEMENTS = (1 << 24) + 4099  # not a multiple of a row length: repeats land shifted


def tile_pool(t: torch.Tensor, tile: torch.Tensor) -> None:
    """Fill ``t`` with ``tile`` repeated: one broadcast copy, which spreads the first touch of new pages over threads
    (a copy per tile is much slower on freshly allocated memory)."""
    flat, period = t.view(-1), tile.numel()
    rows = flat.numel() // period
    if rows:
        flat[:rows * period].view(rows, period).copy_(tile.expand(rows, period))
    rest = flat.numel() - rows * period
    if rest:
        flat[rows * period:].copy_(tile[:rest])


@dataclass(frozen=True)
class MLPShape:
    """Shape of the MLP stack: ``layers`` blocks of ``x + down(gelu(up(x)))``, no bias."""

    hidden: int = 4096
    layers: int = 24
    ffn_mult: int = 4


class MLPBlock(nn.Module):
    """One block of the MLP stack: ``x + down(gelu(up(x)))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual GELU MLP."""
        return x + self.down(F.gelu(self.up(x)))


class MLPStack(nn.Module):
    """The 24-block bf16 MLP stack (hidden 4096, 4x FFN: 6.44 GB); blocks in ``self.blocks``."""

    def __init__(self, shape: MLPShape) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(shape.hidden, shape.ffn_mult * shape.hidden) for _ in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block in order."""
        for block in self.blocks:
            x = block(x)
        return x


#: Positional and keyword arguments of one model call.
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Workload:
    """A named model with its host base weights, a fresh-copy factory and an input factory.

    ``input_shape`` makes one float tensor input (the synthetic models); ``inputs`` (tokens, device, seed) makes
    any call (keyword arguments, integer ids, several tensors) and wins when set. ``buffers`` gives the real values
    of every buffer of the model: a model built on the meta device has none (a rotary ``inv_freq`` computed in
    ``__init__`` would be garbage after ``to_empty``). ``param_dtype`` gives a parameter's dtype by name (a library
    keeping some modules in float32); ``block_prefix`` names the block list (``model.layers`` in transformers) and
    ``more_block_prefixes`` any further block lists, in the order they run (Flux's single-stream blocks).
    """

    name: str
    shape: Any
    dtype: torch.dtype
    build: Callable[[], nn.Module]
    input_shape: Callable[[int], tuple[int, ...]] | None = None
    base: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    inputs: Callable[[int, torch.device, int], Inputs] | None = None
    buffers: Callable[[], dict[str, torch.Tensor]] | None = None
    param_dtype: Callable[[str], torch.dtype] | None = None
    block_prefix: str = "blocks"
    more_block_prefixes: tuple[str, ...] = ()
    tokens: tuple[int, ...] | None = None
    """This workload's token counts (None: the run's)."""
    flops: Callable[[int], float] | None = None
    """Forward FLOPs at a token count (multiply-add = 2), for the regime arithmetic."""
    describe: Callable[[int], dict[str, Any]] | None = None
    """What a token count means for the inputs (e.g. the latent video shape), recorded in the result JSON."""
    buffer_values: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (parameters; buffers are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @property
    def block_prefixes(self) -> tuple[str, ...]:
        """Every block list's prefix, in the order the blocks run."""
        return (self.block_prefix, *self.more_block_prefixes)

    @property
    def block_bytes(self) -> list[int]:
        """Weight bytes of each block (``<prefix>.N`` of every block list), in order; weights outside the blocks
        are not counted."""
        out: list[int] = []
        for prefix in self.block_prefixes:
            sizes: dict[int, int] = {}
            head = prefix + "."
            for name, t in self.base.items():
                if name.startswith(head):
                    index = int(name[len(head):].split(".", 1)[0])
                    sizes[index] = sizes.get(index, 0) + t.numel() * t.element_size()
            out += [sizes[i] for i in sorted(sizes)]
        return out

    @property
    def outside_bytes(self) -> dict[str, int]:
        """Weight bytes outside the blocks, per owning module (``lm_head``, ``model.embed_tokens``, a final norm)."""
        sizes: dict[str, int] = {}
        heads = tuple(prefix + "." for prefix in self.block_prefixes)
        for name, t in self.base.items():
            if not name.startswith(heads):
                owner = name.rpartition(".")[0] or name
                sizes[owner] = sizes.get(owner, 0) + t.numel() * t.element_size()
        return sizes

    def planned_bytes(self) -> int:
        """Bytes the weights take (or will take: from a meta build, nothing allocated)."""
        if self.base:
            return self.weight_bytes
        with torch.device("meta"):
            skeleton = self.build()
        return sum(p.numel() * self.dtype_of(n).itemsize for n, p in skeleton.named_parameters())

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype of parameter ``name``: ``param_dtype(name)`` when given, else the workload's dtype."""
        return self.param_dtype(name) if self.param_dtype is not None else self.dtype

    def materialize_base(self, seed: int = 0) -> None:
        """Create the host base weights once: uniform in +-1/sqrt(fan_in), 1-D weights at one, biases at zero.

        ``fan_in`` is the product of all dimensions but the first (a linear's input width, a convolution's input
        channels times its kernel). Values are tiled from one random pool per bound and dtype at a per-tensor
        offset (a plain copy, so several GB take seconds, not the minutes a seeded ``uniform_`` of every element
        would). The model is built on the meta device; buffers come from ``buffers()`` and must cover every
        buffer of the model.
        """
        if self.base:
            return
        with torch.device("meta"):
            skeleton = self.build()
        self.buffer_values = self._real_buffers(skeleton)
        gen = torch.Generator().manual_seed(seed)
        # a model smaller than the pool (the cpu presets) draws only what its largest weight needs
        period = min(POOL_ELEMENTS, max((p.numel() for p in skeleton.parameters()), default=1))
        noise = torch.empty(2 * period).uniform_(-1.0, 1.0, generator=gen)
        pools: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        base: dict[str, torch.Tensor] = {}
        for i, (name, p) in enumerate(skeleton.named_parameters()):
            dtype = self.dtype_of(name)
            t = torch.empty(p.shape, dtype=dtype)
            if p.dim() <= 1:
                t.fill_(0.0 if name.rsplit(".", 1)[-1] == "bias" else 1.0)
            else:
                fan_in = p.numel() // int(p.shape[0])
                if (fan_in, dtype) not in pools:
                    pools[(fan_in, dtype)] = (noise / math.sqrt(fan_in)).to(dtype)
                offset = (i * 7919) % period
                tile_pool(t, pools[(fan_in, dtype)][offset:offset + period])
            base[name] = t
        self.base = base

    def _real_buffers(self, skeleton: nn.Module) -> dict[str, torch.Tensor]:
        """Every buffer's real value for ``skeleton`` (built on meta), from ``buffers()``; raises if one is missing."""
        names = [name for name, _ in skeleton.named_buffers()]
        values = self.buffers() if self.buffers is not None else {}
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"{self.name}: buffers {missing} have no real value: a model built on the meta device "
                             "holds garbage there; give the workload a buffers() factory that computes them")
        shapes = {n: tuple(b.shape) for n, b in skeleton.named_buffers()}
        wrong = [n for n in names if tuple(values[n].shape) != shapes[n]]
        if wrong:
            raise ValueError(f"{self.name}: buffers {wrong} computed with the wrong shape")
        return {n: values[n] for n in names}

    def fresh(self) -> nn.Module:
        """A new module in eval mode whose parameters view the shared host base weights (no copy).

        Buffers are small copies of their real values (a system may move or replace them).
        """
        self.materialize_base()
        with torch.device("meta"):
            model = self.build()
        persistent = {name for name, _ in model.state_dict(keep_vars=True).items()} - set(self.base)
        state = dict(self.base)
        state.update({name: self.buffer_values[name].clone() for name in persistent})
        model.load_state_dict(state, assign=True, strict=True)
        for name, value in self.buffer_values.items():
            if name not in persistent:
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = value.clone()
        for p in model.parameters():
            p.requires_grad_(False)
        return model.eval()

    def make_input(self, tokens: int, device: torch.device, seed: int = 1) -> torch.Tensor:
        """A deterministic float input of ``tokens`` tokens on ``device`` (workloads with ``input_shape`` only)."""
        if self.input_shape is None:
            raise TypeError(f"{self.name} takes several inputs: use make_inputs()")
        gen = torch.Generator().manual_seed(seed + tokens)
        return torch.randn(self.input_shape(tokens), generator=gen).to(self.dtype).to(device)

    def make_inputs(self, tokens: int, device: torch.device, seed: int = 1) -> Inputs:
        """Deterministic call arguments ``(args, kwargs)`` for ``tokens`` tokens on ``device``."""
        if self.inputs is not None:
            return self.inputs(tokens, device, seed)
        return (self.make_input(tokens, device, seed),), {}

    def release(self) -> None:
        """Drop the host base weights."""
        self.base = {}
        self.buffer_values = {}


def mlp_workload(shape: MLPShape, dtype: torch.dtype) -> Workload:
    """The MLP stack workload (input shape ``(tokens, hidden)``, as in h200_limits.py)."""
    return Workload("mlp", shape, dtype, lambda: MLPStack(shape), lambda t: (t, shape.hidden))


def transformer_workload(spec: TransformerSpec) -> Workload:
    """The synthetic transformer of :mod:`magi_core.bench.models` (input shape ``(1, tokens, hidden)``)."""
    return Workload("transformer", spec, spec.dtype, lambda: SyntheticTransformer(spec), lambda t: (1, t, spec.hidden))


def probe_workload(model: str, accelerator: bool, layers: int | None = None, hidden: int | None = None) -> Workload:
    """The benchmark scripts' workloads: the MLP stack (24 blocks) or the synthetic transformer (8 blocks), at
    full width (bf16) on an accelerator and tiny (float32) on the host, base weights materialised."""
    hidden = hidden or (4096 if accelerator else 64)
    dtype = torch.bfloat16 if accelerator else torch.float32
    if model == "mlp":
        wl = mlp_workload(MLPShape(hidden=hidden, layers=layers or 24, ffn_mult=4), dtype)
    else:
        wl = transformer_workload(TransformerSpec(layers=layers or 8, hidden=hidden, heads=32 if accelerator else 4,
                                                  ffn_mult=3.5, dtype=dtype))
    wl.materialize_base()
    return wl

