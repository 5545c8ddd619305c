"""In-place host pinning through the MUSA runtime: torch_musa's bindings, else ``libmusart.so`` under MUSA_HOME.

Never the CUDA runtime, even when libcudart or an adapter such as torchada (which remaps
``torch.cuda`` onto ``torch.musa``) is present: the functions used here are named ``musa*`` and
come from ``torch.musa.musart()`` or from ``$MUSA_HOME/lib/libmusart.so`` (default
``/usr/local/musa``). After a failed call the runtime's pending per-thread error is drained with
``musaGetLastError`` where the runtime offers it, so it cannot surface later as another call's error.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from magi_core.plugin import BackendError, HostRangeTable

logger = logging.getLogger(__name__)

#: musaHostRegisterDefault.
FLAGS_DEFAULT = 0
DEFAULT_MUSA_HOME = "/usr/local/musa"



@dataclass(frozen=True)
class MusaRuntime:
    """The four MUSA runtime entry points host pinning needs, and where they came from."""

    source: str
    host_register: Callable[[int, int, int], Any]
    host_unregister: Callable[[int], Any]
    error_string: Callable[[Any], str] | None
    get_last_error: Callable[[], Any] | None


def libmusart_path() -> Path:
    """Where the fallback ``libmusart.so`` lives: ``$MUSA_HOME/lib`` (default ``/usr/local/musa/lib``)."""
    return Path(os.environ.get("MUSA_HOME") or DEFAULT_MUSA_HOME) / "lib" / "libmusart.so"


def _from_bindings(bindings: Any) -> MusaRuntime | None:
    register = getattr(bindings, "musaHostRegister", None)
    unregister = getattr(bindings, "musaHostUnregister", None)
    if register is None or unregister is None:
        return None
    return MusaRuntime(
        source="torch.musa.musart()",
        host_register=register,
        host_unregister=unregister,
        error_string=getattr(bindings, "musaGetErrorString", None),
        get_last_error=getattr(bindings, "musaGetLastError", None),
    )


def _from_library(path: Path) -> MusaRuntime:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BackendError(
            f"torch_musa's runtime bindings lack musaHostRegister and {path} could not be loaded ({exc}); "
            "set MUSA_HOME to the MUSA toolkit or upgrade torch_musa"
        ) from exc
    lib.musaHostRegister.restype = ctypes.c_int
    lib.musaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.musaHostUnregister.restype = ctypes.c_int
    lib.musaHostUnregister.argtypes = [ctypes.c_void_p]
    error_string = None
    if hasattr(lib, "musaGetErrorString"):
        fn = lib.musaGetErrorString
        fn.restype = ctypes.c_char_p
        fn.argtypes = [ctypes.c_int]

        def error_string(err: Any) -> str:
            raw = fn(int(err))
            return raw.decode(errors="replace") if raw else f"MUSA error {int(err)}"

    get_last_error = None
    if hasattr(lib, "musaGetLastError"):
        get_last_error = lib.musaGetLastError
        get_last_error.restype = ctypes.c_int
        get_last_error.argtypes = []
    return MusaRuntime(
        source=str(path),
        host_register=lib.musaHostRegister,
        host_unregister=lib.musaHostUnregister,
        error_string=error_string,
        get_last_error=get_last_error,
    )


@functools.lru_cache(maxsize=1)
def musa_runtime() -> MusaRuntime:
    """torch_musa's runtime bindings when they have host registration, else ``libmusart.so`` (resolved once)."""
    import torch_musa  # noqa: F401  (installs torch.musa)

    rt = _from_bindings(torch.get_device_module("musa").musart())
    if rt is None:
        rt = _from_library(libmusart_path())
    logger.debug("MUSA host registration through %s", rt.source)
    return rt


def error_text(rt: MusaRuntime, err: Any) -> str:
    """The runtime's own text for ``err``."""
    if rt.error_string is None:
        return f"MUSA error {int(err)}"
    return str(rt.error_string(err))


def _drain() -> None:
    rt = musa_runtime()
    if rt.get_last_error is not None:
        rt.get_last_error()


_TABLE = HostRangeTable(
    "MUSA",
    register=lambda ptr, nbytes: musa_runtime().host_register(ptr, nbytes, FLAGS_DEFAULT),
    unregister=lambda ptr: musa_runtime().host_unregister(ptr),
    error_text=lambda err: error_text(musa_runtime(), err),
    clear_error=_drain,
)
#: ``musaHostRegister`` in place; 712 (already registered) is success.
host_register = _TABLE.register
#: ``musaHostUnregister``; a range this backend did not register raises (713).
host_unregister = _TABLE.unregister
#: The ranges this backend has registered now (ptr -> nbytes), for leak checks.
registered_ranges = _TABLE.ranges
