"""The CPU reference backend, registered through the ``magi.backends`` entry point like any other.

Its device module, :mod:`magi_core.plugin.cpu.device`, is the reference implementation of the device-module
contract (synchronous streams that are ``torch.Stream`` objects, timed events, memory statistics): copy it or
subclass its classes when writing a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from magi_core.plugin import SUCCESS, Capabilities, DeviceMemory, HostRangeTable, ProbeResult, hookimpl
from magi_core.plugin.cpu import device as cpu_device

#: Host memory needs no pinning for host compute: the table checks ranges and keeps the bookkeeping.
_TABLE = HostRangeTable("cpu", register=lambda ptr, nbytes: SUCCESS, unregister=lambda ptr: SUCCESS)


@hookimpl
def magi_probe() -> ProbeResult:
    """Always available, lowest priority."""
    return ProbeResult(available=True, device_type="cpu", priority=0, version=torch.__version__)


@hookimpl
def magi_hookspec_versions() -> Sequence[str]:
    """Spec major 1."""
    return ("1",)


@hookimpl
def magi_device_module() -> ModuleType:
    """The synchronous host device module."""
    return cpu_device


@hookimpl
def magi_host_register(ptr: int, nbytes: int) -> None:
    """Check the range and remember it; "already registered" counts as success, as on CUDA and MUSA (712)."""
    _TABLE.register(ptr, nbytes)


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """Forget a registered range; an unknown one raises (713, "not registered")."""
    _TABLE.unregister(ptr)


@hookimpl
def magi_capabilities() -> Capabilities:
    """Inductor compiles for the host, but "auto" stays eager (compiling costs more than it saves on small host
    runs); units compiled with ``unit_compiler="inductor"`` may be called directly (host code, host tensors)."""
    return Capabilities(inductor=True, default_unit_compiler="eager", direct_unit_calls=True)


@hookimpl
def magi_device_memory(device_index: int) -> DeviceMemory | None:
    """None: host memory is no device budget (weights are used in place; there is nothing to fit)."""
    return None


@hookimpl
def magi_to_method_aliases() -> Sequence[str]:
    """Plain ``Tensor.to``."""
    return ("to",)


#: A copy of the ranges registered now (ptr -> nbytes), for leak checks.
registered_ranges = _TABLE.ranges
