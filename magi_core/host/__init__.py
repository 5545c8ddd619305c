"""Host memory for offloaded weights: streaming shared-memory materialisation, per-rank files under
expert parallelism, in-place pinning in waves, and a clean lifecycle.

``materialize(model)`` returns :class:`HostWeights` (:meth:`HostWeights.locate` finds a tensor's place in
the arenas); see :mod:`magi_core.host.config` for the options
and environment variables, :mod:`magi_core.host.topology` for how the EP size is found.
"""

from __future__ import annotations

from magi_core.host.config import HostOptions
from magi_core.host.errors import HostStateError, ShmSpaceError, WeightMismatchError
from magi_core.host.materialize import HostLocation, HostWeights, materialize

__all__ = [
    "HostLocation",
    "HostOptions",
    "HostStateError",
    "HostWeights",
    "ShmSpaceError",
    "WeightMismatchError",
    "materialize",
]
