"""The active backend's registered host ranges, for leak checks that hold on every backend."""

from __future__ import annotations

import pytest

from magi_core.plugin.manager import REGISTRY, get_backend


def registered_ranges() -> dict[int, int]:
    """Host ranges the active backend has registered now (ptr -> nbytes), from its ``registered_ranges``.

    The CPU backend, the test-only recording backend and the example magidev backend expose it; the test is
    skipped on a backend that does not.
    """
    backend = get_backend()
    plugin = REGISTRY.records()[backend.name].plugin
    ranges = getattr(plugin, "registered_ranges", None)
    if not callable(ranges):
        pytest.skip(f"backend {backend.name!r} exposes no registered_ranges() for leak checks")
    return dict(ranges())
