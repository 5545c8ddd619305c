"""magi-core backend for Moore Threads MUSA: ``torch.musa`` (torch_musa), in-place pinning via the MUSA runtime.

Importing this module neither imports torch_musa nor touches a device: the probe imports
torch_musa (which renames PrivateUse1 to "musa" and installs ``torch.musa``) and every other hook
resolves what it needs when called. The CUDA runtime is never used, even where libcudart or an
adapter such as torchada is present. Profiling ranges are ``torch.profiler.record_function``
spans (MUSA has no NVTX). ``Tensor.to`` can appear as ``orig_to`` in traced graphs because
torch_musa wraps it, hence the aliases ``("to", "orig_to")``. Units are compiled with Inductor only where
torch_musa ships its Inductor backend and Triton for MUSA is installed (:func:`magi_capabilities`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

import torch

from magi_backend_musa import ranges, runtime
from magi_core.plugin import BackendError, Capabilities, DeviceMemory, FractionCap, ProbeResult, hookimpl

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
    """Spec major 1 (implements 1.2: ``magi_capabilities``, ``magi_device_memory``, ``magi_limit_device_memory``)."""
    return ("1",)


def _has_module(name: str) -> bool:
    """True when ``name`` is importable, decided without importing it (False when its parent cannot be found)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _inductor_registered() -> bool:
    """True when torch's Inductor already has a code generator for "musa" (read only where Inductor is imported)."""
    common = sys.modules.get("torch._inductor.codegen.common")
    get = getattr(common, "get_scheduling_for_device", None)
    return callable(get) and get(DEVICE_TYPE) is not None


@hookimpl
def magi_capabilities() -> Capabilities:
    """Inductor units where torch_musa ships its Inductor backend and Triton for MUSA is installed; else eager.

    torch_musa registers its Inductor backend ("musa": ``MUSATritonScheduling``) lazily, from its patched
    ``init_backend_registration``; the check looks for that backend (``torch_musa._init_inductor_backend_registration``
    or the ``torch_musa._inductor`` package) and for Triton (``importlib.util.find_spec("triton")``) without
    importing Triton or calling the MUSA runtime, so nothing initialises the device. Direct unit calls stay off:
    calling torch_musa's generated code without its wrappers has not been verified on MUSA hardware.
    """
    try:
        import torch_musa
    except ImportError:
        return Capabilities(reason="torch_musa is not installed: pip install torch_musa")
    version = str(getattr(torch_musa, "__version__", "unknown"))
    ships_inductor = callable(getattr(torch_musa, "_init_inductor_backend_registration", None)) or _has_module(
        "torch_musa._inductor"
    )
    if not (ships_inductor or _inductor_registered()):
        return Capabilities(reason=f"torch_musa {version} has no Inductor backend (torch_musa._inductor); upgrade "
                                   "torch_musa for Inductor units, or use unit_compiler='eager'")
    if not _has_module("triton"):
        return Capabilities(reason=f"Triton for MUSA is not installed (torch_musa {version}'s Inductor backend "
                                   "generates Triton kernels): install the triton build that matches torch_musa")
    return Capabilities(inductor=True, default_unit_compiler="inductor", direct_unit_calls=False)


@hookimpl
def magi_device_module() -> ModuleType:
    """``torch.musa`` (installed by torch_musa)."""
    import torch_musa  # noqa: F401

    module = torch.get_device_module(DEVICE_TYPE)
    if module is None:
        raise BackendError("torch.musa is missing after importing torch_musa; reinstall torch_musa")
    return module


def _musa_module() -> ModuleType:
    """``torch.musa``, looked up when a device-memory hook runs (after selection imported torch_musa)."""
    module = torch.get_device_module(DEVICE_TYPE)
    if module is None:
        raise BackendError("torch.musa is missing; import torch_musa (selecting the musa backend does)")
    return module


#: torch_musa mirrors torch.cuda's allocator API: mem_get_info, memory_reserved / memory_allocated and, in releases
#: that have it (torch_musa/core/memory.py), set_per_process_memory_fraction; where it lacks the setter the cap is
#: refused with an error naming it.
_CAP = FractionCap(DEVICE_TYPE, _musa_module)


@hookimpl
def magi_device_memory(device_index: int) -> DeviceMemory | None:
    """``torch.musa.mem_get_info`` plus the allocator's cached unused bytes, within the cap when one is set."""
    return _CAP.device_memory(device_index)


@hookimpl
def magi_limit_device_memory(device_index: int, nbytes: int) -> None:
    """``torch.musa.set_per_process_memory_fraction(nbytes / total, device_index)`` where torch_musa has it."""
    _CAP.limit(device_index, nbytes)


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
