"""magi-core backend for NVIDIA CUDA: ``torch.cuda``, in-place pinning via torch's CUDA runtime, NVTX ranges.

Importing this module touches no device; every hook resolves what it needs when called.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import ModuleType

import torch

from magi_backend_cuda import memory, ranges, runtime
from magi_core.plugin import Capabilities, DeviceMemory, ProbeResult, hookimpl

__version__ = "0.1.0"
DEVICE_TYPE = "cuda"
PRIORITY = 100


def _unavailable(reason: str) -> ProbeResult:
    return ProbeResult(
        available=False, device_type=DEVICE_TYPE, priority=PRIORITY, version=torch.version.cuda or "none",
        reason=reason,
    )


@hookimpl
def magi_probe() -> ProbeResult:
    """CUDA is usable when torch is a CUDA build, ``torch.cuda`` is the real one and a device is visible (no init)."""
    if torch.version.cuda is None:
        hip = getattr(torch.version, "hip", None)
        return _unavailable(
            f"torch build has no CUDA (torch {torch.__version__}{', ROCm ' + hip if hip else ''}); "
            "install a CUDA build of torch"
        )
    accel = torch.accelerator.current_accelerator(check_available=False)
    if accel is not None and accel.type != DEVICE_TYPE:
        return _unavailable(f"torch's accelerator is {accel.type!r}, not CUDA; use the {accel.type} backend")
    if torch.cuda.__name__ != "torch.cuda":
        return _unavailable(
            f"torch.cuda is remapped onto {torch.cuda.__name__!r} (an adapter such as torchada); "
            "use the backend of the device it maps to"
        )
    count = torch.cuda.device_count()  # NVML-based where possible: does not initialise CUDA
    if count <= 0:
        return _unavailable("no CUDA device visible (check the driver and CUDA_VISIBLE_DEVICES)")
    return ProbeResult(available=True, device_type=DEVICE_TYPE, priority=PRIORITY, version=torch.version.cuda)


@hookimpl
def magi_hookspec_versions() -> Sequence[str]:
    """Spec major 1 (implements 1.2: ``magi_capabilities``, ``magi_device_memory``, ``magi_limit_device_memory``)."""
    return ("1",)


@hookimpl
def magi_capabilities() -> Capabilities:
    """Inductor units (Triton kernels for CUDA, built into torch's Inductor) called directly; eager without Triton.

    Decided from what is installed (``importlib.util.find_spec("triton")``, which imports nothing): no CUDA call.
    """
    if importlib.util.find_spec("triton") is None:
        return Capabilities(
            reason="Triton is not installed, and torch's Inductor compiles CUDA kernels with it: pip install triton "
            "(CUDA builds of torch depend on it)"
        )
    return Capabilities(inductor=True, default_unit_compiler="inductor", direct_unit_calls=True)


@hookimpl
def magi_device_module() -> ModuleType:
    """``torch.cuda``."""
    return torch.cuda


@hookimpl
def magi_host_register(ptr: int, nbytes: int) -> None:
    """``cudaHostRegister`` in place; 712 (already registered) is success, other codes raise HostRegisterError."""
    runtime.host_register(ptr, nbytes)


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """``cudaHostUnregister``; an unknown range raises HostRegisterError (713)."""
    runtime.host_unregister(ptr)


@hookimpl
def magi_range_push(name: str) -> None:
    """Open an NVTX range (no-op when the torch build has no NVTX)."""
    ranges.push(name)


@hookimpl
def magi_range_pop() -> None:
    """Close the innermost NVTX range (no-op when the torch build has no NVTX)."""
    ranges.pop()


@hookimpl
def magi_device_memory(device_index: int) -> DeviceMemory | None:
    """``torch.cuda.mem_get_info`` plus the allocator's cached unused bytes, within the cap when one is set."""
    return memory.CAP.device_memory(device_index)


@hookimpl
def magi_limit_device_memory(device_index: int, nbytes: int) -> None:
    """``torch.cuda.set_per_process_memory_fraction(nbytes / total, device_index)``; the cap is remembered."""
    memory.CAP.limit(device_index, nbytes)


@hookimpl
def magi_to_method_aliases() -> Sequence[str]:
    """Plain ``Tensor.to``."""
    return ("to",)


__all__ = ["DEVICE_TYPE", "PRIORITY", "__version__"]
