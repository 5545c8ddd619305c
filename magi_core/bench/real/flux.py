"""diffusers' ``FluxTransformer2DModel`` at the FLUX.1-dev shape: one denoising step of a dual-stream DiT.

FLUX.1-dev: 19 double-stream blocks (image and text tokens each through their own weights, attending jointly) and
38 single-stream blocks (the concatenated sequence through one fused block), width 3072 (24 heads of 128), MLP
ratio 4, 64 packed latent channels in (16 VAE channels in 2x2 patches), T5 text width 4096 (512 tokens), pooled
CLIP width 768, guidance embedding, rotary axes (16, 56, 56); 11.90 B parameters, 23.80 GB in bf16 (no float32
modules). The call is ``model(hidden_states=(1, T, 64), encoder_hidden_states=(1, 512, 4096),
pooled_projections=(1, 768), timestep=(1,), img_ids=(T, 3), txt_ids=(512, 3), guidance=(1,))`` as
``FluxPipeline`` makes it (timestep in [0, 1], guidance 3.5, image ids the packed latent's row and column, text ids
zero); the output compared is ``sample``.

``T`` image tokens are a latent of ``h x w`` packed patches, the factorisation closest to square (:func:`grid`):
4096 = 64 x 64 (a 1024 x 1024 image), 8192 = 64 x 128 (1024 x 2048), 16384 = 128 x 128 (2048 x 2048).

FLOPs of one step with ``N = T + S`` tokens (S 512 text tokens, d 3072, 57 blocks): every block runs
``12 d^2`` per token in its linears (double: q k v, output and a 4x MLP per stream; single: fused q k v + MLP in,
attention + MLP out) and joint attention ``4 d N^2``; plus the embedders and the output projection. At 23.80 GB
(433 ms to stream at 55 GB/s):

- 4096 tokens: 74.4 TFLOP, 130-177 ms at 570-420 TFLOP/s, against 433 ms: transfer-bound.
- 8192 tokens: 165 TFLOP, 290-394 ms against 433 ms: balanced.
- 16384 tokens: 418 TFLOP, 734-996 ms against 433 ms: compute-bound (1.7-2.3x the copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from magi_core.bench.real.common import keep_in_fp32
from magi_core.bench.workloads import Inputs, Workload

#: Regime token counts on accelerators (transfer-bound, balanced, compute-bound) and on the cpu backend.
TOKENS = (4096, 8192, 16384)
TINY_TOKENS = (16, 64)
#: Timestep (the scheduler's sigma in [0, 1]; the model multiplies by 1000) and guidance scale of every call.
TIMESTEP = 0.5
GUIDANCE = 3.5
#: Pixels per packed latent token along each side (VAE factor 8, then 2x2 patches).
PIXELS_PER_TOKEN = 16


@dataclass(frozen=True)
class FluxSpec:
    """Sizes of the Flux transformer; the defaults are FLUX.1-dev's."""

    double_layers: int = 19
    single_layers: int = 38
    heads: int = 24
    head_dim: int = 128
    in_channels: int = 64
    joint_dim: int = 4096
    pooled_dim: int = 768
    text_len: int = 512
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    guidance_embeds: bool = True
    dtype: torch.dtype = torch.bfloat16

    @property
    def width(self) -> int:
        """Model width (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def layers(self) -> int:
        """Blocks of both kinds (double-stream first)."""
        return self.double_layers + self.single_layers

    def flops(self, tokens: int) -> float:
        """Forward FLOPs of one denoising step over ``tokens`` image tokens (and the text tokens)."""
        d, t, s = self.width, tokens, self.text_len
        n = t + s
        per_block = 2.0 * n * 12 * d * d + 4.0 * d * n * n
        embed = 2.0 * t * d * 2 * self.in_channels + 2.0 * s * self.joint_dim * d
        return self.layers * per_block + embed

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of ``FluxTransformer2DModel``."""
        return {"patch_size": 1, "in_channels": self.in_channels, "num_layers": self.double_layers,
                "num_single_layers": self.single_layers, "attention_head_dim": self.head_dim,
                "num_attention_heads": self.heads, "joint_attention_dim": self.joint_dim,
                "pooled_projection_dim": self.pooled_dim, "guidance_embeds": self.guidance_embeds,
                "axes_dims_rope": self.axes_dims_rope}


