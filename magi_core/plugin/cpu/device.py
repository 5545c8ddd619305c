"""The reference device module: what ``magi_device_module`` must return, for the host, run synchronously.

The CPU backend returns this module; a backend author can copy it or subclass its classes (import it from
``magi_core.plugin.cpu.device``). It implements every attribute of the device-module contract
(:data:`magi_core.plugin.DEVICE_MODULE_REQUIRED` and :data:`magi_core.plugin.DEVICE_MODULE_EXPECTED`;
the backend author's guide, "The device-module contract"), each with the semantics magi-core relies on:

* :class:`Stream` is a ``torch.Stream`` subclass (``Tensor.record_stream`` accepts nothing else), created
  without initialising anything; equal only to itself. ``wait_event``, ``wait_stream``, ``record_event``,
  ``query`` and ``synchronize`` order work; here work runs at once, in program order, so they only record.
* :class:`Event` takes ``enable_timing`` (``Event(enable_timing=True)``); ``record(stream)``, ``wait(stream)``,
  ``query()``, ``synchronize()`` and ``elapsed_time(end)`` in milliseconds.
* ``current_stream()``, ``default_stream()`` and the context manager ``stream(s)`` (``None``: no change): the
  current stream is per thread, as on CUDA.
* ``synchronize()``, ``is_available()``, ``is_initialized()``, ``device_count()``, ``current_device()``,
  ``set_device()``; none of them initialises a device (``is_initialized()`` stays False here).
* memory statistics in bytes: ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
  ``max_memory_reserved``, ``reset_peak_memory_stats``, ``empty_cache`` (the host has no device allocator:
  0, and no-ops), plus ``get_device_name``.

``torch.cpu`` itself does not conform: its events do not time, it has no memory statistics, and its ``Stream`` is
not a ``torch.Stream``.
"""

from __future__ import annotations

import contextlib
import platform
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

#: The torch device type of this module's streams.
DEVICE_TYPE = "cpu"


class Event:
    """A host event: records the wall-clock time at which it was recorded (milliseconds between two of them)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Record this event on ``stream`` (the current stream by default); host work before it is complete."""
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (the current stream by default) wait for this event (a no-op: host work is in order)."""

    def query(self) -> bool:
        """True when the work recorded before the event is complete (always, on the host)."""
        return True

    def synchronize(self) -> None:
        """Block the host until the event's work is complete (a no-op on the host)."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and ``end_event``; both need ``enable_timing=True`` and a record."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("both events need enable_timing=True to measure elapsed time")
        if self._t is None or end_event._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end_event._t - self._t) * 1e3


class Stream(torch.Stream):
    """A host stream: work submitted to it runs at once, in order. A ``torch.Stream``, equal only to itself.

    Subclassing it for another device type: override ``__new__`` to create the ``torch.Stream`` for that device
    (``torch.Stream.__new__(cls, device=...)`` needs a device guard that supports streams, registered by the
    vendor's extension), and do not initialise the device before a stream is first created.
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        return super().__new__(cls, device=torch.device(DEVICE_TYPE), priority=priority)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)

    def wait_event(self, event: Any) -> None:
        """Order later work on this stream after ``event`` (already true on the host)."""

    def wait_stream(self, stream: torch.Stream) -> None:
        """Order later work on this stream after the work submitted to ``stream`` so far (already true)."""

    def record_event(self, event: Any = None) -> Any:
        """Record ``event`` (an :class:`Event`, or a new one) on this stream and return it."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True when all work submitted to this stream is complete (always, on the host)."""
        return True

    def synchronize(self) -> None:
        """Block the host until this stream's work is complete (a no-op on the host)."""

    def __repr__(self) -> str:
        return f"<magi_core.plugin.cpu.device.Stream at {id(self):#x}>"


_default: Stream | None = None
_default_lock = threading.Lock()
_local = threading.local()


def default_stream(device: object = None) -> Stream:
    """The default host stream (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Stream()
        return _default


def _stack() -> list[Stream]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_stream(device: object = None) -> Stream:
    """The stream this thread submits work to now (the default stream outside any :func:`stream` block)."""
    stack = _stack()
    return stack[-1] if stack else default_stream()


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Make ``s`` this thread's current stream inside the block (``None``: leave the current stream)."""
    if s is None:
        yield
        return
    stack = _stack()
    stack.append(s)
    try:
        yield
    finally:
        stack.pop()


def synchronize(device: object = None) -> None:
    """Block the host until all work on the device is complete (a no-op)."""


def is_available() -> bool:
    """True when this process can use the device (the host always can); must not initialise it."""
    return True


def is_initialized() -> bool:
    """Whether the device runtime has been initialised in this process (False: the host needs none)."""
    return False


def device_count() -> int:
    """How many devices this process sees (one host); must not initialise the device."""
    return 1


def current_device() -> int:
    """The index of this thread's current device (0)."""
    return 0


def set_device(device: object) -> None:
    """Make ``device`` current for this thread (there is one host)."""


def get_device_name(device: object = None) -> str:
    """A readable name of the device (the host processor)."""
    return platform.processor() or platform.machine() or "host CPU"


def memory_allocated(device: object = None) -> int:
    """Bytes of device memory held by tensors now (0: the host has no device allocator to measure)."""
    return 0


def max_memory_allocated(device: object = None) -> int:
    """Peak of :func:`memory_allocated` since the last :func:`reset_peak_memory_stats` (0 on the host)."""
    return 0


def memory_reserved(device: object = None) -> int:
    """Bytes the device allocator has reserved now (0 on the host)."""
    return 0


def max_memory_reserved(device: object = None) -> int:
    """Peak of :func:`memory_reserved` since the last reset (0 on the host)."""
    return 0


def reset_peak_memory_stats(device: object = None) -> None:
    """Start the peak statistics anew (nothing to reset on the host)."""


def empty_cache() -> None:
    """Return cached, unused device memory to the device (nothing cached on the host)."""
