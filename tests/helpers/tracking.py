"""``torch.compile(..., backend=<a handle's backend>)`` for tests that inspect the runtimes they compiled."""

from __future__ import annotations

from typing import Any

import torch

from magi_core.compile.handle import OffloadHandle
from magi_core.compile.runtime import OffloadRuntime

#: Every handle made by :func:`compile_tracked`, oldest first (each holds its runtimes weakly).
HANDLES: list[OffloadHandle] = []


def compile_tracked(model: Any, **compile_kwargs: Any) -> Any:
    """``torch.compile(model, backend=h.backend, **compile_kwargs)`` with a fresh handle ``h`` kept in HANDLES."""
    h = OffloadHandle(type(model).__name__)
    HANDLES.append(h)
    return torch.compile(model, backend=h.backend, **compile_kwargs)


def newest() -> OffloadRuntime:
    """The newest runtime of the last tracked compile."""
    return HANDLES[-1].runtime


def compiles() -> int:
    """Graphs compiled by the last tracked compile."""
    return HANDLES[-1].compile_count
