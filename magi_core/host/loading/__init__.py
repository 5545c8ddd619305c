"""Loading a model built on the meta device straight into the host arenas, from a weight source.

:func:`open_source` turns a path (safetensors file, directory, ``*.safetensors.index.json``), a list of files or
a function ``(name, meta_tensor) -> tensor`` into a :class:`WeightSource`; :class:`Loader` matches it with the
model (missing, unexpected, mis-shaped tensors; non-persistent buffers recomputed by the model's own code) and
writes each tensor into its place in the arena through a bounded staging window.
"""

from __future__ import annotations

from magi_core.host.loading.loader import Loader, Rename, staging_window
from magi_core.host.loading.sources import (
    CallableSource,
    SafetensorsSource,
    SourceSpec,
    Staging,
    TensorInfo,
    WeightSource,
    open_source,
)

__all__ = [
    "CallableSource",
    "Loader",
    "Rename",
    "SafetensorsSource",
    "SourceSpec",
    "Staging",
    "TensorInfo",
    "WeightSource",
    "open_source",
    "staging_window",
]
