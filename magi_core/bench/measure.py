"""Measurements through the backend facade: device-event step timing, pinned H2D probe, memory, recompiles."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTimes:
    """Per-step device times (ms, from timing events) and host call times (ms) of the timed steps."""

    device_ms: list[float]
    host_ms: list[float]

    @property
    def median_ms(self) -> float:
        """Median device step time."""
        return statistics.median(self.device_ms)

    @property
    def host_median_ms(self) -> float:
        """Median host time spent inside the call (launch and scheduling work)."""
        return statistics.median(self.host_ms)


def time_steps(backend: Backend, fn: Callable[[], Any], steps: int, warmup: int) -> tuple[StepTimes, Any]:
    """Run ``fn`` ``warmup`` times, then ``steps`` back-to-back times between timing events; return times and output.

    Steps are issued back to back (no synchronisation between them), as a model runs in steady state; each
    step's device time is the elapsed time between events recorded on the current stream around it.
    """
    dm = backend.device_module
    out = None
    for _ in range(warmup):
        out = fn()
    dm.synchronize()
    starts = [dm.Event(enable_timing=True) for _ in range(steps)]
    ends = [dm.Event(enable_timing=True) for _ in range(steps)]
    host: list[float] = []
    for s, e in zip(starts, ends, strict=True):
        t0 = time.perf_counter()
        s.record()
        out = fn()
        e.record()
        host.append((time.perf_counter() - t0) * 1e3)
    dm.synchronize()
    return StepTimes([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], host), out


#: How :func:`host_call_ms` reduces its calls to one figure (recorded in every result document).
HOST_CALL_METHOD = "fastest of 20 calls onto an idle device"


def host_call_ms(backend: Backend, fn: Callable[[], Any], calls: int = 20) -> float:
    """Fastest host time (ms) of ``calls`` calls, each issued onto an idle device (synchronised before and after).

    Starting from an empty launch queue, the call never blocks on a full queue, so this is the host's own
    cost of issuing the step (Python, scheduling and kernel launches) unless the callee itself waits. The
    fastest call, not the median: other load on the host (another process compiling, say) only ever adds
    time, and the bench subtracts two such figures taken minutes apart.
    """
    dm = backend.device_module
    times = []
    for _ in range(calls):
        dm.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    dm.synchronize()
    return min(times)


def measure_h2d_gbps(backend: Backend, nbytes: int, iters: int = 8) -> tuple[float, str]:
    """Host-to-device bandwidth (GB/s) of ``nbytes`` copies from pinned host memory, and how it was pinned.

    The source is registered in place through the backend (as magi-core pins its arenas); if the backend
    refuses, a ``pin_memory()`` copy is used instead and the method says so.
    """
    dm = backend.device_module
    n = max(1, nbytes // 2)
    src = torch.ones(n, dtype=torch.bfloat16)
    dst = torch.empty(n, dtype=torch.bfloat16, device=backend.device())
    registered = False
    method = "host_register"
    try:
        backend.host_register(src.data_ptr(), n * 2)
        registered = True
    except Exception as exc:  # fall back to the allocator's pinned copy, and say so in the result
        logger.warning("H2D probe: host_register refused (%s); using a pin_memory() copy", exc)
        src, method = src.pin_memory(), "pin_memory"
    try:
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        dm.synchronize()
        start, end = dm.Event(enable_timing=True), dm.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        end.record()
        dm.synchronize()
        ms = max(start.elapsed_time(end), 1e-6) / iters
    finally:
        if registered:
            backend.host_unregister(src.data_ptr())
    return n * 2 / (ms / 1e3) / 1e9, method


def reset_peak(backend: Backend) -> None:
    """Synchronise and reset the device's peak-memory counters."""
    dm = backend.device_module
    dm.synchronize()
    dm.reset_peak_memory_stats()


def peak_memory(backend: Backend) -> tuple[int, int]:
    """Peak device bytes (allocated, reserved) since the last :func:`reset_peak`."""
    dm = backend.device_module
    return int(dm.max_memory_allocated()), int(dm.max_memory_reserved())


def free_device_memory(backend: Backend) -> None:
    """Synchronise and return cached device blocks to the device."""
    dm = backend.device_module
    dm.synchronize()
    empty = getattr(dm, "empty_cache", None)
    if empty is not None:
        empty()


def dynamo_graphs() -> int:
    """How many graphs Dynamo has compiled in this process so far (deltas count recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main_tensor(out: Any) -> torch.Tensor:
    """The tensor a model call is judged by: the output itself, a ModelOutput's first set field, a tuple's first.

    transformers' and diffusers' outputs (``logits``, ``sample``) are ordered dicts whose first non-None field is
    the model's result; ``return_dict=False`` gives the same as the first element of a tuple.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        for value in out.values():
            if value is not None:
                return main_tensor(value)
    if isinstance(out, tuple | list) and out:
        return main_tensor(out[0])
    raise TypeError(f"cannot find the main tensor of a {type(out).__name__} output")


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` computed in float32 on the host."""
    a = out.detach().float().cpu()
    b = ref.detach().float().cpu()
    denom = float(b.abs().max())
    return float((a - b).abs().max()) / (denom if denom > 0 else 1.0)


def hardware_name(backend: Backend) -> str:
    """The device's marketing name (accelerators) or the host CPU model (cpu backend)."""
    if backend.is_accelerator:
        get = getattr(backend.device_module, "get_device_name", None)
        if get is not None:
            try:
                return str(get(backend.device().index or 0))
            except Exception:  # a name is cosmetic; never fail the run for it
                pass
        return backend.device_type
    return "cpu " + cpu_name()


def cpu_name() -> str:
    """The host CPU model (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
