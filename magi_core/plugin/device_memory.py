"""Device memory for backends (spec 1.2): what a torch-style device module reports, and a per-process cap.

:func:`memory_from_module` is what ``Backend.device_memory`` falls back to for a backend without
``magi_device_memory``. :class:`FractionCap` implements both device-memory hooks for a device module that mirrors
CUDA's device module (``mem_get_info``, ``memory_reserved``, ``memory_allocated`` and
``set_per_process_memory_fraction``), as the CUDA and MUSA backends do. The device's whole size is the larger of
``mem_get_info``'s total and ``get_device_properties(i).total_memory`` (:func:`device_capacity`): a module whose
``mem_get_info`` reports a fraction's cap as its total needs the latter::

    _CAP = FractionCap("mydev", lambda: torch.mydev)

    @hookimpl
    def magi_device_memory(device_index: int) -> DeviceMemory | None:
        return _CAP.device_memory(device_index)

    @hookimpl
    def magi_limit_device_memory(device_index: int, nbytes: int) -> None:
        _CAP.limit(device_index, nbytes)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from magi_core.errors import BackendError
from magi_core.plugin.spec import DeviceMemory

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _cached_unused(module: Any, device_index: int) -> int:
    """Bytes torch's caching allocator holds reserved but unused on the device (0 without both counters)."""
    reserved = getattr(module, "memory_reserved", None)
    allocated = getattr(module, "memory_allocated", None)
    if not callable(reserved) or not callable(allocated):
        return 0
    return max(0, int(reserved(device_index)) - int(allocated(device_index)))


def device_capacity(module: Any, device_index: int) -> int:
    """The device's whole memory in bytes, whatever fraction this process set.

    The larger of ``mem_get_info``'s total and ``get_device_properties(i).total_memory`` where the module has it
    (CUDA's, MUSA's and XPU's device modules): a module whose ``mem_get_info`` reports a fraction's cap as its
    total needs the latter for a cap to be changed or lifted.
    """
    total = int(module.mem_get_info(device_index)[1])
    props = getattr(module, "get_device_properties", None)
    if callable(props):
        try:
            total = max(total, int(props(device_index).total_memory))
        except Exception:  # noqa: BLE001 - a binding without the field: mem_get_info's total
            pass
    return total


def memory_from_module(module: Any, device_index: int) -> DeviceMemory | None:
    """Free and total device memory from a torch-style device module, or None when it cannot tell.

    ``free`` is ``mem_get_info``'s free bytes plus what the caching allocator keeps reserved but unused (this
    process can reuse it), at most ``total``. None where the module has no ``mem_get_info`` or its call raises
    (logged): the planner then has no device figure to go by.
    """
    get = getattr(module, "mem_get_info", None)
    if not callable(get):
        return None
    try:
        free, total = (int(v) for v in get(device_index))
        cached = _cached_unused(module, device_index)
    except Exception as exc:  # a module that lists the call but cannot answer it: no figure, not a crash
        logger.warning("%s.mem_get_info(%d) raised %s: %s; device memory unknown",
                       getattr(module, "__name__", module), device_index, type(exc).__name__, exc)
        return None
    total = max(total, 0)
    return DeviceMemory(free=min(max(free, 0) + cached, total), total=total)


class FractionCap:
    """Both device-memory hooks over a device module with ``set_per_process_memory_fraction`` (CUDA, MUSA).

    :meth:`limit` sets the allocator's fraction to ``nbytes / total`` (torch's allocator then refuses, with its
    out-of-memory error, what would take its reserved bytes past ``fraction * total``) and remembers ``nbytes``;
    :meth:`device_memory` reports ``free = min(free + cached unused, cap - allocated)`` and ``total = cap`` while a
    cap is set. A cap at the device's total lifts it (fraction 1.0). Where the process set a fraction without
    :meth:`limit` (the device module's ``set_per_process_memory_fraction`` called directly) and the module has
    ``get_per_process_memory_fraction``, that fraction counts as the cap. Thread-safe.
    """

    def __init__(self, backend: str, module: Callable[[], ModuleType | Any]) -> None:
        #: The backend's name, for error messages.
        self.backend = backend
        self._module = module
        self._caps: dict[int, int] = {}
        self._lock = threading.Lock()

    def caps(self) -> dict[int, int]:
        """The caps set through :meth:`limit` and not lifted (device index -> bytes)."""
        with self._lock:
            return dict(self._caps)

    def _cap(self, module: Any, device_index: int) -> int | None:
        with self._lock:
            cap = self._caps.get(device_index)
        if cap is not None:
            return cap
        get = getattr(module, "get_per_process_memory_fraction", None)
        if not callable(get):
            return None
        try:
            fraction = float(get(device_index))
            return int(fraction * device_capacity(module, device_index)) if 0.0 <= fraction < 1.0 else None
        except Exception:  # an older binding, or one that cannot answer: no cap known
            return None

    def device_memory(self, device_index: int) -> DeviceMemory | None:
        """What ``magi_device_memory`` returns: the module's figures, limited by the cap when one is set."""
        module = self._module()
        seen = memory_from_module(module, device_index)
        if seen is None:
            return None
        cap = self._cap(module, device_index)
        if cap is None:
            return seen
        allocated = int(module.memory_allocated(device_index))
        return DeviceMemory(free=max(0, min(seen.free, cap - allocated)), total=cap)

    def limit(self, device_index: int, nbytes: int) -> None:
        """What ``magi_limit_device_memory`` does: cap the allocator at ``nbytes`` (``nbytes >= total`` lifts it)."""
        module = self._module()
        setter = getattr(module, "set_per_process_memory_fraction", None)
        name = getattr(module, "__name__", type(module).__name__)
        if not callable(setter):
            raise BackendError(
                f"backend {self.backend} cannot cap device memory: {name} has no set_per_process_memory_fraction "
                "(an older release of the vendor's torch extension); upgrade it, or run without a cap"
            )
        total = device_capacity(module, device_index)
        if nbytes > total:
            raise BackendError(
                f"backend {self.backend} cannot cap device {device_index} at {nbytes} B ({_gib(nbytes)}): the device "
                f"has {total} B ({_gib(total)}); a cap emulates a smaller card: give at most the device's total"
            )
        setter(min(1.0, nbytes / total) if total else 1.0, device_index)
        with self._lock:
            if nbytes >= total:
                self._caps.pop(device_index, None)
            else:
                self._caps[device_index] = int(nbytes)
        logger.info("backend %s: device %d capped at %d B (%s of %s)", self.backend, device_index, nbytes,
                    _gib(nbytes), _gib(total))


__all__ = ["FractionCap", "device_capacity", "memory_from_module"]
