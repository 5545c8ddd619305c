"""Shared pieces of the real-model workloads: which library each needs, float32 modules, regime arithmetic."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

#: Workloads built from library classes, and the library each needs.
LIBRARIES = {"llama8b": "transformers", "wan14b": "diffusers", "flux": "diffusers"}
REAL_WORKLOADS = tuple(LIBRARIES)
#: Presets: full size (accelerators), fewer layers at full width (``--quick``), tiny (the cpu backend).
PRESETS = ("full", "quick", "tiny")
#: Pinned host-to-device bandwidth of an H200 (GB/s) and the effective bf16 rate range (TFLOP/s) of the regime table.
H2D_GBPS = 55.0
TFLOPS_RANGE = (420.0, 570.0)
INSTALL_HINT = "pip install 'magi-core[bench-real]'"


def missing_library(name: str) -> str | None:
    """Why workload ``name`` cannot be built here (its library is not installed), or None."""
    lib = LIBRARIES[name]
    if importlib.util.find_spec(lib) is None:
        return f"{lib} is not installed ({INSTALL_HINT}): the {name} workload is built from its classes"
    return None


def keep_in_fp32(model_cls: type, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """A parameter's dtype as the library's ``from_pretrained(torch_dtype=dtype)`` leaves it.

    Modules named in the class's ``_keep_in_fp32_modules`` stay float32 (diffusers and transformers match a name
    against the dot-separated parts of the parameter name); everything else is ``dtype``.
    """
    keep = tuple(getattr(model_cls, "_keep_in_fp32_modules", None) or ())
    low = dtype in (torch.bfloat16, torch.float16)

    def param_dtype(name: str) -> torch.dtype:
        return torch.float32 if low and any(k in name.split(".") for k in keep) else dtype

    return param_dtype


def regime(flops: float, weight_bytes: int) -> dict[str, Any]:
    """Compute and transfer time of one step on an H200 by the table's arithmetic, and the regime they make."""
    transfer_ms = weight_bytes / (H2D_GBPS * 1e9) * 1e3
    low, high = (flops / (rate * 1e12) * 1e3 for rate in reversed(TFLOPS_RANGE))
    if high < 0.8 * transfer_ms:
        kind = "transfer-bound"
    elif low > 1.25 * transfer_ms:
        kind = "compute-bound"
    else:
        kind = "balanced"
    return {"tflop": flops / 1e12, "compute_ms_h200": [round(low, 1), round(high, 1)],
            "transfer_ms_h200": round(transfer_ms, 1), "regime_h200": kind}
