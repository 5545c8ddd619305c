"""``torch_magidev``: an EMULATED vendor extension for a PrivateUse1 device, ``magidev``, backed by host memory.

What a vendor's ``torch_xxx`` package does to torch, importing this package does too: it renames torch's
PrivateUse1 backend to ``"magidev"``, registers this module as ``torch.magidev`` (so
``torch.get_device_module("magidev")`` returns it), registers PrivateUse1 hooks and a device guard (so
``torch.accelerator`` and Dynamo see an accelerator), and registers kernels so tensors can live on
``magidev``. Importing initialises nothing: the runtime initialises on first use (a stream, an
allocation, ``current_device()``), as CUDA's does.

The device's memory is distinct from the host's: a magidev tensor owns a private host tensor
(:mod:`torch_magidev.tensor`), so ``.to("magidev")`` really copies and a host tensor changed afterwards
leaves the device copy unchanged. Ops run synchronously when called; streams and events keep the clocks
of a real device so that :mod:`torch_magidev.checker` can flag device memory freed or overwritten without
the stream ordering a real device needs (e.g. "freed without ``record_stream``").

Not emulated: asynchrony (``non_blocking`` copies complete at once), Inductor / Triton kernels (compile with
``backend="eager"``), pinned memory allocation (``Tensor.pin_memory()``; register host ranges in place with
:func:`runtime` instead), a caching allocator, device-side random generators (random ops use the host's),
autocast, and resizing a magidev tensor in place. One PrivateUse1 backend per process: importing this after
another extension (torch_musa, ...) renamed PrivateUse1 raises.

Device memory is finite: ``MAGIDEV_TOTAL_MEMORY`` per device, or less where the process capped itself with
:func:`set_per_process_memory_fraction`; an allocation past it raises ``torch.OutOfMemoryError``.

Environment: ``MAGIDEV_DEVICE_COUNT`` (default 1), ``MAGIDEV_TOTAL_MEMORY`` (bytes, default 16 GiB),
``MAGIDEV_STRICT=1`` (checker violations raise), ``MAGIDEV_CHECK=0`` (checker off).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_magidev import _state, checker
from torch_magidev._state import DEVICE_TYPE, is_initialized
from torch_magidev.checker import StreamOrderError, Violation
from torch_magidev.memory import (
    empty_cache,
    get_per_process_memory_fraction,
    live_blocks,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
    stats,
    total_memory,
)
from torch_magidev.runtime import RUNTIME, Runtime
from torch_magidev.streams import Event, Stream, current_stream, default_stream, set_stream, stream, synchronize
from torch_magidev.tensor import MagidevTensor

__version__ = "0.1.0+emulated"
#: This is an emulation (host memory), not a vendor's device: say "emulated" wherever its results are reported.
EMULATED = True


def is_available() -> bool:
    """True when the emulated runtime reports a device (``MAGIDEV_DEVICE_COUNT`` > 0); does not initialise."""
    return _state.DEVICE_COUNT > 0


def device_count() -> int:
    """Number of emulated devices; does not initialise."""
    return _state.DEVICE_COUNT


def current_device() -> int:
    """Index of the calling thread's current device (initialises)."""
    return _state.current_index()


def set_device(device: Any) -> None:
    """Make ``device`` (an index or a magidev device) current for the calling thread (initialises)."""
    _state.set_index(_state.index_of(device))


@contextlib.contextmanager
def device(device: Any) -> Iterator[None]:
    """Context manager making ``device`` current inside the block."""
    before = current_device()
    set_device(device)
    try:
        yield
    finally:
        set_device(before)


def get_device_name(device: Any = None) -> str:
    """The device's name (says it is emulated)."""
    return f"magidev {_state.index_of(device)} (emulated, host memory)"


@dataclass(frozen=True)
class DeviceProperties:
    """What :func:`get_device_properties` returns: the fields of ``torch.cuda``'s that a backend reads."""

    name: str
    total_memory: int


def get_device_properties(device: Any = None) -> DeviceProperties:
    """The device's name and whole memory (``MAGIDEV_TOTAL_MEMORY``, whatever cap the process set), as torch.cuda."""
    return DeviceProperties(name=get_device_name(device), total_memory=total_memory(device))


def runtime() -> Runtime:
    """The runtime bindings (host register / unregister, error strings), as ``torch.cuda.cudart()`` (initialises)."""
    _state.lazy_init()
    return RUNTIME


# -- random numbers: random ops on magidev draw from the host generator (seeded by torch.manual_seed) ------
def _is_in_bad_fork() -> bool:
    """False: the emulated runtime works in forked children."""
    return False


def manual_seed(seed: int) -> None:
    """Nothing to seed: magidev random ops use the host generator, which ``torch.manual_seed`` seeds."""


def manual_seed_all(seed: int) -> None:
    """Nothing to seed (see :func:`manual_seed`)."""


def seed() -> None:
    """Nothing to seed (see :func:`manual_seed`)."""


def seed_all() -> None:
    """Nothing to seed (see :func:`manual_seed`)."""


def initial_seed() -> int:
    """The host generator's initial seed."""
    return torch.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The host generator's state (magidev has no generator of its own)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    """Set the host generator's state."""
    torch.set_rng_state(new_state)


# -- what importing the extension does to torch -----------------------------------------------------------
class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """What the C++ PrivateUse1 hooks tell torch."""

    def is_available(self) -> bool:
        return _state.DEVICE_COUNT > 0

    def has_primary_context(self, dev_id: int) -> bool:
        return _state.is_initialized()

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """The device guard torch.accelerator (and Dynamo's stream tracking) queries."""

    # torch._dynamo.disable: torch calls this from C++ while Dynamo runs a compiled frame; left to Dynamo's frame
    # callback, that call keeps the compiled frame's code alive after torch._dynamo.reset() (torch 2.13: the
    # compiled function, and everything its backend holds, is then never freed). torch's own
    # _DummyDeviceGuard escapes it only because Dynamo skips files under torch/.
    @torch._dynamo.disable
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


def _install() -> None:
    module = sys.modules[__name__]
    if getattr(torch, DEVICE_TYPE, None) is module:
        return
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        raise RuntimeError(
            f"torch_magidev: torch's PrivateUse1 backend is already named {taken!r} in this process (another "
            f"extension, such as torch_musa, was imported first); one PrivateUse1 backend per process: run magidev "
            f"in a process that does not import {taken!r}'s extension"
        )
    from torch_magidev.tensor import register_kernels

    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module(DEVICE_TYPE, module)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    register_kernels()


_install()

__all__ = [
    "DEVICE_TYPE", "EMULATED", "DeviceProperties", "Event", "MagidevTensor", "Runtime", "Stream", "StreamOrderError",
    "Violation", "checker", "current_device", "current_stream", "default_stream", "device", "device_count",
    "empty_cache", "get_device_name", "get_device_properties", "get_per_process_memory_fraction", "get_rng_state",
    "initial_seed", "is_available",
    "is_initialized", "live_blocks", "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_allocated", "memory_reserved", "reset_peak_memory_stats", "runtime", "seed", "seed_all",
    "set_device", "set_per_process_memory_fraction", "set_rng_state", "set_stream", "stats", "stream",
    "synchronize", "total_memory",
]
