"""Small models for the executor tests: tied weights, weightless units, tuple outputs, keyword inputs, a buffer
every layer reads, a graph break."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    """A residual linear layer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class TableLayer(nn.Module):
    """A residual linear layer scaled by a table its caller passes (like a rotary table every block reads)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * table)


class TableStack(nn.Module):
    """A small buffer every layer and the head read: owned by the first layer's unit, used until the last unit."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, d))
        self.layers = nn.ModuleList(TableLayer(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.table)
        return self.head(x * self.table)


class Shuffle(nn.Module):
    """A layer without weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(F.gelu(x), dims=(-1,)) * 0.5


class TiedLM(nn.Module):
    """Embedding and output head share one weight, with layers in between."""

    def __init__(self, vocab: int = 50, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MixedStack(nn.Module):
    """Layers with and without weights."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(d), Shuffle(), Layer(d), Shuffle(), Shuffle(), Layer(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TupleKw(nn.Module):
    """Keyword-only inputs and a tuple output."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + bias
        mid = h
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:
                mid = h
        return h * scale, mid.sum(-1)


class PassThrough(nn.Module):
    """Keyword inputs nested in a dict, a tuple output that passes two inputs through unchanged."""

    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(
        self, x: torch.Tensor, *, extra: dict[str, torch.Tensor], scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x + extra["bias"]
        for layer in self.layers:
            h = layer(h)
        return h * scale, x, extra["skip"]


class Breaks(nn.Module):
    """A forward with a graph break between two layers."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = Layer(d)
        self.b = Layer(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)
