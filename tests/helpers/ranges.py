"""The active backend's registered host ranges, for leak checks that hold on every backend."""

from __future__ import annotations

from magi_core.plugin.manager import REGISTRY, get_backend


def registered_ranges() -> dict[int, int]:
    """Host ranges registered now (ptr -> nbytes): the backend's own table where it exposes one
    (``registered_ranges``: the CPU backend, the recording backend, magidev), else magi-core's record of what it
    registered through the backend facade (CUDA, MUSA)."""
    backend = get_backend()
    plugin = REGISTRY.records()[backend.name].plugin
    ranges = getattr(plugin, "registered_ranges", None)
    return dict(ranges()) if callable(ranges) else backend.registered.held()
