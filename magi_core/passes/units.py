"""The result of the unit split: ordered offload units and their weight placeholders (no name parsing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx


@dataclass(frozen=True)
class WeightSlot:
    """One weight graph input: its position among the graph's inputs, size and users."""

    input_index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    users: tuple[int, ...]
    #: True for a static module buffer rather than an ``nn.Parameter``.
    is_buffer: bool = False


@dataclass
class OffloadUnit:
    """One unit of the split graph: a ``call_module`` node whose weights are its own placeholder args."""

    index: int
    attr: str
    node: torch.fx.Node
    module: torch.fx.GraphModule
    weights: tuple[WeightSlot, ...]
    #: What the unit holds, for logs: ``pre``, ``layers.3``, ``layers.0..layers.1``, ``layers.2[1/3]``, ``glue``
    #: (between two stacks), ``post``, ``all`` (no blocks).
    label: str = ""
    #: For each of ``weights`` (same order), its position among ``node.args`` / the unit's placeholders.
    weight_arg_positions: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of all weights this unit reads."""
        return sum(w.nbytes for w in self.weights)


@dataclass
class SplitGraph:
    """A split graph: top-level module (placeholders, unit calls, getitems, output) plus unit metadata."""

    graph_module: torch.fx.GraphModule
    units: list[OffloadUnit]
    weights: dict[int, WeightSlot] = field(default_factory=dict)
    #: Dotted path of the main stack of repeated blocks (the one covering most nodes; None: none found).
    container: str | None = None
    #: Every stack of repeated blocks the split followed, in graph order (``transformer_blocks``, ...).
    containers: tuple[str, ...] = ()
    #: The cap on a unit's distinct weight bytes the split used: the given ``max_unit_bytes`` or the automatic
    #: one (see :mod:`magi_core.passes.split`); None for a ``one_unit`` split.
    max_unit_bytes: int | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of all distinct weights."""
        return sum(w.nbytes for w in self.weights.values())
