"""In-place host pinning through the CUDA runtime torch already loaded (``torch.cuda.cudart()``).

Nothing here searches the file system for a runtime library: registration goes through torch's own
bindings. A failed runtime call also latches the runtime's per-thread "last error", which the next
error-checked CUDA call (typically an unrelated kernel launch) would report as its own failure, so
after any non-zero return the error is drained with ``cudaGetLastError`` of the runtime instance(s)
already mapped into this process (opened with ``RTLD_NOLOAD``: never a different library).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Any

import torch

from magi_core.errors import HostRegisterError

logger = logging.getLogger(__name__)

SUCCESS = 0
#: cudaErrorHostMemoryAlreadyRegistered: counts as success.
ALREADY_REGISTERED = 712
#: cudaErrorHostMemoryNotRegistered: unregister of a range nobody registered.
NOT_REGISTERED = 713
#: cudaHostRegisterDefault.
FLAGS_DEFAULT = 0

_lock = threading.Lock()
#: Ranges this backend registered (ptr -> nbytes); lets a repeated register skip the runtime call.
_ranges: dict[int, int] = {}


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
    """Handles to every CUDA runtime instance already mapped into this process (none is loaded anew)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip().removesuffix(" (deleted)")
                if os.path.basename(path).startswith("libcudart") and path not in paths:
                    paths.append(path)
    except OSError:
        return ()
    handles = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            fn = lib.cudaGetLastError
        except (OSError, AttributeError):
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


def host_register(ptr: int, nbytes: int) -> None:
    """Pin [ptr, ptr+nbytes) in place with ``cudaHostRegister``; 712 (already registered) is success."""
    if ptr <= 0 or nbytes <= 0:
        raise HostRegisterError(
            f"cudaHostRegister: invalid range ptr={ptr:#x} nbytes={nbytes}; pass a tensor's data_ptr() and nbytes",
            code=None,
        )
    with _lock:
        if ptr in _ranges:
            return
        rt = _cudart()
        err = rt.cudaHostRegister(ptr, nbytes, FLAGS_DEFAULT)
        code = int(err)
        if code == SUCCESS:
            _ranges[ptr] = nbytes
            return
        text = error_text(rt, err)
        drain_last_error()
        if code == ALREADY_REGISTERED:
            logger.debug("cudaHostRegister(%#x, %d): already registered (712), treated as success", ptr, nbytes)
            _ranges[ptr] = nbytes
            return
    raise HostRegisterError(
        f"cudaHostRegister(ptr={ptr:#x}, nbytes={nbytes}) failed with CUDA error {code}: {text}; check that the "
        "range is ordinary host memory and that `ulimit -l` (memlock) allows pinning it",
        code=code,
    )


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` with ``cudaHostUnregister``; an unknown range raises (713)."""
    with _lock:
        if _ranges.pop(ptr, None) is None:
            raise HostRegisterError(
                f"cudaHostUnregister(ptr={ptr:#x}): this range was not registered through magi's cuda backend "
                f"(CUDA error {NOT_REGISTERED}, cudaErrorHostMemoryNotRegistered); unregister only what you registered",
                code=NOT_REGISTERED,
            )
        rt = _cudart()
        err = rt.cudaHostUnregister(ptr)
        code = int(err)
        if code == SUCCESS:
            return
        text = error_text(rt, err)
        drain_last_error()
    raise HostRegisterError(f"cudaHostUnregister(ptr={ptr:#x}) failed with CUDA error {code}: {text}", code=code)


def registered_ranges() -> dict[int, int]:
    """A copy of the ranges this backend has registered now (ptr -> nbytes), for leak checks."""
    with _lock:
        return dict(_ranges)
