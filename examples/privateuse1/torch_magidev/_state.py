"""Process-wide state of the emulated runtime: device count, initialisation, current device, the lock."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

#: The torch device type string this extension registers (PrivateUse1 renamed).
DEVICE_TYPE = "magidev"
#: ``torch._C._autograd.DeviceType.PrivateUse1`` as an int (what ``torch.Stream`` takes as ``device_type``).
DEVICE_TYPE_ID = int(torch._C._autograd.DeviceType.PrivateUse1)

#: One lock for every piece of bookkeeping (streams, blocks, checker, host ranges). Re-entrant: a weakref
#: finalizer that frees a block may run while the same thread is inside the dispatcher.
LOCK = threading.RLock()


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    return int(text) if text else default


#: ``MAGIDEV_DEVICE_COUNT`` (default 1): how many devices the emulated runtime reports.
DEVICE_COUNT = max(_env_int("MAGIDEV_DEVICE_COUNT", 1), 0)
#: ``MAGIDEV_TOTAL_MEMORY`` (bytes, default 16 GiB): what ``mem_get_info`` reports as each device's total.
TOTAL_MEMORY = _env_int("MAGIDEV_TOTAL_MEMORY", 16 << 30)

_initialized = False
_current = threading.local()


def lazy_init() -> None:
    """Initialise the emulated runtime (first real use: a stream, an allocation, ``current_device``...)."""
    global _initialized
    if _initialized:
        return
    with LOCK:
        if DEVICE_COUNT <= 0:
            raise RuntimeError("magidev: no device visible (MAGIDEV_DEVICE_COUNT=0); unset it to get one device")
        _initialized = True


def is_initialized() -> bool:
    """Whether the runtime was initialised in this process (probing and importing never do it)."""
    return _initialized


def current_index() -> int:
    """The calling thread's current device index (initialises)."""
    lazy_init()
    return getattr(_current, "index", 0)


def set_index(index: int) -> None:
    """Make ``index`` the calling thread's current device (initialises)."""
    lazy_init()
    if not 0 <= index < DEVICE_COUNT:
        raise RuntimeError(f"magidev: invalid device ordinal {index} ({DEVICE_COUNT} device(s) visible)")
    _current.index = index


def index_of(device: Any) -> int:
    """Device index of ``device`` (None, an int, a str or a torch.device of type magidev; None/no index: current)."""
    if device is None:
        return current_index()
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        dev = torch.device(device)
        if dev.type != DEVICE_TYPE:
            raise ValueError(f"magidev: expected a {DEVICE_TYPE!r} device, got {dev}")
        index = dev.index if dev.index is not None else current_index()
    if not 0 <= index < max(DEVICE_COUNT, 1):
        raise RuntimeError(f"magidev: invalid device ordinal {index} ({DEVICE_COUNT} device(s) visible)")
    return index
