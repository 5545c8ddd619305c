"""Host memory for offloaded weights: streaming shared-memory materialisation, loading from a weight source
(a model built on the meta device), sharing each tensor across the ranks of a node by content, in-place
pinning in waves, and a clean lifecycle.

``materialize(model)`` (``materialize(model, source=...)`` for a meta model) returns :class:`HostWeights`
(:meth:`HostWeights.locate` finds a tensor's place in the arenas); see :mod:`magi_core.host.config` for the
options and environment variables, :mod:`magi_core.host.topology` for how sharing is decided,
:mod:`magi_core.host.loading` for weight sources.
"""

from __future__ import annotations

from magi_core.host.config import HostOptions
from magi_core.host.errors import HostStateError, ShmSpaceError, WeightMismatchError, WeightSourceError
from magi_core.host.loading import CallableSource, SafetensorsSource, TensorInfo, WeightSource, open_source
from magi_core.host.materialize import HostLocation, HostWeights, materialize

__all__ = [
    "CallableSource",
    "HostLocation",
    "HostOptions",
    "HostStateError",
    "HostWeights",
    "SafetensorsSource",
    "ShmSpaceError",
    "TensorInfo",
    "WeightMismatchError",
    "WeightSource",
    "WeightSourceError",
    "materialize",
    "open_source",
]
