"""Test-only emulation of ``import torch_musa`` (torch_musa 2.7.x public API), see ``docs/musa.md``.

Importing this package does to torch what the real ``import torch_musa`` does: it renames the
PrivateUse1 backend to ``"musa"``, registers this module as ``torch.musa`` (so
``torch.get_device_module("musa")`` returns it), wraps ``Tensor.to`` / ``pin_memory`` / ``is_pinned``
around the originals kept at ``torch.Tensor.orig_*``, and exposes ``musart()`` whose
``musaHostRegister`` / ``musaHostUnregister`` keep a real table of registered host ranges.

It is EMULATED: no kernels exist for the "musa" device, so tensors cannot be allocated on it.
Streams and events are host objects that record order and wall-clock time.

The runtime is one process-wide state (what ``libmusart.so`` holds): the pinned ranges and a per-thread
pending error that every failing call leaves behind (712 "already registered" included), as the MUSA and CUDA
runtimes do. :func:`launch_kernel` stands in for a torch_musa kernel launch, which raises that pending error
(``C10_MUSA_KERNEL_LAUNCH_CHECK``); :data:`LIBMUSART` is what ``ctypes`` would reach in the loaded
``libmusart.so`` (``musaGetLastError``, ``musaPeekAtLastError``, ...). ``Tensor.pin_memory()`` emulates
torch_musa's pinned-memory allocator (a cached host block the runtime counts as pinned, as ``musaHostAlloc``
memory: registering it answers 712, unregistering it 713), ``Tensor.is_pinned()`` asks the runtime.

Two binding surfaces (``FAKE_MUSA_BINDINGS``):
  ``2.7.0`` (default): ``musart()`` also binds ``musaGetLastError`` (a superset of the released bindings) and
  offers the emulation-only ``registered_ranges()`` and ``calls``.
  ``2.7.1``: ``musart()`` has exactly torch_musa 2.7.1's ``_musart`` attributes (:data:`MUSART_2_7_1_SURFACE`,
  from ``torch_musa/csrc/core/musart.cpp``): no ``musaGetLastError``; use :func:`emulated_registered_ranges` and
  :data:`RUNTIME_CALLS` to look inside.

Environment knobs (read at import):
  ``FAKE_MUSA_DEVICE_COUNT`` (default 1): how many devices ``device_count()`` reports.
  ``FAKE_MUSA_BINDINGS``: ``2.7.0`` (default) or ``2.7.1``, see above.
  ``FAKE_MUSA_NO_HOST_REGISTER=1``: surface 2.7.0 without the host-register bindings (ctypes fallback path).
  ``FAKE_MUSA_MEMLOCK_BYTES=N``: musaHostRegister refuses (2, "out of memory") past N registered bytes, as a
  memlock limit makes it.
  ``FAKE_MUSA_NO_MEMORY_FRACTION=1``: no ``set_per_process_memory_fraction`` (torch_musa releases before it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

_BINDINGS = os.environ.get("FAKE_MUSA_BINDINGS", "").strip() or "2.7.0"
if _BINDINGS not in ("2.7.0", "2.7.1"):
    raise RuntimeError(f"FAKE_MUSA_BINDINGS={_BINDINGS!r}: the emulated binding surfaces are '2.7.0' and '2.7.1'")
__version__ = f"{_BINDINGS}+emulated"
#: Marker for tests and reports: this is not the real torch_musa.
EMULATED = True

_DEVICE_COUNT = int(os.environ.get("FAKE_MUSA_DEVICE_COUNT", "1"))
_HAS_HOST_REGISTER = os.environ.get("FAKE_MUSA_NO_HOST_REGISTER", "") in ("", "0")
_MEMLOCK_BYTES = int(os.environ["FAKE_MUSA_MEMLOCK_BYTES"]) if os.environ.get("FAKE_MUSA_MEMLOCK_BYTES") else None
_HAS_MEMORY_FRACTION = os.environ.get("FAKE_MUSA_NO_MEMORY_FRACTION", "") in ("", "0")

# musaError numbers (same as CUDA's cudaError_t for these cases).
MUSA_SUCCESS = 0
MUSA_ERROR_INVALID_VALUE = 1
MUSA_ERROR_MEMORY_ALLOCATION = 2
MUSA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
MUSA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
_ERROR_TEXT = {
    MUSA_SUCCESS: "no error",
    MUSA_ERROR_INVALID_VALUE: "invalid argument",
    MUSA_ERROR_MEMORY_ALLOCATION: "out of memory",
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


#: Emulation only: the allocator fraction set per device (device index -> fraction).
MEMORY_FRACTIONS: dict[int, float] = {}


def _set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """torch_musa's ``set_per_process_memory_fraction``: the caching allocator's cap, ``fraction`` of the total."""
    _lazy_init()
    index = _current_device if device is None else device if isinstance(device, int) else torch.device(device).index
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    MEMORY_FRACTIONS[int(index or 0)] = fraction


if _HAS_MEMORY_FRACTION:
    set_per_process_memory_fraction = _set_per_process_memory_fraction


# -- runtime: libmusart.so's state, torch_musa's bindings over it, an emulated kernel launch ----------------------
class musaError:  # noqa: N801 - mirrors the binding's type name
    """A musaError_t value, as torch_musa's ``py::enum_<musaError_t>`` returns it: ``int()`` gives the code."""

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


