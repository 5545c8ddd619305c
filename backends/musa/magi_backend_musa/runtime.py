"""In-place host pinning through the MUSA runtime: torch_musa's bindings, else ``libmusart.so`` under MUSA_HOME.

Never the CUDA runtime, even when libcudart or an adapter such as torchada (which remaps
``torch.cuda`` onto ``torch.musa``) is present: the functions used here are named ``musa*`` and
come from ``torch.musa.musart()`` or from ``$MUSA_HOME/lib/libmusart.so`` (default
``/usr/local/musa``).

A failed call, and a tolerated one (712, already registered), leaves the runtime's per-thread pending error
set, and torch_musa raises it after the next kernel launch (``C10_MUSA_KERNEL_LAUNCH_CHECK``) as that kernel's
own error. So after every non-zero return it is consumed with ``musaGetLastError``: the bindings' own when they
have it, else (torch_musa 2.7.1's ``_musart`` binds only ``musaGetErrorString``, ``musaHostRegister``,
``musaHostUnregister``, ``musaStreamCreate/Destroy`` and ``musaMemGetInfo``) the one exported by each
``libmusart`` already mapped into the process (:func:`loaded_libmusart`: opened with ``RTLD_NOLOAD``, so no
library is ever loaded by this, and none but ``libmusart``), then checked with ``musaPeekAtLastError`` where
exported.
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

from magi_core.plugin import BackendError, HostRangeTable, loaded_libraries

logger = logging.getLogger(__name__)

#: musaHostRegisterDefault.
FLAGS_DEFAULT = 0
DEFAULT_MUSA_HOME = "/usr/local/musa"
_BINDINGS_SOURCE = "torch.musa.musart()"



@dataclass(frozen=True)
class MusaRuntime:
    """The MUSA runtime entry points host pinning needs, and where they came from."""

    source: str
    host_register: Callable[[int, int, int], Any]
    host_unregister: Callable[[int], Any]
    error_string: Callable[[Any], str] | None
    get_last_error: Callable[[], Any] | None
    peek_at_last_error: Callable[[], Any] | None = None


@dataclass(frozen=True)
class ErrorDrain:
    """One runtime instance's ``musaGetLastError`` (and ``musaPeekAtLastError`` where exported)."""

    source: str
    get_last_error: Callable[[], Any]
    peek_at_last_error: Callable[[], Any] | None


def libmusart_path() -> Path:
    """Where the fallback ``libmusart.so`` lives: ``$MUSA_HOME/lib`` (default ``/usr/local/musa/lib``)."""
    return Path(os.environ.get("MUSA_HOME") or DEFAULT_MUSA_HOME) / "lib" / "libmusart.so"


def _from_bindings(bindings: Any) -> MusaRuntime | None:
    register = getattr(bindings, "musaHostRegister", None)
    unregister = getattr(bindings, "musaHostUnregister", None)
    if register is None or unregister is None:
        return None
    return MusaRuntime(
        source=_BINDINGS_SOURCE,
        host_register=register,
        host_unregister=unregister,
        error_string=getattr(bindings, "musaGetErrorString", None),
        get_last_error=getattr(bindings, "musaGetLastError", None),
        peek_at_last_error=getattr(bindings, "musaPeekAtLastError", None),
    )


def _int_function(lib: Any, name: str) -> Callable[[], Any] | None:
    """``lib.<name>`` as a no-argument function returning an int; None when ``lib`` does not export it."""
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    if isinstance(lib, ctypes.CDLL):
        fn.restype = ctypes.c_int
        fn.argtypes = []
    return fn


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

    return MusaRuntime(
        source=str(path),
        host_register=lib.musaHostRegister,
        host_unregister=lib.musaHostUnregister,
        error_string=error_string,
        get_last_error=_int_function(lib, "musaGetLastError"),
        peek_at_last_error=_int_function(lib, "musaPeekAtLastError"),
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


def loaded_libmusart() -> tuple[Any, ...]:
    """Handles to every ``libmusart`` already mapped into this process (torch_musa's runtime); none is loaded anew.

    The paths come from ``/proc/self/maps`` (file names starting with ``libmusart``), plus the name
    ``libmusart.so`` as the dynamic linker knows it; each is opened with ``RTLD_NOLOAD``, which only returns a
    library already loaded. Tests replace this function to hand in an emulated library.
    """
    handles = loaded_libraries("libmusart")
    if not handles:  # mapped under a name /proc does not show (or no /proc): ask the dynamic linker by name
        try:
            handles.append(ctypes.CDLL("libmusart.so", mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            pass
    return tuple(handles)


_drains: tuple[ErrorDrain, ...] = ()
_warned_no_drain = False


def error_drains() -> tuple[ErrorDrain, ...]:
    """Where to consume the pending error: the bindings' ``musaGetLastError``, else each loaded ``libmusart``'s.

    Resolved at the first failed call (torch_musa has loaded the runtime by then) and kept once found.
    """
    global _drains
    if _drains:
        return _drains
    rt = musa_runtime()
    bindings = rt.source == _BINDINGS_SOURCE
    if bindings and rt.get_last_error is not None:
        found = [ErrorDrain(rt.source, rt.get_last_error, rt.peek_at_last_error)]
    else:  # every runtime instance mapped, torch_musa's and (fallback) the one loaded from MUSA_HOME alike
        found = []
        for lib in loaded_libmusart():
            get = _int_function(lib, "musaGetLastError")
            if get is not None:
                source = str(getattr(lib, "_name", None) or type(lib).__name__)
                found.append(ErrorDrain(source, get, _int_function(lib, "musaPeekAtLastError")))
        if not found and rt.get_last_error is not None:
            found = [ErrorDrain(rt.source, rt.get_last_error, rt.peek_at_last_error)]
    _drains = tuple(found)
    return _drains


def drain_last_error() -> bool:
    """Consume this thread's pending MUSA error after a failed or tolerated call; False when no drain was reachable."""
    global _warned_no_drain
    drains = error_drains()
    if not drains:
        if not _warned_no_drain:
            _warned_no_drain = True
            logger.warning(
                "MUSA: torch_musa's runtime bindings have no musaGetLastError and no libmusart loaded in this process "
                "exports it, so the error a failed or tolerated host register/unregister leaves pending cannot be "
                "cleared: the next MUSA kernel may raise it as its own"
            )
        return False
    for drain in drains:
        drain.get_last_error()
        if drain.peek_at_last_error is not None:
            left = int(drain.peek_at_last_error())
            if left != 0:
                logger.warning("MUSA: error %d still pending after musaGetLastError (%s); a sticky error?", left,
                               drain.source)
    return True


_TABLE = HostRangeTable(
    "MUSA",
    register=lambda ptr, nbytes: musa_runtime().host_register(ptr, nbytes, FLAGS_DEFAULT),
    unregister=lambda ptr: musa_runtime().host_unregister(ptr),
    error_text=lambda err: error_text(musa_runtime(), err),
    clear_error=lambda: drain_last_error(),
)
#: ``musaHostRegister`` in place; 712 (already registered: someone else's, left to them) is success.
host_register = _TABLE.register
#: ``musaHostUnregister`` for the ranges this backend registered; found and covered ranges are forgotten; a range
#: it does not hold raises (713).
host_unregister = _TABLE.unregister
#: The ranges this backend holds now (ptr -> nbytes), for leak checks.
registered_ranges = _TABLE.ranges
#: How each held range is held: "registered", "found" (712) or "covered" (inside a held range).
range_origins = _TABLE.origins
