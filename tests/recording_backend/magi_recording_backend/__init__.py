"""Test-only magi backend ``recording``: CPU tensors, a device module that logs every stream/event call and copy.

Put this directory on ``PYTHONPATH`` and set ``MAGI_BACKEND=recording``. Its probe priority is below the
CPU backend's, so it is only used when asked for by name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType

import torch

from magi_core.plugin import HostRegisterError, ProbeResult, hookimpl
from magi_recording_backend import device

_lock = threading.Lock()
_ranges: dict[int, int] = {}


@hookimpl
def magi_probe() -> ProbeResult:
    """Always available, below the CPU backend."""
    return ProbeResult(available=True, device_type="cpu", priority=-10, version=torch.__version__)


@hookimpl
def magi_hookspec_versions() -> Sequence[str]:
    """Spec major 1."""
    return ("1",)


@hookimpl
def magi_device_module() -> ModuleType:
    """The recording device module."""
    return device


@hookimpl
def magi_host_register(ptr: int, nbytes: int) -> None:
    """Remember the range (and log it)."""
    if ptr <= 0 or nbytes <= 0:
        raise HostRegisterError(f"invalid range ptr={ptr:#x} nbytes={nbytes}", code=1)
    with _lock:
        _ranges.setdefault(ptr, nbytes)
    device.LOG.append(("host_register", ptr, nbytes))


@hookimpl
def magi_host_unregister(ptr: int) -> None:
    """Forget the range; unknown ranges raise 713."""
    with _lock:
        if _ranges.pop(ptr, None) is None:
            raise HostRegisterError(f"range at {ptr:#x} was not registered", code=713)
    device.LOG.append(("host_unregister", ptr))


@hookimpl
def magi_range_push(name: str) -> None:
    """Log the range (the executor opens one per unit launch)."""
    device.LOG.append(("range_push", name))


@hookimpl
def magi_range_pop() -> None:
    """Log the end of a range."""
    device.LOG.append(("range_pop",))


def registered_ranges() -> dict[int, int]:
    """Ranges registered now."""
    with _lock:
        return dict(_ranges)
