"""Device memory of the emulated device: one block per storage of the host tensors behind magidev tensors.

A magidev tensor holds a private host tensor (its "device memory", never the host tensor it was copied
from). Each storage is a :class:`~torch_magidev.checker.Block`, counted from the first magidev tensor on it
until the last one dies (a weakref finalizer on each tensor): ``memory_allocated`` is the sum of live
blocks' bytes. There is no caching allocator: a freed block's bytes are released at once
(``memory_reserved`` equals ``memory_allocated``; ``empty_cache`` has nothing to do).
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
    """(free, total) bytes: total is ``MAGIDEV_TOTAL_MEMORY`` (16 GiB), free is total minus live blocks."""
    total = _state.TOTAL_MEMORY
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
