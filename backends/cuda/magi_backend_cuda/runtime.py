"""In-place host pinning through the CUDA runtime torch already loaded (``torch.cuda.cudart()``).

Nothing here searches the file system for a runtime library: registration goes through torch's own
bindings. A failed runtime call also latches the runtime's per-thread "last error", which the next
error-checked CUDA call (typically an unrelated kernel launch) would report as its own failure, so
after any non-zero return the error is drained with ``cudaGetLastError`` of the runtime instance(s)
already mapped into this process (opened with ``RTLD_NOLOAD``: never a different library).

Ownership follows :class:`~magi_core.plugin.HostRangeTable`: only ranges this backend registered are
unregistered through CUDA; a range CUDA answers 712 for (torch's pinned-memory allocator, another library, or
partly a range held here) is forgotten on unregister, and a sub-range of a held range never reaches CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

from magi_core.plugin import HostRangeTable, loaded_libraries

logger = logging.getLogger(__name__)

#: cudaHostRegisterDefault.
FLAGS_DEFAULT = 0



def _cudart() -> Any:
    """torch's CUDA runtime bindings (initialises CUDA, as any host registration must)."""
    return torch.cuda.cudart()


def error_text(rt: Any, err: Any) -> str:
    """The runtime's own text for ``err`` (``cudaGetErrorString`` takes the binding's enum, not an int)."""
    try:
        return str(rt.cudaGetErrorString(err))
    except Exception:  # an older binding without it, or an int that is not an enum member
        return f"CUDA error {int(err)}"


@functools.lru_cache(maxsize=1)
def _loaded_runtimes() -> tuple[Any, ...]:
    """``cudaGetLastError`` of every CUDA runtime instance already mapped into this process (none is loaded anew)."""
    handles = []
    for lib in loaded_libraries("libcudart"):
        try:
            fn = lib.cudaGetLastError
        except AttributeError:
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        handles.append(fn)
    return tuple(handles)


def drain_last_error() -> bool:
    """Consume the runtime's pending per-thread error after a failed call; False when it could not be reached."""
    drains = _loaded_runtimes()
    if not drains:
        logger.warning(
            "could not reach the CUDA runtime's cudaGetLastError to clear a failed host-register call; "
            "the next CUDA call may report that error as its own"
        )
        return False
    for fn in drains:
        fn()
    return True


_TABLE = HostRangeTable(
    "CUDA",
    register=lambda ptr, nbytes: _cudart().cudaHostRegister(ptr, nbytes, FLAGS_DEFAULT),
    unregister=lambda ptr: _cudart().cudaHostUnregister(ptr),
    error_text=lambda err: error_text(_cudart(), err),
    clear_error=lambda: drain_last_error(),
)
#: ``cudaHostRegister`` in place; 712 (already registered: someone else's, e.g. torch's pinned allocator, left to
#: them) is success.
host_register = _TABLE.register
#: ``cudaHostUnregister`` for the ranges this backend registered; found and covered ranges are forgotten; a range
#: it does not hold raises (713).
host_unregister = _TABLE.unregister
#: The ranges this backend holds now (ptr -> nbytes), for leak checks.
registered_ranges = _TABLE.ranges
#: How each held range is held: "registered", "found" (712) or "covered" (inside a held range).
range_origins = _TABLE.origins
