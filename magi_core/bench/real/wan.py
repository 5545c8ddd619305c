"""diffusers' ``WanTransformer3DModel`` at the Wan2.1-14B block shape: one denoising step of a latent video.

Wan2.1-T2V-14B: 40 heads of 128 (width 5120), FFN 13824, 16 latent channels in and out, patch (1, 2, 2), text width
4096 (512 umT5 tokens), time frequency width 256, cross-attention norm, RMS qk-norm across heads, eps 1e-6; 40 layers
in the real model, 20 by default here (14.5 GB in bf16). Parameters are stored as
``from_pretrained(torch_dtype=bf16)`` leaves them: the class's ``_keep_in_fp32_modules`` (time embedder,
modulation tables, norms) in float32. The call is ``model(hidden_states=(1, 16, F, H, W), timestep=(1,) int64,
encoder_hidden_states=(1, 512, 4096))`` as the Wan pipeline makes it; the output compared is ``sample``.

A token count ``T = F * H/2 * W/2`` is laid out as 21 latent frames (81 video frames) when 21 divides it, at the
spatial factorisation closest to 16:9 (:func:`latent_shape`): 2184 = 21 x 8 x 13 (latents 16 x 26, 128 x 208 px),
8190 = 21 x 15 x 26 (30 x 52, 240 x 416 px: the balanced case), 16380 = 21 x 20 x 39 (40 x 78, 320 x 624 px);
a 480p video is 32760 = 21 x 30 x 52.

FLOPs of one step at ``T`` tokens per layer (d 5120, f 13824, text length S 512): linear
``2 T (6 d^2 + 2 d f)`` (self-attention q k v o, cross-attention q o, FFN), self-attention ``4 d T^2``,
cross-attention ``4 d T S``, cross-attention k v of the text ``4 S d^2``; plus the embedders and the output
projection. At 20 layers (14.58 GB, 265 ms to stream at 55 GB/s):

- 2184 tokens: 29.6 TFLOP, 52-71 ms at 570-420 TFLOP/s, against 265 ms: transfer-bound.
- 8190 tokens: 128 TFLOP, 225-305 ms against 265 ms: balanced.
- 16380 tokens: 310 TFLOP, 544-739 ms against 265 ms: compute-bound (2.1-2.8x the copy).
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
TOKENS = (2184, 8190, 16380)
TINY_TOKENS = (16, 64)
#: Latent frames of an 81-frame video (the Wan default), used when they divide the token count.
LATENT_FRAMES = 21
#: Timestep of every call (the scheduler's timesteps are int64 in [0, 1000)).
TIMESTEP = 500


@dataclass(frozen=True)
class WanSpec:
    """Sizes of the Wan transformer; the defaults are Wan2.1-14B's blocks with 20 layers."""

    layers: int = 20
    heads: int = 40
    head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    ffn_dim: int = 13824
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    dtype: torch.dtype = torch.bfloat16

    @property
    def width(self) -> int:
        """Model width (heads x head_dim)."""
        return self.heads * self.head_dim

    def flops(self, tokens: int) -> float:
        """Forward FLOPs of one denoising step over ``tokens`` video tokens."""
        d, t, s = self.width, tokens, self.text_len
        per_layer = 2.0 * t * (6 * d * d + 2 * d * self.ffn_dim) + 4.0 * d * t * t + 4.0 * d * t * s + 4.0 * s * d * d
        patch = math.prod(self.patch_size)
        embed = 2.0 * s * (self.text_dim * d + d * d) + 2.0 * t * d * (self.in_channels + self.out_channels) * patch
        return self.layers * per_layer + embed

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of ``WanTransformer3DModel``."""
        return {"patch_size": self.patch_size, "num_attention_heads": self.heads, "attention_head_dim": self.head_dim,
                "in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.layers,
                "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": self.eps,
                "rope_max_seq_len": self.rope_max_seq_len}


#: Tiny model for the cpu backend: every code path of the real one (rotary over frames/height/width, modulation,
#: cross-attention, qk-norm, float32 modules). Head dim 24 splits into 8 + 8 + 8 rotary channels.
TINY = WanSpec(layers=6, heads=2, head_dim=24, in_channels=4, out_channels=4, text_dim=32, text_len=8, freq_dim=16,
               ffn_dim=96, rope_max_seq_len=64)


def spec(preset: str, dtype: torch.dtype, layers: int | None = None) -> WanSpec:
    """The spec of a preset: full (14B blocks, 20 layers), quick (4 layers) or tiny; ``layers`` overrides."""
    base = {"full": WanSpec(), "quick": WanSpec(layers=4), "tiny": TINY}[preset]
    return replace(base, dtype=dtype, layers=layers if layers is not None else base.layers)


def latent_shape(tokens: int, patch_size: tuple[int, int, int] = (1, 2, 2)) -> tuple[int, int, int]:
    """Latent (frames, height, width) with ``tokens`` patches: 21 frames when possible, the rest closest to 16:9.

    The frame count is the largest divisor of ``tokens`` up to 21 that leaves at least as many patches per frame.
    """
    frames = max(f for f in range(1, LATENT_FRAMES + 1) if tokens % f == 0 and tokens // f >= f)
    area = tokens // frames
    pairs = [(h, area // h) for h in range(1, math.isqrt(area) + 1) if area % h == 0]
    h, w = min(pairs, key=lambda p: abs(p[1] / p[0] - 16 / 9))
    pt, ph, pw = patch_size
    return frames * pt, h * ph, w * pw


def workload(s: WanSpec) -> Workload:
    """The ``wan14b`` workload of ``s`` (needs diffusers)."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    kwargs = s.kwargs()
    model_cls: Any = WanTransformer3DModel  # typed loosely: diffusers' stubs vary by version

    def build() -> nn.Module:
        model: nn.Module = model_cls(**kwargs)
        return model

    def buffers() -> dict[str, torch.Tensor]:
        # computed by diffusers' own rotary init, on the host (a meta build leaves them empty)
        rope = WanRotaryPosEmbed(s.head_dim, s.patch_size, s.rope_max_seq_len)
        return {f"rope.{n}": b for n, b in rope.named_buffers()}

    def inputs(tokens: int, device: torch.device, seed: int) -> Inputs:
        gen = torch.Generator().manual_seed(seed + tokens)
        f, h, w = latent_shape(tokens, s.patch_size)
        latents = torch.randn(1, s.in_channels, f, h, w, generator=gen).to(s.dtype)
        text = torch.randn(1, s.text_len, s.text_dim, generator=gen).to(s.dtype)
        timestep = torch.full((1,), TIMESTEP, dtype=torch.int64)
        return (), {"hidden_states": latents.to(device), "timestep": timestep.to(device),
                    "encoder_hidden_states": text.to(device)}

    def describe(tokens: int) -> dict[str, Any]:
        f, h, w = latent_shape(tokens, s.patch_size)
        return {"hidden_states": [1, s.in_channels, f, h, w], "encoder_hidden_states": [1, s.text_len, s.text_dim],
                "timestep": TIMESTEP}

    return Workload("wan14b", s, s.dtype, build, inputs=inputs, buffers=buffers,
                    param_dtype=keep_in_fp32(WanTransformer3DModel, s.dtype), block_prefix="blocks", flops=s.flops,
                    describe=describe)