musaError.success = musaError(MUSA_SUCCESS)  # type: ignore[attr-defined]  # the enum's one named value


class _RuntimeState:
    """What the process's ``libmusart.so`` holds: the pinned host ranges and each thread's pending error.

    Like the MUSA (and CUDA) runtime, every failing call leaves its code as the calling thread's pending error,
    which ``musaGetLastError`` returns and clears and ``musaPeekAtLastError`` returns; torch_musa reads it with
    ``C10_MUSA_KERNEL_LAUNCH_CHECK()`` after every kernel launch (:func:`launch_kernel`).
    """

    def __init__(self) -> None:
        #: ptr -> (nbytes, how): "registered" (musaHostRegister) or "hostalloc" (torch_musa's pinned allocator).
        self.ranges: dict[int, tuple[int, str]] = {}
        #: Every runtime call made, as (name, args): lets tests prove which runtime was used.
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._tls = threading.local()

    def fail(self, code: int) -> int:
        self._tls.pending = code
        return code

    def get_last_error(self) -> int:
        code = getattr(self._tls, "pending", MUSA_SUCCESS)
        self._tls.pending = MUSA_SUCCESS
        return code

    def peek_at_last_error(self) -> int:
        return getattr(self._tls, "pending", MUSA_SUCCESS)

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        with _lock:
            self.calls.append(("musaHostRegister", (ptr, nbytes, flags)))
            if ptr <= 0 or nbytes <= 0:
                return self.fail(MUSA_ERROR_INVALID_VALUE)
            for start, (size, _) in self.ranges.items():
                if ptr < start + size and start < ptr + nbytes:
                    return self.fail(MUSA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            locked = sum(size for size, how in self.ranges.values() if how == "registered")
            if _MEMLOCK_BYTES is not None and locked + nbytes > _MEMLOCK_BYTES:
                return self.fail(MUSA_ERROR_MEMORY_ALLOCATION)
            self.ranges[ptr] = (nbytes, "registered")
            return MUSA_SUCCESS

    def host_unregister(self, ptr: int) -> int:
        with _lock:
            self.calls.append(("musaHostUnregister", (ptr,)))
            held = self.ranges.get(ptr)
            if held is None or held[1] != "registered":  # musaHostAlloc memory is not "registered" either
                return self.fail(MUSA_ERROR_HOST_MEMORY_NOT_REGISTERED)
            del self.ranges[ptr]
            return MUSA_SUCCESS

    def host_alloc(self, nbytes: int) -> torch.Tensor:
        """torch_musa's pinned-memory allocator (musaHostAlloc): a host block pinned by the runtime, kept cached."""
        block = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        with _lock:
            self.ranges[block.data_ptr()] = (block.numel(), "hostalloc")
            _PINNED_BLOCKS.append(block)
        return block

    def is_pinned(self, ptr: int) -> bool:
        with _lock:
            return any(start <= ptr < start + size for start, (size, _) in self.ranges.items())

    def registered_ranges(self) -> dict[int, int]:
        with _lock:
            return {ptr: size for ptr, (size, how) in self.ranges.items() if how == "registered"}


_PINNED_BLOCKS: list[torch.Tensor] = []
_STATE = _RuntimeState()


def _error_text(code: int) -> str:
    return _ERROR_TEXT.get(int(code), f"unknown error {int(code)}")


def launch_kernel(name: str = "emulated_kernel") -> None:
    """Stand-in for a torch_musa kernel launch: ``C10_MUSA_KERNEL_LAUNCH_CHECK()``, i.e. raise the pending error.

    torch_musa checks ``musaGetLastError()`` after every kernel it launches, so an error a runtime call left
    pending (and nobody consumed) is raised by the next, unrelated kernel, as its own.
    """
    _lazy_init()
    code = _STATE.get_last_error()
    if code != MUSA_SUCCESS:
        raise RuntimeError(f"MUSA error: {_error_text(code)}\nMUSA kernel errors might be asynchronously reported "
                           f"at some other API call (while launching {name})")


def emulated_registered_ranges() -> dict[int, int]:
    """Emulation only: the ranges registered now with musaHostRegister (ptr -> nbytes)."""
    return _STATE.registered_ranges()


#: Emulation only: every runtime call made, as (name, args).
RUNTIME_CALLS = _STATE.calls


class EmulatedLibmusart:
    """What ``ctypes.CDLL("libmusart.so")`` gives in a process where torch_musa loaded the runtime: its C functions.

    They share the state torch_musa's bindings use (one runtime per process). Return values are ints, as ctypes
    functions with ``restype = c_int`` return them; ``musaGetErrorString`` returns bytes (``c_char_p``).
    """

    def musaGetLastError(self) -> int:  # noqa: N802 - C symbol name
        return _STATE.get_last_error()

    def musaPeekAtLastError(self) -> int:  # noqa: N802 - C symbol name
        return _STATE.peek_at_last_error()

    def musaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - C symbol name
        return _STATE.host_register(int(ptr), int(nbytes), int(flags))

    def musaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - C symbol name
        return _STATE.host_unregister(int(ptr))

    def musaGetErrorString(self, code: int) -> bytes:  # noqa: N802 - C symbol name
        return _error_text(code).encode()


#: The emulated ``libmusart.so`` of this process (point the MUSA backend's library lookup at it in tests).
LIBMUSART = EmulatedLibmusart()


class _Musart:
    """Emulated bindings, surface "2.7.0": host register/unregister, error strings, and ``musaGetLastError``.

    A superset of any released torch_musa's ``_musart`` (none binds ``musaGetLastError``); kept to cover a backend
    path that prefers the bindings' own drain. ``registered_ranges()`` and ``calls`` are emulation only.
    """

    def __init__(self) -> None:
        self.calls = _STATE.calls
        if _HAS_HOST_REGISTER:
            self.musaHostRegister = self._host_register
            self.musaHostUnregister = self._host_unregister

    def _host_register(self, ptr: int, nbytes: int, flags: int) -> musaError:
        return musaError(_STATE.host_register(ptr, nbytes, flags))

    def _host_unregister(self, ptr: int) -> musaError:
        return musaError(_STATE.host_unregister(ptr))

    def musaGetErrorString(self, error: Any) -> str:  # noqa: N802 - binding name
        """Text of a musaError."""
        return _error_text(int(error))

    def musaGetLastError(self) -> musaError:  # noqa: N802 - binding name
        """Return and clear this thread's pending error, as the runtime does."""
        return musaError(_STATE.get_last_error())

    def registered_ranges(self) -> dict[int, int]:
        """Emulation only: ranges registered now (ptr -> nbytes)."""
        return _STATE.registered_ranges()


def _musart_2_7_1() -> types.ModuleType:
    """torch_musa 2.7.1's ``_musart`` submodule (``torch_musa/csrc/core/musart.cpp``), attribute for attribute.

    ``musaError`` (an enum with one named value, ``success``), ``musaGetErrorString`` (takes a ``musaError``, not
    an int), ``musaHostRegister(ptr, size, flags)``, ``musaHostUnregister(ptr)``, ``musaStreamCreate(ptr)``,
    ``musaStreamDestroy(ptr)`` (each returning a ``musaError`` and, through ``C10_MUSA_ERROR_HANDLED``, leaving a
    failure pending), ``musaMemGetInfo(device)``. No ``musaGetLastError``, no ``musaPeekAtLastError``.
    """
    mod = types.ModuleType("torch_musa._MUSAC._musart", "libmusart.so bindings")

    def musaGetErrorString(error: musaError) -> str:  # noqa: N802 - binding name
        if not isinstance(error, musaError):  # pybind11 enums do not convert from int
            raise TypeError("musaGetErrorString(): incompatible function arguments. The following argument types "
                            f"are supported:\n    1. (arg0: torch_musa._MUSAC._musart.musaError) -> str\n\nInvoked "
                            f"with: {error!r}")
        return _error_text(int(error))

    def musaHostRegister(ptr: int, size: int, flags: int) -> musaError:  # noqa: N802 - binding name
        return musaError(_STATE.host_register(int(ptr), int(size), int(flags)))

    def musaHostUnregister(ptr: int) -> musaError:  # noqa: N802 - binding name
        return musaError(_STATE.host_unregister(int(ptr)))

    def musaStreamCreate(ptr: int) -> musaError:  # noqa: N802 - binding name
        return musaError(MUSA_SUCCESS)

    def musaStreamDestroy(ptr: int) -> musaError:  # noqa: N802 - binding name
        return musaError(MUSA_SUCCESS)

    def musaMemGetInfo(device: int) -> tuple[int, int]:  # noqa: N802 - binding name
        return mem_get_info(device)

    for fn in (musaGetErrorString, musaHostRegister, musaHostUnregister, musaStreamCreate, musaStreamDestroy,
               musaMemGetInfo):
        setattr(mod, fn.__name__, fn)
    mod.musaError = musaError  # type: ignore[attr-defined]
    return mod


#: Public names of torch_musa 2.7.1's ``_musart`` bindings.
MUSART_2_7_1_SURFACE = ("musaError", "musaGetErrorString", "musaHostRegister", "musaHostUnregister",
                        "musaMemGetInfo", "musaStreamCreate", "musaStreamDestroy")

_musart: Any = _musart_2_7_1() if _BINDINGS == "2.7.1" else _Musart()


def musart() -> Any:
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
    """torch_musa's ``Tensor.pin_memory`` (default device "musa"): a copy in a block of its pinned-memory allocator."""
    if self.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{self.device}' memory: only dense CPU tensors can be pinned")
    _lazy_init()
    block = _STATE.host_alloc(self.numel() * self.element_size())
    out = block[: self.numel() * self.element_size()].view(self.dtype).view(self.shape)
    out.copy_(self)
    return out


def _is_pinned(self: torch.Tensor, device: Any = "musa") -> bool:
    """torch_musa's ``Tensor.is_pinned`` (default device "musa"): whether the runtime counts the memory as pinned."""
    return self.device.type == "cpu" and self.numel() > 0 and _STATE.is_pinned(self.data_ptr())


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
