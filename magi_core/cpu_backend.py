"""The CPU reference backend, registered through the ``magi.backends`` entry point like any other."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType

import torch

from magi_core import cpu_device
from magi_core.errors import HostRegisterError
from magi_core.hookspecs import ProbeResult
from magi_core.plugin import hookimpl

#: Error numbers shared with the CUDA and MUSA runtimes.
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713

_lock = threading.Lock()
_ranges: dict[int, int] = {}


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
    """Check the range and remember it (host memory needs no pinning for host compute)."""
    if ptr <= 0 or nbytes <= 0:
        raise HostRegisterError(f"host register: invalid range ptr={ptr:#x} nbytes={nbytes}", code=1)
    with _lock:
        if ptr in _ranges:
            return  # "already registered" counts as success, as on CUDA and MUSA (712)
        _ranges[ptr] = nbytes


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """Forget a registered range; an unknown one raises (713, "not registered")."""
    with _lock:
        if _ranges.pop(ptr, None) is None:
            raise HostRegisterError(
                f"host unregister: range at {ptr:#x} was not registered (error {NOT_REGISTERED})", code=NOT_REGISTERED
            )


@hookimpl
def magi_to_method_aliases() -> Sequence[str]:
    """Plain ``Tensor.to``."""
    return ("to",)


def registered_ranges() -> dict[int, int]:
    """A copy of the ranges registered now (ptr -> nbytes), for leak checks."""
    with _lock:
        return dict(_ranges)
