"""Test-only emulation of ``import torch_musa`` (torch_musa 2.7.x public API), see ``docs/musa.md``.

Importing this package does to torch what the real ``import torch_musa`` does: it renames the
PrivateUse1 backend to ``"musa"``, registers this module as ``torch.musa`` (so
``torch.get_device_module("musa")`` returns it), wraps ``Tensor.to`` / ``pin_memory`` / ``is_pinned``
around the originals kept at ``torch.Tensor.orig_*``, and exposes ``musart()`` whose
``musaHostRegister`` / ``musaHostUnregister`` keep a real table of registered host ranges.

It is EMULATED: no kernels exist for the "musa" device, so tensors cannot be allocated on it.
Streams and events are host objects that record order and wall-clock time.

Environment knobs (read at import):
  ``FAKE_MUSA_DEVICE_COUNT`` (default 1): how many devices ``device_count()`` reports.
  ``FAKE_MUSA_NO_HOST_REGISTER=1``: ``musart()`` lacks the host-register bindings (ctypes fallback path).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

__version__ = "2.7.0+emulated"
#: Marker for tests and reports: this is not the real torch_musa.
EMULATED = True

_DEVICE_COUNT = int(os.environ.get("FAKE_MUSA_DEVICE_COUNT", "1"))
_HAS_HOST_REGISTER = os.environ.get("FAKE_MUSA_NO_HOST_REGISTER", "") in ("", "0")

# musaError numbers (same as CUDA's cudaError_t for these cases).
MUSA_SUCCESS = 0
MUSA_ERROR_INVALID_VALUE = 1
MUSA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
MUSA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
_ERROR_TEXT = {
    MUSA_SUCCESS: "no error",
    MUSA_ERROR_INVALID_VALUE: "invalid argument",
    MUSA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    MUSA_ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}

_lock = threading.RLock()
_initialized = False
_current_device = 0


def _lazy_init() -> None:
    """Initialise the (emulated) device runtime, as torch.musa does on first real use."""
    global _initialized
    with _lock:
        if _initialized:
            return
        if _DEVICE_COUNT <= 0:
            raise RuntimeError("Found no MUSA devices (emulated torch_musa, FAKE_MUSA_DEVICE_COUNT=0)")
        _initialized = True


def is_available() -> bool:
    """True when at least one (emulated) device is visible; does not initialise."""
    return _DEVICE_COUNT > 0


def device_count() -> int:
    """Number of (emulated) devices; does not initialise."""
    return max(_DEVICE_COUNT, 0)


def is_initialized() -> bool:
    """Whether the device runtime has been initialised in this process."""
    return _initialized


def current_device() -> int:
    """Index of the current device (initialises)."""
    _lazy_init()
    return _current_device


def set_device(device: Any) -> None:
    """Make ``device`` current (initialises)."""
    global _current_device
    _lazy_init()
    index = device.index if isinstance(device, torch.device) else int(device)
    if index is None or not 0 <= index < _DEVICE_COUNT:
        raise RuntimeError(f"invalid device ordinal {device!r} (emulated, {_DEVICE_COUNT} device(s))")
    _current_device = index


def synchronize(device: Any = None) -> None:
    """Wait for all device work (nothing runs on the emulated device)."""
    _lazy_init()


class Event:
    """Emulated musa Event: records wall-clock time on the host."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Record this event on ``stream`` (the current stream by default)."""
        _lazy_init()
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` wait for this event."""
        _lazy_init()

    def query(self) -> bool:
        """True: emulated work completes at once."""
        return True

    def synchronize(self) -> None:
        """Wait for this event."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) * 1e3


_stream_ids = iter(range(1, 1 << 62))


class Stream(torch.Stream):
    """Emulated musa Stream: a ``torch.Stream`` of device type musa, as torch_musa's ``_MusaStreamBase`` is."""

    def __new__(cls, device: Any = None, priority: int = 0) -> Stream:
        _lazy_init()
        index = _current_device if device is None else torch.device(device).index
        index = index if index is not None else _current_device
        return super().__new__(cls, stream_id=next(_stream_ids), device_index=index,
                               device_type=int(torch._C._autograd.DeviceType.PrivateUse1))

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.priority = priority

    def wait_event(self, event: Event) -> None:
        """Order later work on this stream after ``event``."""

    def wait_stream(self, stream: Stream) -> None:
        """Order later work on this stream after ``stream``'s current work."""

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True: emulated work completes at once."""
        return True

    def synchronize(self) -> None:
        """Wait for this stream's work."""


_default_streams: dict[int, Stream] = {}
_stream_stack: list[Stream] = []


def default_stream(device: Any = None) -> Stream:
    """The default stream of ``device`` (initialises)."""
    _lazy_init()
    index = _current_device if device is None else (torch.device(device).index or 0) if not isinstance(
        device, int) else device
    if index not in _default_streams:
        _default_streams[index] = Stream(torch.device("musa", index))
    return _default_streams[index]


def current_stream(device: Any = None) -> Stream:
    """The stream work is submitted to now (initialises)."""
    _lazy_init()
    return _stream_stack[-1] if _stream_stack else default_stream(device)


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current."""
    _lazy_init()
    _stream_stack[:] = [stream]


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Context manager making ``s`` the current stream."""
    if s is None:
        yield
        return
    _stream_stack.append(s)
    try:
        yield
    finally:
        _stream_stack.pop()


_FAKE_TOTAL = 80 * 2**30


def memory_allocated(device: Any = None) -> int:
    """Bytes held by tensors (always 0: nothing can be allocated on the emulated device)."""
    return 0


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` (0)."""
    return 0


def memory_reserved(device: Any = None) -> int:
    """Bytes held by the caching allocator (0)."""
    return 0


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` (0)."""
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    """Reset peak statistics (nothing to reset)."""


