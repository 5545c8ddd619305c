"""A torch-style device module for the CPU reference backend: synchronous streams, timed events.

Work on the host runs in program order, so streams here only record order and events only record
time. Memory statistics report 0: the host has no device allocator to measure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class Event:
    """A host event: records the wall-clock time at which it was recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Record the current time (host work before this point is complete)."""
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` wait for this event (a no-op: host work is in order)."""

    def query(self) -> bool:
        """True: host work is complete when recorded."""
        return True

    def synchronize(self) -> None:
        """Wait for this event (a no-op on the host)."""

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and ``end``."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("both events need enable_timing=True to measure elapsed time")
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1e3


class Stream:
    """A host stream: work submitted to it runs at once, in order."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.device = torch.device("cpu")

    def wait_event(self, event: Event) -> None:
        """Order later work after ``event`` (already true on the host)."""

    def wait_stream(self, stream: Stream) -> None:
        """Order later work after ``stream``'s (already true on the host)."""

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True: all host work submitted is complete."""
        return True

    def synchronize(self) -> None:
        """Wait for this stream's work (a no-op on the host)."""


_default = Stream()
_current: list[Stream] = [_default]


def current_stream(device: object = None) -> Stream:
    """The stream work is submitted to now."""
    return _current[-1]


def default_stream(device: object = None) -> Stream:
    """The default host stream."""
    return _default


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Make ``s`` the current stream inside the block."""
    if s is None:
        yield
        return
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


def synchronize(device: object = None) -> None:
    """Wait for all host work (a no-op)."""


def is_available() -> bool:
    """The host is always available."""
    return True


def is_initialized() -> bool:
    """False: the host needs no initialisation."""
    return False


def device_count() -> int:
    """One host device."""
    return 1


def current_device() -> int:
    """Index 0."""
    return 0


def set_device(device: object) -> None:
    """Accept any index (there is one host)."""


def memory_allocated(device: object = None) -> int:
    """0: the host has no device allocator to measure."""
    return 0


def max_memory_allocated(device: object = None) -> int:
    """0: the host has no device allocator to measure."""
    return 0


def memory_reserved(device: object = None) -> int:
    """0: the host has no device allocator to measure."""
    return 0


def max_memory_reserved(device: object = None) -> int:
    """0: the host has no device allocator to measure."""
    return 0


def reset_peak_memory_stats(device: object = None) -> None:
    """Nothing to reset."""


def empty_cache() -> None:
    """Nothing to free."""
