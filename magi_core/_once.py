"""Once per process: the one helper behind every "say it once" note (a warning per unknown variable, per value)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

_lock = threading.Lock()


def first_time(seen: set[K], key: K) -> bool:
    """Add ``key`` to ``seen``; True when it was not there yet (thread-safe: one caller wins per key).

    Each caller keeps its own module-level ``seen`` set, so a test can forget what was said by replacing it.
    """
    with _lock:
        if key in seen:
            return False
        seen.add(key)
        return True