def empty_cache() -> None:
    """Release cached blocks (nothing cached)."""


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the emulated device (initialises)."""
    _lazy_init()
    return _FAKE_TOTAL, _FAKE_TOTAL


# -- runtime bindings ------------------------------------------------------------------------------
class musaError:  # noqa: N801 - mirrors the binding's type name
    """A musaError_t value: ``int()`` gives the code."""

    def __init__(self, code: int) -> None:
        self.code = int(code)

    def __int__(self) -> int:
        return self.code

    def __index__(self) -> int:
        return self.code

    def __eq__(self, other: object) -> bool:
        return int(other) == self.code if isinstance(other, (int, musaError)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.code)

    def __repr__(self) -> str:
        return f"musaError({self.code})"


class _Musart:
    """Emulated ``torch_musa`` runtime bindings with a real table of registered host ranges."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}
        self._last_error = MUSA_SUCCESS
        #: Every runtime call made, as (name, args): lets tests prove which runtime was used.
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        if _HAS_HOST_REGISTER:
            self.musaHostRegister = self._host_register
            self.musaHostUnregister = self._host_unregister

    def _fail(self, code: int) -> musaError:
        self._last_error = code
        return musaError(code)

    def _host_register(self, ptr: int, nbytes: int, flags: int) -> musaError:
        with _lock:
            self.calls.append(("musaHostRegister", (ptr, nbytes, flags)))
            if ptr <= 0 or nbytes <= 0:
                return self._fail(MUSA_ERROR_INVALID_VALUE)
            for start, size in self._ranges.items():
                if ptr < start + size and start < ptr + nbytes:
                    return self._fail(MUSA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            self._ranges[ptr] = nbytes
            return musaError(MUSA_SUCCESS)

    def _host_unregister(self, ptr: int) -> musaError:
        with _lock:
            self.calls.append(("musaHostUnregister", (ptr,)))
            if self._ranges.pop(ptr, None) is None:
                return self._fail(MUSA_ERROR_HOST_MEMORY_NOT_REGISTERED)
            return musaError(MUSA_SUCCESS)

    def musaGetErrorString(self, error: Any) -> str:  # noqa: N802 - binding name
        """Text of a musaError."""
        return _ERROR_TEXT.get(int(error), f"unknown error {int(error)}")

    def musaGetLastError(self) -> musaError:  # noqa: N802 - binding name
        """Return and clear the last error, as the runtime does."""
        with _lock:
            code, self._last_error = self._last_error, MUSA_SUCCESS
            return musaError(code)

    def registered_ranges(self) -> dict[int, int]:
        """Emulation only: ranges registered now (ptr -> nbytes)."""
        with _lock:
            return dict(self._ranges)


_musart = _Musart()


def musart() -> _Musart:
    """The runtime bindings (initialises, as ``torch.cuda.cudart()`` does)."""
    _lazy_init()
    return _musart


# -- what importing torch_musa does to torch -------------------------------------------------------
def _map_device(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("musa", device)
    return device


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch_musa's ``Tensor.to`` wrapper: an int device means ``musa:N``; calls ``orig_to``."""
    if args:
        args = (_map_device(args[0]), *args[1:])
    if "device" in kwargs:
        kwargs["device"] = _map_device(kwargs["device"])
    return self.orig_to(*args, **kwargs)


def _pin_memory(self: torch.Tensor, device: Any = "musa") -> torch.Tensor:
    """torch_musa's ``Tensor.pin_memory`` wrapper (default device "musa")."""
    return self.orig_pin_memory(device)


def _is_pinned(self: torch.Tensor, device: Any = "musa") -> bool:
    """torch_musa's ``Tensor.is_pinned`` wrapper (default device "musa")."""
    return self.orig_is_pinned(device)


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """What torch_musa's C++ PrivateUse1 hooks tell torch (no pinned-memory allocator here)."""

    def is_available(self) -> bool:
        return _DEVICE_COUNT > 0

    def has_primary_context(self, dev_id: int) -> bool:
        return _initialized

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """Device guard so torch.accelerator (and Dynamo's stream tracking) can query the device."""

    # Outside torch's own files, Dynamo would trace this method and its compiled code would keep every compiled
    # graph (and what it holds) alive after torch._dynamo.reset(); disabled, it stays plain Python.
    @torch._dynamo.disable
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


def _install() -> None:
    if getattr(torch, "musa", None) is sys.modules[__name__]:
        return
    torch.utils.rename_privateuse1_backend("musa")
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module("musa", sys.modules[__name__])
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    if not hasattr(torch.Tensor, "orig_to"):
        torch.Tensor.orig_to = torch.Tensor.to
        torch.Tensor.to = _to
        torch.Tensor.orig_pin_memory = torch.Tensor.pin_memory
        torch.Tensor.pin_memory = _pin_memory
        torch.Tensor.orig_is_pinned = torch.Tensor.is_pinned
        torch.Tensor.is_pinned = _is_pinned


_install()