#: Tiny model for the cpu backend: both block kinds, joint attention, rotary over the three axes, guidance.
TINY = FluxSpec(double_layers=2, single_layers=4, heads=2, head_dim=16, in_channels=16, joint_dim=32, pooled_dim=16,
                text_len=8, axes_dims_rope=(4, 6, 6))


def spec(preset: str, dtype: torch.dtype, layers: int | None = None) -> FluxSpec:
    """The spec of a preset: full (FLUX.1-dev), quick (2 + 4 blocks at full width) or tiny.

    ``layers`` sets the double-stream blocks, and twice as many single-stream ones (FLUX.1's proportion).
    """
    base = {"full": FluxSpec(), "quick": replace(FluxSpec(), double_layers=2, single_layers=4), "tiny": TINY}[preset]
    if layers is not None:
        base = replace(base, double_layers=layers, single_layers=2 * layers)
    return replace(base, dtype=dtype)


def grid(tokens: int) -> tuple[int, int]:
    """Packed latent rows and columns holding ``tokens`` image tokens: the factorisation closest to square."""
    rows = max(h for h in range(1, math.isqrt(tokens) + 1) if tokens % h == 0)
    return rows, tokens // rows


def image_ids(tokens: int) -> torch.Tensor:
    """``img_ids`` as ``FluxPipeline._prepare_latent_image_ids`` makes them: (0, row, column) per token."""
    h, w = grid(tokens)
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def workload(s: FluxSpec) -> Workload:
    """The ``flux`` workload of ``s`` (needs diffusers)."""
    from diffusers import FluxTransformer2DModel

    kwargs = s.kwargs()
    model_cls: Any = FluxTransformer2DModel  # typed loosely: diffusers' stubs vary by version

    def build() -> nn.Module:
        model: nn.Module = model_cls(**kwargs)
        return model

    def inputs(tokens: int, device: torch.device, seed: int) -> Inputs:
        gen = torch.Generator().manual_seed(seed + tokens)
        latents = torch.randn(1, tokens, s.in_channels, generator=gen).to(s.dtype)
        text = torch.randn(1, s.text_len, s.joint_dim, generator=gen).to(s.dtype)
        pooled = torch.randn(1, s.pooled_dim, generator=gen).to(s.dtype)
        call = {"hidden_states": latents, "encoder_hidden_states": text, "pooled_projections": pooled,
                "timestep": torch.full((1,), TIMESTEP, dtype=s.dtype),
                "img_ids": image_ids(tokens).to(s.dtype), "txt_ids": torch.zeros(s.text_len, 3, dtype=s.dtype)}
        if s.guidance_embeds:
            call["guidance"] = torch.full((1,), GUIDANCE, dtype=torch.float32)
        return (), {k: v.to(device) for k, v in call.items()}

    def describe(tokens: int) -> dict[str, Any]:
        h, w = grid(tokens)
        return {"hidden_states": [1, tokens, s.in_channels], "latent_grid": [h, w],
                "image_px": [h * PIXELS_PER_TOKEN, w * PIXELS_PER_TOKEN],
                "encoder_hidden_states": [1, s.text_len, s.joint_dim], "timestep": TIMESTEP, "guidance": GUIDANCE}

    return Workload("flux", s, s.dtype, build, inputs=inputs, buffers=dict,
                    param_dtype=keep_in_fp32(FluxTransformer2DModel, s.dtype), block_prefix="transformer_blocks",
                    more_block_prefixes=("single_transformer_blocks",), flops=s.flops, describe=describe)
