"""The flat step program of a split graph: env slots, per-unit argument slots, getitems, liveness, output.

Built once from a :class:`~magi_core.passes.units.SplitGraph`; the executor then runs units by index
over a plain list of values, with no FX interpretation or dict look-ups per step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch.fx

from magi_core.errors import MagiError
from magi_core.passes.units import SplitGraph


@dataclass(frozen=True)
class UnitLayout:
    """Where one unit reads its arguments and writes its results in the env list."""

    index: int
    arg_slots: tuple[int, ...]
    result_slot: int | None
    getitems: tuple[tuple[int, int], ...]
    drop_after: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """A split graph flattened into env slots: inputs first, then unit results."""

    n_inputs: int
    n_slots: int
    constants: tuple[tuple[int, Any], ...]
    units: tuple[UnitLayout, ...]
    output_template: Any
    output_slots: dict[str, int]

    def build_output(self, env: list[Any]) -> Any:
        """The graph's output structure filled from ``env``."""
        slots = self.output_slots
        return torch.fx.node.map_arg(self.output_template, lambda n: env[slots[n.name]])


def build_program(split: SplitGraph, weight_inputs: frozenset[int] | None = None) -> Program:
    """Flatten ``split.graph_module`` (placeholders, unit calls, getitems, output) into a :class:`Program`.

    ``weight_inputs`` are input slots the weight cache manages; they are never listed in ``drop_after``.
    """
    weight_inputs = frozenset(split.weights) if weight_inputs is None else weight_inputs
    graph = split.graph_module.graph
    unit_of_node = {u.node: u.index for u in split.units}
    slot: dict[torch.fx.Node, int] = {}
    constants: list[tuple[int, Any]] = []
    n_inputs = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            slot[node] = n_inputs
            n_inputs += 1
    next_slot = n_inputs
    arg_slots: dict[int, tuple[int, ...]] = {}
    result_slot: dict[int, int | None] = {}
    getitems: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(split.units))}
    last_use: dict[int, int] = {}
    output_node: torch.fx.Node | None = None

    def use(s: int, unit: int) -> None:
        last_use[s] = max(last_use.get(s, -1), unit)

    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_module":
            if node not in unit_of_node:
                raise MagiError(f"split graph calls {node.target!r}, which is not one of its units; re-run the split")
            if node.kwargs:
                raise MagiError(f"unit {node.target!r} is called with keyword arguments; the split must pass args only")
            u = unit_of_node[node]
            slots = []
            for a in node.args:
                if isinstance(a, torch.fx.Node):
                    slots.append(slot[a])
                    use(slot[a], u)
                else:
                    constants.append((next_slot, a))
                    slots.append(next_slot)
                    next_slot += 1
            arg_slots[u] = tuple(slots)
            non_getitem = [x for x in node.users if not _is_getitem_of(x, node)]
            if non_getitem:
                slot[node] = next_slot
                result_slot[u] = next_slot
                next_slot += 1
            else:
                result_slot[u] = None
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if not isinstance(src, torch.fx.Node) or src not in unit_of_node:
                raise MagiError(f"split graph node {node.name} indexes something other than a unit result")
            u = unit_of_node[src]
            slot[node] = next_slot
            getitems[u].append((int(node.args[1]), next_slot))
            use(next_slot, u)  # produced by u: at least alive until u ends
            next_slot += 1
            continue
        if node.op == "output":
            output_node = node
            continue
        raise MagiError(
            f"split graph has a {node.op} node {node.name} ({node.target}) at top level; only placeholders, unit "
            "calls, getitems and the output are allowed (this is a bug in the split pass)"
        )
    if output_node is None:
        raise MagiError("split graph has no output node")
    template = output_node.args[0]
    out_slots: dict[str, int] = {}
    keep: set[int] = set(weight_inputs)

    def note(n: torch.fx.Node) -> torch.fx.Node:
        out_slots[n.name] = slot[n]
        keep.add(slot[n])
        return n

    torch.fx.node.map_arg(template, note)
    drops: dict[int, list[int]] = {i: [] for i in range(len(split.units))}
    for s, u in last_use.items():
        if s not in keep:
            drops[u].append(s)
    units = tuple(
        UnitLayout(
            index=i,
            arg_slots=arg_slots[i],
            result_slot=result_slot[i],
            getitems=tuple(getitems[i]),
            drop_after=tuple(sorted(drops[i])),
        )
        for i in range(len(split.units))
    )
    return Program(
        n_inputs=n_inputs,
        n_slots=next_slot,
        constants=tuple(constants),
        units=units,
        output_template=template,
        output_slots=out_slots,
    )


def _is_getitem_of(user: torch.fx.Node, src: torch.fx.Node) -> bool:
    return user.op == "call_function" and user.target is operator.getitem and user.args[0] is src

