"""A synthetic pre-norm transformer (SDPA attention, SwiGLU MLP, RMSNorm with a float eps) for demos and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from magi_core.errors import ConfigError


@dataclass(frozen=True)
class TransformerSpec:
    """Sizes of the synthetic transformer; ``weight_bytes()`` says how large it is before building it."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn_mult: float = 8 / 3
    eps: float = 1e-6
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 1 or self.heads < 1:
            raise ConfigError(f"layers, hidden and heads must be >= 1, got {self.layers}, {self.hidden}, {self.heads}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); change --hidden")
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")

    @property
    def ffn(self) -> int:
        """SwiGLU inner width, rounded up to a multiple of 64."""
        return int(-(-int(self.hidden * self.ffn_mult) // 64) * 64)

    def weight_bytes(self) -> int:
        """Bytes of all weights of a model built from this spec."""
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden
        n = self.layers * per_layer + self.hidden
        return n * torch.empty((), dtype=self.dtype).element_size()


class RMSNorm(nn.Module):
    """Root-mean-square norm whose ``eps`` is a plain Python float (Dynamo may lift it to a 0-dim host tensor)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """Normalise the last dimension in float32 and scale by the weight."""
        e = self.eps if eps is None else eps
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e)
        return y.to(x.dtype) * self.weight


class Attention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the token dimension of ``x`` (batch, tokens, hidden)."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden, spec.eps)
        self.attn = Attention(spec.hidden, spec.heads)
        self.norm2 = RMSNorm(spec.hidden, spec.eps)
        self.mlp = SwiGLU(spec.hidden, spec.ffn)

    def forward(self, x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """Residual attention then residual MLP."""
        x = x + self.attn(self.norm1(x, eps))
        return x + self.mlp(self.norm2(x, eps))


class SyntheticTransformer(nn.Module):
    """A stack of :class:`Block` s with a final norm; input and output are (batch, tokens, hidden)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)

    def forward(self, x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """Run every block, then the final norm; ``eps`` overrides every norm's eps when given."""
        for block in self.blocks:
            x = block(x, eps)
        return self.norm(x, eps)


def build_transformer(spec: TransformerSpec, seed: int = 0) -> SyntheticTransformer:
    """Build the model on the host with deterministic, well-scaled random weights in ``spec.dtype``."""
    gen = torch.Generator().manual_seed(seed)
    model = SyntheticTransformer(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.to(spec.dtype).eval()


def example_input(spec: TransformerSpec, tokens: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    """A deterministic host input of shape (batch, tokens, hidden) in ``spec.dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, spec.hidden, generator=gen).to(spec.dtype)
