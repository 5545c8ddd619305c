"""Split a Dynamo graph into offload units: one ``call_module`` per repeated block, weights as unit args.

How nodes are assigned (graph order is execution order):

1. The repeated-block container comes from ``nn_module_stack`` (:mod:`magi_core.passes.blocks`).
   Nodes before the first block node form the ``pre`` unit, nodes after the last one the ``post``
   unit; in between, a new unit starts whenever the block index changes, and glue nodes without
   a block (residual adds in the parent's forward) stay with the block before them. A block that
   runs twice (shared layers) gives two units that take the same weights.
2. ``max_unit_bytes`` (optional) first cuts a unit whose distinct weights exceed the budget into
   consecutive pieces, then merges consecutive block units while their distinct weights fit.
3. Nodes computed only from weights, host scalars and symbolic sizes (``w.t()``, ``eps.item()``) are
   moved next to their users, and copied into every unit that uses them, so a unit receives weights
   and scalars as its own placeholders, never a derived value from another unit.

The top-level graph keeps the original placeholders (same order and count), then unit calls,
``getitem``s and the output. Nothing downstream needs to parse generated ``submod_N`` names.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from magi_core.errors import MagiError
from magi_core.passes.blocks import find_block_container
from magi_core.passes.units import OffloadUnit, SplitGraph, WeightSlot
from magi_core.passes.weights import (
    concrete_int,
    is_host_scalar,
    node_value,
    tensor_nbytes,
    weight_input_indices,
)

logger = logging.getLogger(__name__)

_GLOBAL_STATE = (torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast)


@dataclass
class _Segment:
    kind: str  # "pre", "block", "post", "all"
    label: str
    nodes: list[torch.fx.Node] = field(default_factory=list)


def _is_pure(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return not (name.endswith("_") and not name.endswith("__"))
    if node.op != "call_function":
        return False
    target = node.target
    if target in _GLOBAL_STATE or target is operator.setitem or "out" in node.kwargs:
        return False
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    name = getattr(target, "__name__", "")
    return not (name.endswith("_") and not name.endswith("__"))


class _Splitter:
    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any] | None,
        max_unit_bytes: int | None,
        include_buffers: bool,
        one_unit: bool = False,
    ) -> None:
        self.one_unit = one_unit
        if max_unit_bytes is not None and max_unit_bytes <= 0:
            raise MagiError(f"max_unit_bytes must be a positive byte count, got {max_unit_bytes}")
        self.gm = gm
        self.graph = gm.graph
        self.example_inputs = example_inputs
        self.max_unit_bytes = max_unit_bytes
        self.placeholders = list(self.graph.find_nodes(op="placeholder"))
        self.weight_kind = weight_input_indices(gm, example_inputs, include_buffers=include_buffers)
        self.weight_nodes = {self.placeholders[i]: i for i in self.weight_kind}
        self.bytes = {i: self._nbytes(i) for i in self.weight_kind}
        self.container_name: str | None = None

    # -- sizes ------------------------------------------------------------------------------------
    def _example(self, index: int) -> Any:
        inputs = self.example_inputs
        return inputs[index] if inputs is not None and index < len(inputs) else None

    def _nbytes(self, index: int) -> int:
        ex = self._example(index)
        value = ex if isinstance(ex, torch.Tensor) else node_value(self.placeholders[index])
        return tensor_nbytes(value) if isinstance(value, torch.Tensor) else 0

    # -- free nodes (computed from weights / scalars / sizes only) ---------------------------------
    def _free_nodes(self) -> set[torch.fx.Node]:
        sources: set[torch.fx.Node] = set(self.weight_nodes)
        for ph in self.placeholders:
            v = node_value(ph)
            if is_host_scalar(v) or isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float)):
                sources.add(ph)
        free: set[torch.fx.Node] = set()
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr") or not _is_pure(node):
                continue
            inputs = node.all_input_nodes
            if inputs and all(n in sources or n in free for n in inputs):
                free.add(node)
        return free

    def _node_weights(self, free: set[torch.fx.Node]) -> dict[torch.fx.Node, frozenset[int]]:
        """Weights each node needs in its unit (its free inputs' weights included; free nodes need none)."""
        via: dict[torch.fx.Node, frozenset[int]] = {}
        need: dict[torch.fx.Node, frozenset[int]] = {}
        for node in self.graph.nodes:
            direct: set[int] = set()
            for n in node.all_input_nodes:
                if n in self.weight_nodes:
                    direct.add(self.weight_nodes[n])
                elif n in free:
                    direct |= via[n]
            if node in free:
                via[node] = frozenset(direct)
                need[node] = frozenset()
            else:
                need[node] = frozenset(direct)
        return need

    # -- segments ---------------------------------------------------------------------------------
    def _segments(self) -> list[_Segment]:
        body = [n for n in self.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        if self.one_unit:
            logger.info("unit split: every weight stays resident; one unit holds the whole graph")
            return [_Segment("all", "all", body)] if body else []
        container = find_block_container(body)
        if container is None:
            logger.info("unit split: no repeated blocks in nn_module_stack; one unit holds the whole graph")
            return [_Segment("all", "all", body)] if body else []
        self.container_name = container.name
        positions = [i for i, n in enumerate(body) if n in container.node_block]
        first, last = positions[0], positions[-1]
        segments: list[_Segment] = []
        if first > 0:
            segments.append(_Segment("pre", "pre", body[:first]))
        current: int | None = None
        for node in body[first : last + 1]:
            block = container.node_block.get(node)
            if block is not None and block != current:
                current = block
                segments.append(_Segment("block", f"{container.name}.{block}"))
            segments[-1].nodes.append(node)
        if last + 1 < len(body):
            segments.append(_Segment("post", "post", body[last + 1 :]))
        return segments

    def _apply_budget(self, segments: list[_Segment], need: dict[torch.fx.Node, frozenset[int]]) -> list[_Segment]:
        budget = self.max_unit_bytes
        assert budget is not None

        def size(ws: set[int] | frozenset[int]) -> int:
            return sum(self.bytes[i] for i in ws)

        pieces: list[tuple[_Segment, set[int]]] = []
        for seg in segments:
            chunks: list[tuple[list[torch.fx.Node], set[int]]] = [([], set())]
            for node in seg.nodes:
                nodes, ws = chunks[-1]
                new = need[node] - ws
                if new and ws and size(ws | new) > budget:
                    chunks.append(([], set()))
                    nodes, ws = chunks[-1]
                nodes.append(node)
                ws |= need[node]
            if len(chunks) == 1:
                pieces.append((seg, chunks[0][1]))
                continue
            for k, (nodes, ws) in enumerate(chunks):
                pieces.append((_Segment(seg.kind, f"{seg.label}[{k + 1}/{len(chunks)}]", nodes), ws))
        merged: list[tuple[_Segment, set[int]]] = []
        for seg, ws in pieces:
            if merged and seg.kind == "block" and merged[-1][0].kind == "block" and size(merged[-1][1] | ws) <= budget:
                prev, pws = merged[-1]
                first = prev.label.split("..")[0]
                merged[-1] = (_Segment("block", f"{first}..{seg.label}", prev.nodes + seg.nodes), pws | ws)
            else:
                merged.append((seg, ws))
        for seg, ws in merged:
            if size(ws) > budget:
                logger.warning(
                    "unit %s needs %d weight bytes, over max_unit_bytes=%d: one of its ops alone reads more than "
                    "the budget; raise max_unit_bytes to at least that", seg.label, size(ws), budget,
                )
        return [seg for seg, _ in merged]

    def _rematerialize(self, assign: dict[torch.fx.Node, int], free: set[torch.fx.Node]) -> None:
        """Move each free node before its first user and copy it into every other unit that uses it."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in sorted(free, key=order.__getitem__, reverse=True):
            users = [u for u in node.users if u.op != "output"]
            if not users:
                continue
            by_unit: dict[int, list[torch.fx.Node]] = {}
            for u in sorted(users, key=lambda u: order.get(u, -1)):
                by_unit.setdefault(assign[u], []).append(u)
            used_by_output = any(u.op == "output" for u in node.users)
            units = sorted(by_unit)
            keep_unit = assign[node] if used_by_output else units[0]
            for unit in units:
                unit_users = by_unit[unit]
                if unit == keep_unit:
                    if not used_by_output:
                        unit_users[0].prepend(node)
                        assign[node] = unit
                    continue
                with self.graph.inserting_before(unit_users[0]):
                    clone = self.graph.node_copy(node)
                assign[clone] = unit
                for u in unit_users:
                    u.replace_input_with(node, clone)
            order = {n: i for i, n in enumerate(self.graph.nodes)}

    # -- the split --------------------------------------------------------------------------------
    def run(self) -> SplitGraph:
        free = self._free_nodes()
        need = self._node_weights(free)
        segments = self._segments()
        if self.max_unit_bytes is not None:
            segments = self._apply_budget(segments, need)
        assign: dict[torch.fx.Node, int] = {}
        for k, seg in enumerate(segments):
            for node in seg.nodes:
                assign[node] = k
        self._rematerialize(assign, free)
        labels = [seg.label for seg in segments]

        used = sorted({assign[n] for n in self.graph.nodes if n in assign})
        renumber = {old: new for new, old in enumerate(used)}
        labels = [labels[old] for old in used]

        kwargs: dict[str, Any] = {"keep_original_order": True}
        if "tuple_return" in inspect.signature(split_module).parameters:
            kwargs["tuple_return"] = True
        split_gm = split_module(self.gm, self.gm, lambda n: renumber[assign[n]], **kwargs)
        self._clean_top_level(split_gm)
        return self._describe(split_gm, labels)

    def _clean_top_level(self, split_gm: torch.fx.GraphModule) -> None:
        for node in list(split_gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                split_gm.graph.erase_node(node)
        for node in split_gm.graph.nodes:
            ok = node.op in ("placeholder", "call_module", "output") or (
                node.op == "call_function" and node.target is operator.getitem
            )
            if not ok:
                raise MagiError(
                    f"unit split left {node.op} {node.target} in the top-level graph; only unit calls may run "
                    "there. Please report this graph (it holds a construct the splitter does not handle)."
                )
        split_gm.graph.lint()
        split_gm.recompile()

    def _describe(self, split_gm: torch.fx.GraphModule, labels: list[str]) -> SplitGraph:
        top_placeholders = list(split_gm.graph.find_nodes(op="placeholder"))
        if len(top_placeholders) != len(self.placeholders):
            raise MagiError(
                f"unit split changed the graph inputs ({len(self.placeholders)} -> {len(top_placeholders)}); "
                "this is a bug in magi_core.passes.split"
            )
        index_of = {ph: i for i, ph in enumerate(top_placeholders)}
        calls = list(split_gm.graph.find_nodes(op="call_module"))
        if len(calls) != len(labels):
            raise MagiError(f"unit split produced {len(calls)} unit calls for {len(labels)} units; this is a bug")
        users: dict[int, list[int]] = {i: [] for i in self.weight_kind}
        unit_weight_args: list[list[tuple[int, int]]] = []
        for u, call in enumerate(calls):
            found: list[tuple[int, int]] = []
            for pos, arg in enumerate(call.args):
                i = index_of.get(arg) if isinstance(arg, torch.fx.Node) else None
                if i is not None and i in self.weight_kind:
                    found.append((i, pos))
                    users[i].append(u)
            unit_weight_args.append(found)
        slots: dict[int, WeightSlot] = {}
        for i in sorted(self.weight_kind):
            value = node_value(self.placeholders[i])
            ex = self._example(i)
            ref = ex if isinstance(ex, torch.Tensor) else value
            slots[i] = WeightSlot(
                input_index=i,
                name=top_placeholders[i].name,
                shape=tuple(concrete_int(s) for s in ref.shape) if isinstance(ref, torch.Tensor) else (),
                dtype=ref.dtype if isinstance(ref, torch.Tensor) else torch.float32,
                nbytes=self.bytes[i],
                users=tuple(users[i]),
                is_buffer=self.weight_kind[i],
            )
        units = []
        for u, call in enumerate(calls):
            found = unit_weight_args[u]
            module = split_gm.get_submodule(str(call.target))
            assert isinstance(module, torch.fx.GraphModule)
            units.append(
                OffloadUnit(
                    index=u,
                    attr=str(call.target),
                    node=call,
                    module=module,
                    weights=tuple(slots[i] for i, _ in found),
                    label=labels[u],
                    weight_arg_positions=tuple(pos for _, pos in found),
                )
            )
        split = SplitGraph(graph_module=split_gm, units=units, weights=slots, container=self.container_name)
        logger.info(
            "unit split: %d unit(s) along %s, %d weight(s), %.1f MiB",
            len(units), self.container_name or "(no blocks)", len(slots), split.weight_bytes / 2**20,
        )
        return split


def split_into_units(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    max_unit_bytes: int | None = None,
    include_buffers: bool = True,
    one_unit: bool = False,
) -> SplitGraph:
    """Split ``gm`` into offload units (see the module docstring); ``gm``'s graph is edited, not its semantics.

    ``example_inputs`` (the real inputs Dynamo passes the backend) make weight detection and byte
    sizes exact; without them they come from the fake values. ``include_buffers=False`` keeps static
    module buffers as plain inputs. ``one_unit``: the whole graph is one unit (nothing will stream, so unit
    boundaries would only stop fusions and kernel choices that span blocks).
    """
    return _Splitter(gm, example_inputs, max_unit_bytes, include_buffers, one_unit).run()


__all__ = ["split_into_units"]
