"""NVTX profiling ranges through ``torch.cuda.nvtx``, or a no-op when the torch build has no NVTX."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


@functools.lru_cache(maxsize=1)
def _nvtx() -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    """torch's NVTX push/pop, or None when this build has no NVTX bindings."""
    try:
        from torch._C import _nvtx  # noqa: F401  (present only in builds with NVTX)
    except ImportError:
        return None
    import torch.cuda.nvtx as nvtx

    return nvtx.range_push, nvtx.range_pop


def available() -> bool:
    """True when this torch build has NVTX."""
    return _nvtx() is not None


def push(name: str) -> None:
    """Open an NVTX range named ``name`` (no-op without NVTX)."""
    fns = _nvtx()
    if fns is not None:
        fns[0](name)


def pop() -> None:
    """Close the innermost NVTX range (no-op without NVTX)."""
    fns = _nvtx()
    if fns is not None:
        fns[1]()
