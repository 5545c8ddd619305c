"""transformers' ``LlamaForCausalLM`` at the Llama-3-8B shape: a prefill of ``tokens`` token ids (batch 1).

Llama-3-8B: hidden 4096, 32 layers, SwiGLU 14336, 32 query / 8 key-value heads (GQA, head dim 128), vocab 128256,
RMSNorm eps 1e-5, rope_theta 500000, untied LM head; 8.03 B parameters, 16.06 GB in bf16. The call is
``model(input_ids=ids, logits_to_keep=1)`` with ``use_cache=False`` and SDPA attention: a prefill as
``generate`` runs it (logits of the last position only; no KV cache returned). The output compared across systems
is ``logits`` (1, 1, 128256).

FLOPs of one step at ``T`` tokens (multiply-add = 2):
linear ``2 T L (2 h^2 + 2 h kv + 3 h f)`` = 13.96 GFLOP per token (h 4096, kv 1024, f 14336, L 32), causal
attention ``2 h T^2 L`` (QK^T and PV over half the pairs), LM head ``2 h V`` for one position (1 GFLOP).

- 2048 tokens: 28.6 + 1.1 = 29.7 TFLOP, 52-71 ms at 570-420 TFLOP/s, against 292 ms to stream 16.06 GB at
  55 GB/s: transfer-bound (compute hides under a quarter of the copy).
- 8192 tokens: 114.3 + 17.6 = 132 TFLOP, 231-314 ms against 292 ms: balanced.
- 16384 tokens: 228.7 + 70.4 = 299 TFLOP, 525-712 ms against 292 ms: compute-bound (1.8-2.4x the copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from magi_core.bench.real.common import keep_in_fp32
from magi_core.bench.workloads import Inputs, Workload

#: Regime token counts on accelerators (transfer-bound, balanced, compute-bound) and on the cpu backend.
TOKENS = (2048, 8192, 16384)
TINY_TOKENS = (16, 64)


@dataclass(frozen=True)
class LlamaSpec:
    """Sizes of the Llama model; the defaults are Llama-3-8B's."""

    hidden: int = 4096
    layers: int = 32
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_positions: int = 8192
    logits_to_keep: int = 1
    """Positions whose logits are computed (0: all; 1: the last, as ``generate``'s prefill)."""
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def flops(self, tokens: int) -> float:
        """Forward FLOPs of one prefill of ``tokens`` tokens."""
        h, kv, t = self.hidden, self.kv_heads * self.head_dim, tokens
        linear = 2.0 * t * self.layers * (2 * h * h + 2 * h * kv + 3 * h * self.intermediate)
        attention = 2.0 * h * t * t * self.layers
        kept = t if self.logits_to_keep == 0 else min(self.logits_to_keep, t)
        return linear + attention + 2.0 * h * self.vocab * kept


#: Tiny model for the cpu backend: every code path of the real one (GQA, rotary, SwiGLU, RMSNorm, LM head).
TINY = LlamaSpec(hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2, vocab=256)


def spec(preset: str, dtype: torch.dtype, layers: int | None = None) -> LlamaSpec:
    """The spec of a preset: full (Llama-3-8B), quick (4 layers at full width) or tiny; ``layers`` overrides."""
    base = {"full": LlamaSpec(), "quick": LlamaSpec(layers=4), "tiny": TINY}[preset]
    return replace(base, dtype=dtype, layers=layers if layers is not None else base.layers)


def config(s: LlamaSpec) -> Any:
    """The transformers ``LlamaConfig`` of ``s``."""
    from transformers import LlamaConfig

    config_cls: Any = LlamaConfig  # typed loosely: transformers 4.x and 5.x differ in their stubs
    cfg = config_cls(
        hidden_size=s.hidden, num_hidden_layers=s.layers, intermediate_size=s.intermediate,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab, rope_theta=s.rope_theta,
        rms_norm_eps=s.rms_eps, max_position_embeddings=s.max_positions, tie_word_embeddings=False, use_cache=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", attn_implementation="sdpa",
    )
    # transformers 5 keeps the base in rope_parameters, 4.x in rope_theta: make sure it took either way
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta != s.rope_theta:
        raise ValueError(f"LlamaConfig did not take rope_theta={s.rope_theta} (it holds {theta}): this transformers "
                         "version names it differently")
    return cfg


def workload(s: LlamaSpec) -> Workload:
    """The ``llama8b`` workload of ``s`` (needs transformers)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = config(s)
    model_cls: Any = LlamaForCausalLM

    def build() -> nn.Module:
        model: nn.Module = model_cls(cfg)
        return model

    def buffers() -> dict[str, torch.Tensor]:
        # computed by transformers' own rotary init, on the host (a meta build leaves them empty)
        rotary = LlamaRotaryEmbedding(config=cfg)
        return {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}

    def inputs(tokens: int, device: torch.device, seed: int) -> Inputs:
        gen = torch.Generator().manual_seed(seed + tokens)
        ids = torch.randint(0, s.vocab, (1, tokens), generator=gen).to(device)
        return (), {"input_ids": ids, "logits_to_keep": s.logits_to_keep}

    def describe(tokens: int) -> dict[str, Any]:
        return {"input_ids": [1, tokens], "logits_to_keep": s.logits_to_keep}

    return Workload("llama8b", s, s.dtype, build, inputs=inputs, buffers=buffers,
                    param_dtype=keep_in_fp32(LlamaForCausalLM, s.dtype), block_prefix="model.layers",
                    flops=s.flops, describe=describe)
