"""What the device can spare for a model's weights: free memory, its activations and a reserve.

The fit-the-card budget (``OffloadConfig`` with neither a ratio nor a budget) is the device's free memory,
plus what the model's own runtimes hold there now (their plans are replaced, not added to), less the
activation peak measured in warm-up and :data:`~magi_core.config.DEVICE_RESERVE_BYTES`. Activations are
measured through the device module's peak statistics (``reset_peak_memory_stats`` / ``max_memory_allocated``),
which the warm-up calls therefore reset; on a device module without them the activation peak counts as 0.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from magi_core.config import DEVICE_RESERVE_BYTES, DEVICE_RESERVE_SHARE
from magi_core.errors import DeviceMemoryError
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceRoom:
    """The device's memory as planning sees it (bytes)."""

    #: What this process can still allocate on the device now.
    free: int
    #: The device's capacity for this process (a cap set on the process, where one is).
    total: int
    #: What the model's runtimes on the device hold now (copy buffers, resident weights): theirs to re-plan.
    held: int
    #: The largest activation peak measured in the model's warm-up calls.
    activations: int
    #: Kept free for fragmentation and workspaces (:func:`device_reserve`).
    reserve: int = DEVICE_RESERVE_BYTES

    @property
    def spare(self) -> int:
        """Bytes the model's weights may take on the device (never below 0)."""
        return max(0, self.free + self.held - self.activations - self.reserve)

    def describe(self) -> str:
        """The figures, for messages."""
        return (f"{_size(self.free + self.held)} free for this model of {_size(self.total)}, less "
                f"{_size(self.activations)} of activations measured in warm-up and a reserve of {_size(self.reserve)}: "
                f"{_size(self.spare)} for weights")


def release_cached_blocks(backend: Backend) -> None:
    """Hand the device allocator's unused cached blocks back (the device module's ``empty_cache``, where it has one)."""
    empty = getattr(backend.device_module, "empty_cache", None)
    if callable(empty):
        empty()


def device_reserve(total: int) -> int:
    """Bytes the fit-the-card budget keeps free on a device of ``total`` bytes."""
    return DEVICE_RESERVE_BYTES + int(DEVICE_RESERVE_SHARE * total)


def device_room(backend: Backend, device: torch.device, held: int, activations: int,
                release_cached: bool = False) -> DeviceRoom | None:
    """The device's room now, or None when the backend cannot say how much memory its device has.

    ``release_cached``: first hand the caching allocator's unused blocks back (the device module's
    ``empty_cache``), so what is free is one clean pool, not fragments of earlier allocations.
    """
    if release_cached:
        release_cached_blocks(backend)
    info = backend.device_memory(device)
    if info is None:
        return None
    total = int(info.total)
    return DeviceRoom(free=int(info.free), total=total, held=held, activations=activations,
                      reserve=device_reserve(total))


class PeakMeter:
    """Device memory a call allocates beyond what was allocated before it (its peak), through the device module.

    ``measure()`` resets the device's peak statistic; :attr:`peak` is the largest increase seen so far.
    """

    def __init__(self, device_module: ModuleType, device: torch.device) -> None:
        self._dm = device_module
        self._device = device
        self.available = all(callable(getattr(device_module, name, None))
                             for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"))
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Measure the block's peak allocation above the allocation at its start."""
        if not self.available:
            yield
            return
        dm, dev = self._dm, self._device
        base = int(dm.memory_allocated(dev))
        dm.reset_peak_memory_stats(dev)
        try:
            yield
        finally:
            self.peak = max(self.peak, int(dm.max_memory_allocated(dev)) - base)


def check_unit_fits(room: DeviceRoom | None, need: int, unit_label: str, unit_bytes: int,
                    device: torch.device) -> None:
    """Raise :class:`DeviceMemoryError` before anything is allocated when streaming one unit at a time cannot fit."""
    if room is None or need <= room.free + room.held - room.reserve:
        return
    raise DeviceMemoryError(
        f"this model does not fit {device}: streaming needs {_size(need)} on the device for weights in flight, its "
        f"largest unit {unit_label!r} alone holds {_size(unit_bytes)}, and the device has "
        f"{_size(room.free + room.held)} free for it ({_size(room.total)} in all, {_size(room.reserve)} kept in "
        "reserve). Split units further with OffloadConfig(max_unit_bytes=...) (a block cannot be split below one "
        "op's weights), free device memory, or use a larger device"
    )


def _size(nbytes: int) -> str:
    """Bytes for a message: GiB from 1 GiB up, else MiB."""
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


__all__ = ["DeviceRoom", "PeakMeter", "check_unit_fits", "device_reserve", "device_room", "release_cached_blocks"]
