"""Workloads built from third-party library classes at real shapes: transformers' Llama-3-8B, diffusers' Wan2.1-14B
and FLUX.1-dev (a dual-stream DiT).

Each model is built on the meta device (milliseconds) and filled from the workload's shared host base weights
(:class:`~magi_core.bench.workloads.Workload`); its buffers (rotary tables) are computed on the host by the library's
own code. The libraries are imported only when a workload is built: a missing one makes that workload a clear skip.

Token counts put each model in one regime on an H200, from ``compute = FLOPs / effective rate`` against
``transfer = weight bytes / 55 GB/s`` (pinned H2D). The effective bf16 rate is taken between 420 TFLOP/s (60% of
~700 dense) and 570 TFLOP/s (the rate Wan's 20 layers reach at 8190 tokens: 128 TFLOP in 225 ms); each
count is chosen so its regime holds at both ends (arithmetic in :mod:`.llama`, :mod:`.wan` and :mod:`.flux`):

==========  =========  ===============  ==================  ================================
model       tokens     TFLOP / step     compute ms          transfer ms (55 GB/s)
==========  =========  ===============  ==================  ================================
llama8b     2048       29.7             52-71               292 (16.06 GB): transfer-bound
llama8b     8192       132              231-314             292: balanced
llama8b     16384      299              525-712             292: compute-bound
wan14b/20   2184       29.6             52-71               265 (14.58 GB): transfer-bound
wan14b/20   8190       128              225-305             265: balanced
wan14b/20   16380      310              544-739             265: compute-bound
flux        4096       74.4             130-177             433 (23.80 GB): transfer-bound
flux        8192       165              290-394             433: balanced
flux        16384      418              734-996             433: compute-bound
==========  =========  ===============  ==================  ================================

FLOPs and weight bytes both scale with the layer count, so the regimes hold at 40 Wan layers too.
"""

from __future__ import annotations

import torch

from magi_core.bench.real.common import (
    H2D_GBPS,
    INSTALL_HINT,
    LIBRARIES,
    PRESETS,
    REAL_WORKLOADS,
    TFLOPS_RANGE,
    missing_library,
    regime,
)
from magi_core.bench.workloads import Workload

__all__ = ["H2D_GBPS", "INSTALL_HINT", "LIBRARIES", "PRESETS", "REAL_WORKLOADS", "TFLOPS_RANGE", "default_tokens",
           "missing_library", "real_workload", "regime"]


def default_tokens(name: str, preset: str) -> tuple[int, ...]:
    """Token counts of workload ``name`` at ``preset`` (known without its library)."""
    from magi_core.bench.real import flux, llama, wan

    module = {"llama8b": llama, "wan14b": wan, "flux": flux}[name]
    tokens = module.TOKENS
    return {"full": tokens, "quick": tokens[:1], "tiny": module.TINY_TOKENS}[preset]


def real_workload(name: str, dtype: torch.dtype, preset: str, layers: int | None = None) -> Workload:
    """Workload ``name`` (``llama8b``, ``wan14b`` or ``flux``) at ``preset`` size, with ``layers`` blocks when given
    (Flux: double-stream blocks, and twice as many single-stream ones).

    Its token counts are the preset's: the three regimes at full size, the transfer-bound one with ``quick``, two
    small counts when tiny. Raises :class:`ModuleNotFoundError` when its library is missing (see
    :func:`missing_library`).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if name == "llama8b":
        from magi_core.bench.real import llama

        w = llama.workload(llama.spec(preset, dtype, layers))
    elif name == "wan14b":
        from magi_core.bench.real import wan

        w = wan.workload(wan.spec(preset, dtype, layers))
    elif name == "flux":
        from magi_core.bench.real import flux

        w = flux.workload(flux.spec(preset, dtype, layers))
    else:
        raise ValueError(f"unknown real workload {name!r}; choose from {', '.join(REAL_WORKLOADS)}")
    w.tokens = default_tokens(name, preset)
    return w
