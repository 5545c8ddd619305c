"""Device-side measurements for planning: per-unit compute times and host-to-device bandwidth.

Device access goes through the backend facade only (``get_backend()``): its device module's events and
streams, and ``host_register`` / ``host_unregister`` for the pinned probe buffer. :func:`broadcast_profiles`
and :func:`broadcast_value` give rank 0's figures to every rank, for plans that must be the same on every rank
(the weight exchange); a model call plans from this rank's own figures otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError, MagiError
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)


class UnitTimer:
    """Times each unit of one profiling call with a pair of timing events on the compute stream.

    Accepted forms: ``UnitTimer(backend, n_units)``, ``UnitTimer(n_units, backend=backend)`` and
    ``UnitTimer(n_units)`` (active backend). Call :meth:`start` / :meth:`stop` around each unit's launch
    (after the compute stream waits for the unit's weights, so waiting is not counted); no barrier is put
    between units. :meth:`result` synchronizes once and returns every unit's compute time in ms.
    """

    def __init__(
        self,
        backend_or_units: Backend | int,
        n_units: int | None = None,
        *,
        backend: Backend | None = None,
        stream: Any = None,
    ) -> None:
        if isinstance(backend_or_units, Backend):
            backend, count = backend_or_units, n_units
        else:
            count = backend_or_units
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise MagiError(f"UnitTimer: n_units must be an int >= 0, got {count!r}")
        self.backend = backend if backend is not None else get_backend()
        self.n_units = count
        dm = self.backend.device_module
        self._current_stream = dm.current_stream
        self._stream = stream
        self._starts = [dm.Event(enable_timing=True) for _ in range(count)]
        self._ends = [dm.Event(enable_timing=True) for _ in range(count)]
        self._started = [False] * count
        self._stopped = [False] * count
        self._result: list[float] | None = None

    def _on(self) -> Any:
        return self._stream if self._stream is not None else self._current_stream()

    def start(self, unit: int) -> None:
        """Record unit ``unit``'s start event on the compute stream (asynchronous)."""
        if self._started[unit]:
            raise MagiError(f"UnitTimer: unit {unit} was already started; use a new UnitTimer per profiling call")
        self._starts[unit].record(self._on())
        self._started[unit] = True

    def stop(self, unit: int) -> None:
        """Record unit ``unit``'s end event on the compute stream (asynchronous)."""
        if not self._started[unit] or self._stopped[unit]:
            raise MagiError(f"UnitTimer: stop({unit}) without a matching start({unit})")
        self._ends[unit].record(self._on())
        self._stopped[unit] = True

    def result(self) -> list[float]:
        """Synchronize once and return each unit's compute time in milliseconds."""
        if self._result is None:
            missing = [i for i in range(self.n_units) if not self._stopped[i]]
            if missing:
                raise MagiError(
                    f"UnitTimer: units {missing[:10]} were not timed; call start(i)/stop(i) around every unit"
                )
            for e in self._ends:  # one wait in practice: after the first, the rest have completed
                e.synchronize()
            self._result = [max(0.0, float(s.elapsed_time(e))) for s, e in zip(self._starts, self._ends, strict=True)]
        return list(self._result)

    #: Alias of :meth:`result`.
    elapsed_ms = result


def measure_h2d_bandwidth(
    backend: Backend | None = None,
    nbytes: int | None = None,
    *,
    device: torch.device | None = None,
    iters: int = 3,
    warmup: int = 1,
    host_buffer: torch.Tensor | None = None,
    broadcast: bool = True,
) -> float:
    """Host-to-device copy bandwidth in bytes/s from a host buffer registered in place (pinned).

    The buffer (``host_buffer``, or a new one of ``nbytes``; None: 1 GiB on accelerators, 16 MiB on the CPU
    backend) is registered with ``backend.host_register`` and always unregistered afterwards; copies run on
    a side stream, timed with the device module's events after ``warmup`` untimed copies. On the CPU backend
    this measures a host memcpy. Under an initialised ``torch.distributed`` group every rank measures and
    rank 0's figure is returned on all ranks (``broadcast=False``: this rank's own figure).
    """
    backend = backend if backend is not None else get_backend()
    if host_buffer is not None:
        if host_buffer.device.type != "cpu" or not host_buffer.is_contiguous():
            raise ConfigError("measure_h2d_bandwidth: host_buffer must be a contiguous host tensor")
        host = host_buffer.view(torch.uint8).view(-1)
        nbytes = host.numel()
    else:
        if nbytes is None:
            nbytes = OffloadConfig().probe_bytes(backend.is_accelerator)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"measure_h2d_bandwidth: nbytes={nbytes!r} is invalid; valid: an int > 0")
        host = _probe_buffer(nbytes, None, "the host")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"measure_h2d_bandwidth: iters={iters} (valid >= 1), warmup={warmup} (valid >= 0)")
    device = device if device is not None else backend.device()
    dm = backend.device_module
    if backend.is_accelerator:
        room = backend.device_memory(device)
        if room is not None and nbytes > room.free:
            raise _probe_too_large(nbytes, str(device), f"{room.free} bytes are free there")
    ptr = host.data_ptr()
    backend.host_register(ptr, nbytes)
    try:
        dst = _probe_buffer(nbytes, device, str(device))
        side = dm.Stream()
        start, end = dm.Event(enable_timing=True), dm.Event(enable_timing=True)
        side.wait_stream(dm.current_stream())
        with backend.range("magi.h2d_probe"), dm.stream(side):
            for _ in range(warmup):
                dst.copy_(host, non_blocking=True)
            start.record(side)
            for _ in range(iters):
                dst.copy_(host, non_blocking=True)
            end.record(side)
        end.synchronize()
        ms = float(start.elapsed_time(end))
        del dst
    finally:
        backend.host_unregister(ptr)
    bandwidth = nbytes * iters / max(ms, 1e-6) * 1e3
    logger.debug("h2d probe: %d B x %d in %.3f ms = %.2f GB/s", nbytes, iters, ms, bandwidth / 1e9)
    return broadcast_value(bandwidth) if broadcast else bandwidth


def _probe_buffer(nbytes: int, device: torch.device | None, where: str) -> torch.Tensor:
    """The probe's buffer of ``nbytes`` (on the host when ``device`` is None); a size that cannot be allocated is
    a :class:`ConfigError` naming the setting, not the allocator's error."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise _probe_too_large(nbytes, where, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _probe_too_large(nbytes: int, where: str, why: str) -> ConfigError:
    return ConfigError(
        f"the host-to-device bandwidth probe cannot allocate {nbytes} bytes on {where} ({why}); set "
        "OffloadConfig.bandwidth_probe_bytes (MAGI_OFFLOAD_BANDWIDTH_PROBE_BYTES) lower, e.g. 1GiB (the default on "
        "accelerators), or leave it unset"
    )


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def broadcast_value(value: float, src: int = 0, group: Any = None) -> float:
    """``value`` from rank ``src`` on every rank (unchanged without an initialised process group)."""
    if not _distributed():
        return float(value)
    box: list[Any] = [float(value)]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return float(box[0])


def broadcast_profiles(compute_ms: Sequence[float], src: int = 0, group: Any = None) -> list[float]:
    """Per-unit compute times from rank ``src`` on every rank (unchanged without a process group)."""
    values = [float(x) for x in compute_ms]
    if not _distributed():
        return values
    box: list[Any] = [values]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    if len(box[0]) != len(values):
        raise MagiError(
            f"broadcast_profiles: rank {src} has {len(box[0])} units, this rank {len(values)}; every rank must "
            "compile the same graph split"
        )
    return [float(x) for x in box[0]]
