"""A torch-style device module over the host that records every call, and every copy made on a side stream.

Copies: while a non-default stream is current (``with stream(s):``), ``Tensor.to`` calls that name a
device are recorded and always produce a new tensor (``copy=True``), so the "device" bytes alive can be
tracked: :func:`memory_allocated` / :func:`max_memory_allocated` count those copies until they are freed.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from magi_core.plugin.cpu import device as cpu_device

LOG: list[tuple[Any, ...]] = []
#: Stream id each event was last recorded on (kept across ``LOG.clear()``).
EVENT_STREAM: dict[int, int] = {}
_ids = itertools.count(1)
_alive = 0
_peak = 0


def _free(nbytes: int) -> None:
    global _alive
    _alive -= nbytes


class Event(cpu_device.Event):
    """A host event that logs record / wait / synchronize."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        super().__init__(enable_timing=enable_timing)
        self.eid = next(_ids)

    def record(self, stream: Any = None) -> None:
        """Log and record."""
        s = stream if stream is not None else current_stream()
        LOG.append(("event_record", self.eid, s.sid))
        EVENT_STREAM[self.eid] = s.sid
        super().record(stream)

    def synchronize(self) -> None:
        """Log the host wait."""
        LOG.append(("event_synchronize", self.eid))


class Stream(cpu_device.Stream):
    """A host stream that logs waits."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        super().__init__(device, priority)
        self.sid = next(_ids)
        LOG.append(("stream_new", self.sid))

    def wait_event(self, event: Event) -> None:
        """Log the device-side wait."""
        LOG.append(("wait_event", self.sid, event.eid))

    def wait_stream(self, stream: Stream) -> None:
        """Log the stream wait."""
        LOG.append(("wait_stream", self.sid, stream.sid))

    def synchronize(self) -> None:
        """Log the host wait."""
        LOG.append(("stream_synchronize", self.sid))


class _CopyRecorder(TorchFunctionMode):
    def __init__(self, sid: int) -> None:
        super().__init__()
        self.sid = sid

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.to and (len(args) > 1 or "device" in kwargs):
            global _alive, _peak
            src = args[0]
            out = func(*args, **{**kwargs, "copy": True})
            nbytes = out.untyped_storage().nbytes()
            LOG.append(("copy", src.data_ptr(), src.nbytes, self.sid, bool(kwargs.get("non_blocking", False))))
            _alive += nbytes
            _peak = max(_peak, _alive)
            weakref.finalize(out, _free, nbytes)
            return out
        if func is torch.Tensor.copy_ and len(args) > 1:  # into memory that already exists (a planned place)
            src = args[1]
            LOG.append(("copy", src.data_ptr(), src.nbytes, self.sid, bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


_default = Stream()
_current: list[Stream] = [_default]


def current_stream(device: object = None) -> Stream:
    """The current stream."""
    return _current[-1]


def default_stream(device: object = None) -> Stream:
    """The default stream."""
    return _default


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Make ``s`` current; on a side stream, record the copies made inside."""
    if s is None:
        yield
        return
    LOG.append(("stream_enter", s.sid))
    _current.append(s)
    try:
        if s is _default:
            yield
        else:
            with _CopyRecorder(s.sid):
                yield
    finally:
        _current.pop()
        LOG.append(("stream_exit", s.sid))


def synchronize(device: object = None) -> None:
    """Log a device-wide wait."""
    LOG.append(("synchronize",))


is_available = cpu_device.is_available
is_initialized = cpu_device.is_initialized
device_count = cpu_device.device_count
current_device = cpu_device.current_device
set_device = cpu_device.set_device
empty_cache = cpu_device.empty_cache


def memory_allocated(device: object = None) -> int:
    """Bytes of side-stream copies alive now."""
    return _alive


def max_memory_allocated(device: object = None) -> int:
    """Peak of :func:`memory_allocated` since the last reset."""
    return _peak


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device: object = None) -> None:
    """Set the peak to the bytes alive now."""
    global _peak
    _peak = _alive
