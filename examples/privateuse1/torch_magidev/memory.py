"""Device memory of the emulated device: one block per storage of the host tensors behind magidev tensors.

A magidev tensor holds a private host tensor (its "device memory", never the host tensor it was copied
from). Each storage is a :class:`~torch_magidev.checker.Block`, counted from the first magidev tensor on it
until the last one dies (a weakref finalizer on each tensor): ``memory_allocated`` is the sum of live
blocks' bytes. There is no caching allocator: a freed block's bytes are released at once
(``memory_reserved`` equals ``memory_allocated``; ``empty_cache`` has nothing to do).

Capacity: each device has ``MAGIDEV_TOTAL_MEMORY`` bytes, and a process may cap itself below that with
:func:`set_per_process_memory_fraction` (as ``torch.cuda``'s allocator does). A new block that would take the live
bytes past the device's capacity (the cap, when one is set) raises ``torch.OutOfMemoryError``, as a real device's
allocator does; :func:`mem_get_info` reports the capacity and what is left of it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from torch_magidev import _state
from torch_magidev._state import LOCK
from torch_magidev.checker import CHECKER, Block

_blocks: dict[tuple[int, int], Block] = {}
_allocated: dict[int, int] = {}
_peak: dict[int, int] = {}
#: Per-process caps (device index -> bytes) set by :func:`set_per_process_memory_fraction`.
_caps: dict[int, int] = {}
#: Copies between host and device memory: counts and bytes (``stats()``).
COUNTERS = {"h2d_copies": 0, "h2d_bytes": 0, "d2h_copies": 0, "d2h_bytes": 0, "allocations": 0, "frees": 0}


def attach(tensor: Any, inner: torch.Tensor, index: int, stream_key: tuple[int, int], pos: int) -> Block | None:
    """Count ``tensor`` (a new magidev tensor over ``inner``) on its block; a new block is allocated on the stream."""
    storage = inner.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    key = (index, storage.data_ptr())
    with LOCK:
        block = _blocks.get(key)
        if block is None:
            dtype = str(inner.dtype).replace("torch.", "")
            _check_capacity(index, nbytes, f"{dtype}{list(inner.shape)}")
            desc = f"a magidev:{index} block of {nbytes} B ({dtype}{list(inner.shape)})"
            block = _blocks[key] = Block(key=key, nbytes=nbytes, alloc_stream=stream_key, desc=desc)
            CHECKER.on_alloc(block, stream_key, pos)
            now = _allocated.get(index, 0) + nbytes
            _allocated[index] = now
            if now > _peak.get(index, 0):
                _peak[index] = now
            COUNTERS["allocations"] += 1
        block.refs += 1
    f = weakref.finalize(tensor, _release, key)
    f.atexit = False
    return block


def capacity(index: int) -> int:
    """Bytes device ``index`` may hold for this process: the cap when one is set, else the device's total."""
    return _caps.get(index, _state.TOTAL_MEMORY)


def _check_capacity(index: int, nbytes: int, what: str) -> None:
    """Raise ``torch.OutOfMemoryError`` when a new block of ``nbytes`` does not fit (the caller holds LOCK)."""
    limit = capacity(index)
    held = _allocated.get(index, 0)
    if held + nbytes <= limit:
        return
    capped = f" (this process is capped at {limit} B of {_state.TOTAL_MEMORY} B)" if index in _caps else ""
    raise torch.OutOfMemoryError(
        f"magidev out of memory. Tried to allocate {nbytes} B ({what}). magidev:{index} has a total capacity of "
        f"{limit} B{capped}, of which {max(limit - held, 0)} B is free; {held} B is allocated"
    )


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Cap this process's device memory at ``fraction`` of the device's total (1.0 lifts the cap), as torch.cuda.

    Blocks allocated past the cap raise ``torch.OutOfMemoryError``; :func:`mem_get_info` reports the cap as the
    total.
    """
    index = _state.index_of(device)
    if isinstance(fraction, bool) or not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    with LOCK:
        if fraction >= 1.0:
            _caps.pop(index, None)
        else:
            _caps[index] = round(fraction * _state.TOTAL_MEMORY)


def total_memory(device: Any = None) -> int:
    """The device's capacity in bytes (``MAGIDEV_TOTAL_MEMORY``), whatever cap the process set."""
    _state.index_of(device)
    return _state.TOTAL_MEMORY


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction of the device's total this process may hold (1.0 without a cap)."""
    index = _state.index_of(device)
    return capacity(index) / _state.TOTAL_MEMORY if _state.TOTAL_MEMORY else 1.0


def _release(key: tuple[int, int]) -> None:
    with LOCK:
        block = _blocks.get(key)
        if block is None:
            return
        block.refs -= 1
        if block.refs > 0:
            return
        del _blocks[key]
        _allocated[key[0]] = _allocated.get(key[0], 0) - block.nbytes
        COUNTERS["frees"] += 1
        CHECKER.on_free(block)


def memory_allocated(device: Any = None) -> int:
    """Bytes of live device blocks on ``device``."""
    return _allocated.get(_state.index_of(device), 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since the start or the last :func:`reset_peak_memory_stats`."""
    return _peak.get(_state.index_of(device), 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Restart the peak at the bytes allocated now."""
    index = _state.index_of(device)
    with LOCK:
        _peak[index] = _allocated.get(index, 0)


def memory_reserved(device: Any = None) -> int:
    """Equal to :func:`memory_allocated`: no caching allocator."""
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    """Equal to :func:`max_memory_allocated`: no caching allocator."""
    return max_memory_allocated(device)


def empty_cache() -> None:
    """Nothing is cached: freed blocks are released at once."""


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: total is ``MAGIDEV_TOTAL_MEMORY`` (16 GiB), or the process's cap when one is set
    (:func:`set_per_process_memory_fraction`); free is total minus live blocks."""
    total = capacity(_state.index_of(device))
    return max(total - memory_allocated(device), 0), total


def live_blocks(device: Any = None) -> int:
    """Number of live device blocks on ``device``."""
    index = _state.index_of(device)
    with LOCK:
        return sum(1 for k in _blocks if k[0] == index)


def stats() -> dict[str, int]:
    """Copy and allocation counters (``h2d_copies``, ``h2d_bytes``, ``d2h_copies``, ``d2h_bytes``, ...)."""
    with LOCK:
        return dict(COUNTERS)
