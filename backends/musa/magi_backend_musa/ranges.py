"""Profiling ranges for MUSA: no NVTX exists, so ranges are ``torch.profiler.record_function`` spans.

They appear in ``torch.profiler`` traces (CPU activity) and cost one cheap op call each when no
profiler is running. Each thread keeps its own stack of open ranges.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from magi_core.plugin import BackendError

_local = threading.local()


def _stack() -> list[Any]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def push(name: str) -> None:
    """Open a ``record_function`` range named ``name``."""
    _stack().append(torch.ops.profiler._record_function_enter_new(name, None))


def pop() -> None:
    """Close the innermost range opened by :func:`push` on this thread."""
    stack = _stack()
    if not stack:
        raise BackendError("range_pop without a matching range_push on this thread; balance push and pop calls")
    torch.ops.profiler._record_function_exit._RecordFunction(stack.pop())


def depth() -> int:
    """How many ranges are open on this thread."""
    return len(_stack())
