"""magi-core backend for Moore Threads MUSA: ``torch.musa`` (torch_musa), in-place pinning via the MUSA runtime.

Importing this module neither imports torch_musa nor touches a device: the probe imports
torch_musa (which renames PrivateUse1 to "musa" and installs ``torch.musa``) and every other hook
resolves what it needs when called. The CUDA runtime is never used, even where libcudart or an
adapter such as torchada is present. Profiling ranges are ``torch.profiler.record_function``
spans (MUSA has no NVTX). ``Tensor.to`` can appear as ``orig_to`` in traced graphs because
torch_musa wraps it, hence the aliases ``("to", "orig_to")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from magi_backend_musa import ranges, runtime
from magi_core.plugin import BackendError, ProbeResult, hookimpl

__version__ = "0.1.0"
DEVICE_TYPE = "musa"
PRIORITY = 100


def _unavailable(reason: str, version: str = "none") -> ProbeResult:
    return ProbeResult(available=False, device_type=DEVICE_TYPE, priority=PRIORITY, version=version, reason=reason)


@hookimpl
def magi_probe() -> ProbeResult:
    """MUSA is usable when torch_musa imports and reports a device (``device_count`` only: no device init)."""
    try:
        import torch_musa
    except ImportError:
        return _unavailable("torch_musa is not installed: pip install torch_musa")
    version = str(getattr(torch_musa, "__version__", "unknown"))
    module = getattr(torch, "musa", None)
    if module is None:
        return _unavailable(f"torch_musa {version} imported but torch.musa is missing; reinstall torch_musa", version)
    count = int(module.device_count())
    if count <= 0:
        return _unavailable("no MUSA device visible (check the driver and MUSA_VISIBLE_DEVICES)", version)
    return ProbeResult(available=True, device_type=DEVICE_TYPE, priority=PRIORITY, version=version)


@hookimpl
def magi_hookspec_versions() -> Sequence[str]:
    """Spec major 1."""
    return ("1",)


@hookimpl
def magi_device_module() -> ModuleType:
    """``torch.musa`` (installed by torch_musa)."""
    import torch_musa  # noqa: F401

    module = torch.get_device_module(DEVICE_TYPE)
    if module is None:
        raise BackendError("torch.musa is missing after importing torch_musa; reinstall torch_musa")
    return module


@hookimpl
def magi_host_register(ptr: int, nbytes: int) -> None:
    """``musaHostRegister`` in place; 712 (already registered) is success, other codes raise HostRegisterError."""
    runtime.host_register(ptr, nbytes)


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """``musaHostUnregister``; an unknown range raises HostRegisterError (713)."""
    runtime.host_unregister(ptr)


@hookimpl
def magi_range_push(name: str) -> None:
    """Open a ``torch.profiler.record_function`` range (MUSA has no NVTX)."""
    ranges.push(name)


@hookimpl
def magi_range_pop() -> None:
    """Close the innermost range."""
    ranges.pop()


@hookimpl
def magi_to_method_aliases() -> Sequence[str]:
    """``to`` and ``orig_to``: torch_musa's ``Tensor.to`` wrapper makes Dynamo record ``orig_to``."""
    return ("to", "orig_to")


__all__ = ["DEVICE_TYPE", "PRIORITY", "__version__"]
