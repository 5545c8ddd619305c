"""Benchmark models (the MLP stack of baselines.md, the synthetic transformer) and their shared host weights.

A :class:`Workload` creates its weights once on the host; every system under test gets a fresh
module whose parameters are new ``nn.Parameter`` objects viewing those shared base tensors, so a
fresh copy costs no memory and no time, and no system can see another's device state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from magi_core.bench.models import SyntheticTransformer, TransformerSpec

#: Elements of the random pool the base weights are tiled from.
POOL_ELEMENTS = (1 << 24) + 4099  # not a multiple of a row length: repeats land shifted


@dataclass(frozen=True)
class MLPShape:
    """Shape of the MLP stack: ``layers`` blocks of ``x + down(gelu(up(x)))``, no bias."""

    hidden: int = 4096
    layers: int = 24
    ffn_mult: int = 4


class MLPBlock(nn.Module):
    """One block of the baselines.md MLP stack: ``x + down(gelu(up(x)))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual GELU MLP."""
        return x + self.down(F.gelu(self.up(x)))


class MLPStack(nn.Module):
    """The 24-block bf16 MLP stack of baselines.md (hidden 4096, 4x FFN); blocks in ``self.blocks``."""

    def __init__(self, shape: MLPShape) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(shape.hidden, shape.ffn_mult * shape.hidden) for _ in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block in order."""
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Workload:
    """A named model with its host base weights, a fresh-copy factory and an input factory."""

    name: str
    shape: MLPShape | TransformerSpec
    dtype: torch.dtype
    build: Callable[[], nn.Module]
    input_shape: Callable[[int], tuple[int, ...]]
    base: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @property
    def block_bytes(self) -> list[int]:
        """Weight bytes of each block (``blocks.N``), in order; weights outside the blocks are not counted."""
        sizes: dict[int, int] = {}
        for name, t in self.base.items():
            parts = name.split(".")
            if parts[0] == "blocks":
                sizes[int(parts[1])] = sizes.get(int(parts[1]), 0) + t.numel() * t.element_size()
        return [sizes[i] for i in sorted(sizes)]

    def materialize_base(self, seed: int = 0) -> None:
        """Create the host base weights once: uniform in +-1/sqrt(fan_in), norms at one.

        Values are tiled from one random pool per bound at a per-tensor offset (a plain copy, so several GB
        take seconds, not the minutes a seeded ``uniform_`` of every element would).
        """
        if self.base:
            return
        with torch.device("meta"):
            skeleton = self.build()
        gen = torch.Generator().manual_seed(seed)
        period = POOL_ELEMENTS
        noise = torch.empty(2 * period).uniform_(-1.0, 1.0, generator=gen)
        pools: dict[int, torch.Tensor] = {}
        base: dict[str, torch.Tensor] = {}
        for i, (name, p) in enumerate(skeleton.named_parameters()):
            t = torch.empty(p.shape, dtype=self.dtype)
            if p.dim() == 1:
                t.fill_(1.0)
            else:
                fan_in = int(p.shape[1])
                if fan_in not in pools:
                    pools[fan_in] = (noise / math.sqrt(fan_in)).to(self.dtype)
                pool, flat = pools[fan_in], t.view(-1)
                offset = (i * 7919) % period
                for start in range(0, flat.numel(), period):
                    n = min(period, flat.numel() - start)
                    flat[start:start + n].copy_(pool[offset:offset + n])
            base[name] = t
        self.base = base

    def fresh(self) -> nn.Module:
        """A new module in eval mode whose parameters view the shared host base weights (no copy)."""
        self.materialize_base()
        with torch.device("meta"):
            model = self.build()
        model.load_state_dict(self.base, assign=True, strict=True)
        for p in model.parameters():
            p.requires_grad_(False)
        return model.eval()

    def make_input(self, tokens: int, device: torch.device, seed: int = 1) -> torch.Tensor:
        """A deterministic input of ``tokens`` tokens on ``device``."""
        gen = torch.Generator().manual_seed(seed + tokens)
        return torch.randn(self.input_shape(tokens), generator=gen).to(self.dtype).to(device)

    def release(self) -> None:
        """Drop the host base weights."""
        self.base = {}


def mlp_workload(shape: MLPShape, dtype: torch.dtype) -> Workload:
    """The MLP stack workload (input shape ``(tokens, hidden)``, as in h200_limits.py)."""
    return Workload("mlp", shape, dtype, lambda: MLPStack(shape), lambda t: (t, shape.hidden))


def transformer_workload(spec: TransformerSpec) -> Workload:
    """The synthetic transformer of :mod:`magi_core.bench.models` (input shape ``(1, tokens, hidden)``)."""
    return Workload("transformer", spec, spec.dtype, lambda: SyntheticTransformer(spec), lambda t: (1, t, spec.hidden))


WORKLOADS = ("mlp", "transformer")
