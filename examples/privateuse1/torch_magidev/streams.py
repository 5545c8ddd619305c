"""Streams and events of the emulated device: ops run when called; the clocks feed the stream-ordering checker.

:class:`Stream` is a ``torch.Stream`` subclass (device type ``magidev``), so ``Tensor.record_stream`` accepts
it; the dispatcher hands streams back as plain ``torch.Stream`` objects, which :func:`lookup` maps to ours by
(device index, stream id). The current stream is per thread and per device, as on CUDA.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torch_magidev import _state
from torch_magidev._state import DEVICE_TYPE_ID, LOCK
from torch_magidev.checker import CHECKER, StreamKey

_ids = itertools.count(1)
_streams: weakref.WeakValueDictionary[StreamKey, Stream] = weakref.WeakValueDictionary()
_defaults: dict[int, Stream] = {}
_tls = threading.local()


class Stream(torch.Stream):
    """An emulated stream: work "enqueued" on it runs at once; its position and clock feed the checker."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        _state.lazy_init()
        index = _state.index_of(device)
        sid = kwargs.pop("_stream_id", None)
        sid = next(_ids) if sid is None else sid
        self = super().__new__(cls, stream_id=sid, device_index=index, device_type=DEVICE_TYPE_ID)
        return self

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.key: StreamKey = (self.device_index, self.stream_id)
        self._priority = priority
        with LOCK:
            _streams[self.key] = self

    def wait_event(self, event: Event) -> None:
        """Order this stream's later work after ``event`` (a no-op for an event never recorded)."""
        if event._snap is not None:
            CHECKER.stream_wait(self.key, event._snap)

    def wait_stream(self, stream: Stream) -> None:
        """Order this stream's later work after the work enqueued on ``stream`` so far."""
        CHECKER.stream_wait(self.key, CHECKER.snapshot(lookup(stream).key))

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True: emulated work is complete when it returns (tells the host this stream's work is done)."""
        CHECKER.host_wait_stream(self.key)
        return True

    def synchronize(self) -> None:
        """Wait on the host for this stream's work."""
        CHECKER.raise_pending()
        CHECKER.host_wait_stream(self.key)

    def __enter__(self) -> Stream:
        _stack(self.device_index).append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack(self.device_index).pop()

    def __repr__(self) -> str:
        return f"torch.magidev.Stream(device=magidev:{self.device_index}, stream_id={self.stream_id})"


class Event:
    """An emulated event: what its stream had done when recorded (for the checker), and the host time (timing)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._snap: dict[StreamKey, int] | None = None
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Record on ``stream`` (the current stream by default)."""
        s = lookup(stream) if stream is not None else current_stream()
        self._snap = CHECKER.snapshot(s.key)
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (the current stream by default) wait for this event."""
        s = lookup(stream) if stream is not None else current_stream()
        s.wait_event(self)

    def query(self) -> bool:
        """True: recorded work is complete at once (tells the host so)."""
        if self._snap is not None:
            CHECKER.host_wait(self._snap)
        return True

    def synchronize(self) -> None:
        """Wait on the host for this event."""
        CHECKER.raise_pending()
        if self._snap is not None:
            CHECKER.host_wait(self._snap)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds of host time between this event's and ``end_event``'s records."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) * 1e3


def _stack(index: int) -> list[Stream]:
    stacks = getattr(_tls, "stacks", None)
    if stacks is None:
        stacks = _tls.stacks = {}
    return stacks.setdefault(index, [])


def default_stream(device: Any = None) -> Stream:
    """The default stream (id 0) of ``device`` (the current device by default; initialises)."""
    index = _state.index_of(device)
    with LOCK:
        s = _defaults.get(index)
        if s is None:
            s = _defaults[index] = Stream(index, _stream_id=0)
        return s


def current_stream(device: Any = None) -> Stream:
    """The stream work on ``device`` goes to now, in this thread (initialises)."""
    index = _state.index_of(device)
    stack = _stack(index)
    return stack[-1] if stack else default_stream(index)


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current for its device in this thread."""
    s = lookup(stream)
    stack = _stack(s.device_index)
    if stack:
        stack[-1] = s
    else:
        stack.append(s)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Context manager making ``s`` current for its device (None: no change)."""
    if s is None:
        yield
        return
    s = lookup(s)
    stack = _stack(s.device_index)
    stack.append(s)
    try:
        yield
    finally:
        stack.pop()


def lookup(s: Any) -> Stream:
    """Our :class:`Stream` for ``s`` (ours, or a ``torch.Stream`` the dispatcher made from one of ours)."""
    if isinstance(s, Stream):
        return s
    if isinstance(s, torch.Stream) and s.device_type == DEVICE_TYPE_ID:
        if s.stream_id == 0:
            return default_stream(s.device_index)
        found = _streams.get((s.device_index, s.stream_id))
        if found is not None:
            return found
    raise TypeError(f"magidev: {s!r} is not a magidev stream (make one with torch.magidev.Stream())")


def synchronize(device: Any = None) -> None:
    """Wait on the host for all work on ``device`` (initialises)."""
    index = _state.index_of(device)
    CHECKER.raise_pending()
    CHECKER.host_wait_device(index)
