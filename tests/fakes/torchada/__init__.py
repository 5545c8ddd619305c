"""Test-only torchada-like adapter: remaps ``torch.cuda`` onto ``torch.musa`` (import after ``torch_musa``).

Like the real adapter it makes CUDA-looking code run on MUSA. On top, it arms a trap: its
``torch.cuda.cudart()`` records the call in :data:`CUDA_RUNTIME_CALLS` and raises, standing in for the
CUDA runtime a MUSA host must never use. It also pretends the build has CUDA (``torch.version.cuda``)
so that a CUDA backend's probe has to detect the remap by the module's identity.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch_musa  # noqa: F401  (the adapter needs torch.musa)

#: Every call that reached the trapped CUDA runtime.
CUDA_RUNTIME_CALLS: list[tuple[Any, ...]] = []


class _CudaOnMusa(types.ModuleType):
    """``torch.cuda`` remapped onto ``torch.musa``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.musa, name)


def _cudart() -> Any:
    CUDA_RUNTIME_CALLS.append(("cudart",))
    raise RuntimeError("CUDA runtime called on a MUSA host (torchada emulation trap)")


_shim = _CudaOnMusa("torchada.cuda")
_shim.cudart = _cudart  # type: ignore[attr-defined]
_shim.is_available = torch.musa.is_available  # type: ignore[attr-defined]
_shim.device_count = torch.musa.device_count  # type: ignore[attr-defined]
torch.cuda = _shim  # type: ignore[assignment]
sys.modules["torch.cuda"] = _shim
if torch.version.cuda is None:
    torch.version.cuda = "12.8"  # type: ignore[misc]
