"""What the benchmark reads from a model returned by ``magi_core.offload``: bytes, plan, host weights, release."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from magi_core.bench.workloads import Workload

logger = logging.getLogger(__name__)


def static_info(model: nn.Module, workload: Workload) -> dict[str, Any]:
    """Figures known once set up: pinned host bytes and unit count (None where the runtime does not say)."""
    hw = getattr(model, "_magi_host_weights", None)
    return {
        "pinned_bytes": getattr(hw, "pinned_bytes", None),
        "units": None,
        "resident_bytes": None,
        "streamed_bytes": None,
    }


def step_info(model: nn.Module) -> dict[str, Any]:
    """Figures known after warm-up: resident and streamed bytes per step, units, host overhead (None if unknown)."""
    return {}


def release(model: nn.Module) -> None:
    """Release the model's host weights (unregister and unmap) so nothing is left behind."""
    hw = getattr(model, "_magi_host_weights", None)
    if hw is not None:
        hw.release()
