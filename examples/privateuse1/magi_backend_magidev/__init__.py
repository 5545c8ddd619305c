"""magi-core backend for the emulated ``magidev`` device (torch_magidev), written from the backend author's guide
(``docs/backends/writing.md``).

Importing this module imports neither torch_magidev nor touches a device. The probe only asks whether
torch_magidev is installed (``importlib.util.find_spec``: importing it would rename PrivateUse1, and a
process must be able to probe every installed backend without that); ``magi_device_module`` imports it
when this backend is selected. Priority -5, below the CPU backend's 0: an emulated device is used only
when asked for by name (``MAGI_BACKEND=magidev``, ``use_backend("magidev")``, ``--magi-backend=magidev``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from magi_core.plugin import BackendError, Capabilities, DeviceMemory, HostRangeTable, ProbeResult, hookimpl

DEVICE_TYPE = "magidev"
#: Below the CPU backend (0): only selected by name.
PRIORITY = -5


def _version() -> str:
    try:
        return importlib.metadata.version("magi-backend-magidev")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@hookimpl
def magi_probe() -> ProbeResult:
    """Available when torch_magidev is installed and ``MAGIDEV_DEVICE_COUNT`` is not 0 (nothing imported)."""
    if importlib.util.find_spec("torch_magidev") is None:
        return ProbeResult(available=False, device_type=DEVICE_TYPE, priority=PRIORITY, version="none",
                           reason="torch_magidev is not installed: pip install ./examples/privateuse1")
    version = _version()
    if os.environ.get("MAGIDEV_DEVICE_COUNT", "").strip() == "0":
        return ProbeResult(available=False, device_type=DEVICE_TYPE, priority=PRIORITY, version=version,
                           reason="no magidev device visible (MAGIDEV_DEVICE_COUNT=0)")
    return ProbeResult(available=True, device_type=DEVICE_TYPE, priority=PRIORITY, version=version)


@hookimpl
def magi_hookspec_versions() -> Sequence[str]:
    """Spec major 1."""
    return ("1",)


@hookimpl
def magi_device_module() -> ModuleType:
    """``torch.magidev``: importing torch_magidev renames PrivateUse1 and installs it (nothing initialised)."""
    import torch_magidev  # noqa: F401

    return torch.get_device_module(DEVICE_TYPE)


def _runtime() -> Any:
    """The runtime's bindings, looked up when a range is (un)registered, never at import."""
    return torch.get_device_module(DEVICE_TYPE).runtime()


_TABLE = HostRangeTable(
    "magidev",
    register=lambda ptr, nbytes: _runtime().magidevHostRegister(ptr, nbytes, 0),
    unregister=lambda ptr: _runtime().magidevHostUnregister(ptr),
    error_text=lambda err: _runtime().magidevGetErrorString(err),
    clear_error=lambda: _runtime().magidevGetLastError(),
)


@hookimpl
def magi_host_register(ptr: int, nbytes: int) -> None:
    """``magidevHostRegister`` in place; 712 (already registered) is success, other codes raise HostRegisterError."""
    _TABLE.register(ptr, nbytes)


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """``magidevHostUnregister``; a range not registered here raises HostRegisterError (713)."""
    _TABLE.unregister(ptr)


_ranges = threading.local()


@hookimpl
def magi_range_push(name: str) -> None:
    """Open a ``torch.profiler.record_function`` span (shows in ``torch.profiler`` traces)."""
    span = torch.profiler.record_function(name)
    span.__enter__()
    stack = getattr(_ranges, "stack", None)
    if stack is None:
        stack = _ranges.stack = []
    stack.append(span)


@hookimpl
def magi_range_pop() -> None:
    """Close the innermost span opened by ``magi_range_push`` on this thread."""
    stack = getattr(_ranges, "stack", None)
    if not stack:
        raise BackendError("magi_range_pop: no range is open on this thread (a pop without its push)")
    stack.pop().__exit__(None, None, None)


@hookimpl
def magi_capabilities() -> Capabilities:
    """Eager units, wrapped calls: torch's Inductor has no code generator for magidev (decided without the device)."""
    return Capabilities(reason="torch's Inductor has no code generator for magidev: units run eagerly")


@hookimpl
def magi_device_memory(device_index: int) -> DeviceMemory | None:
    """``torch.magidev.mem_get_info``: the device's capacity (the process's cap, when set) and what is left of it.

    magidev has no caching allocator (a freed block is released at once), so nothing cached is added to free.
    """
    free, total = torch.get_device_module(DEVICE_TYPE).mem_get_info(device_index)
    return DeviceMemory(free=int(free), total=int(total))


@hookimpl
def magi_limit_device_memory(device_index: int, nbytes: int) -> None:
    """``torch.magidev.set_per_process_memory_fraction(nbytes / total)``: past it allocations raise OutOfMemoryError."""
    module = torch.get_device_module(DEVICE_TYPE)
    total = int(module.total_memory(device_index))
    if nbytes > total:
        raise BackendError(f"backend magidev cannot cap magidev:{device_index} at {nbytes} B: the device has {total} B "
                           "(MAGIDEV_TOTAL_MEMORY); give at most that, or raise MAGIDEV_TOTAL_MEMORY")
    module.set_per_process_memory_fraction(min(1.0, nbytes / total), device_index)


@hookimpl
def magi_to_method_aliases() -> Sequence[str]:
    """torch_magidev does not wrap ``Tensor.to``: plain ``"to"``."""
    return ("to",)


#: A copy of the host ranges registered through this backend now (ptr -> nbytes), for leak checks.
registered_ranges = _TABLE.ranges
