"""Split a Dynamo graph into offload units: one ``call_module`` per repeated block, weights as unit args.

How nodes are assigned (graph order is execution order):

1. **Stacks.** Every container of repeated blocks on the nodes' ``nn_module_stack`` is a stack
   (:mod:`magi_core.passes.blocks`): Flux's ``transformer_blocks`` and ``single_transformer_blocks``,
   an encoder's and a decoder's ``block``, a vision tower's and a language model's ``layers``. A
   node's block is the outermost one it runs in, and a new unit starts whenever that block changes.
   Glue nodes outside every block (residual adds in the parent's forward) between two blocks of the
   SAME stack stay with the block before them; glue before the first block (``pre``), between two
   stacks (``glue``) and after the last block (``post``) is a unit of its own. A block that runs
   twice (shared layers) gives two units that take the same weights. Containers whose blocks read no
   weights are not stacks (nothing of theirs streams).
2. **Weightless glue joins a neighbour.** A glue run that reads no weight (a ``torch.cat`` of two
   streams between stacks, a reshape before the first block) is merged into the unit before it (into
   the next one when it comes first) instead of being a unit that streams nothing. A block stays its
   own unit even when it reads no weight.
3. **Byte cap.** ``max_unit_bytes`` bounds the distinct weight bytes of a unit. None (the default)
   picks it automatically: the largest block's bytes (its glue included) when the graph has stacks,
   so a big ``pre``/``glue``/``post`` run is cut to block size and the smallest device that runs one
   block runs every unit; :data:`DEFAULT_MAX_UNIT_BYTES` (256 MiB) when it has none. A unit over the
   cap is cut along the containers nested in it first (a UNet down block along its ``resnets`` and
   ``attentions``, looked for among that unit's nodes alone), then node by node, and the pieces are
   packed greedily in order into as few parts of at most the cap as they fit (labels ``x[1/3]``).
   One op that reads more than the cap alone (a 1 GiB embedding) is not cut. Only an explicit
   ``max_unit_bytes`` also merges consecutive blocks of one stack while they fit
   (``layers.0..layers.1``); under the automatic cap every block stays its own unit.
4. Nodes computed only from weights, host scalars and symbolic sizes (``w.t()``, ``eps.item()``) are
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
from magi_core.passes.blocks import BlockKey, block_keys, container_name
from magi_core.passes.units import OffloadUnit, SplitGraph, WeightSlot
from magi_core.passes.weights import (
    concrete_int,
    is_host_scalar,
    is_mutated,
    node_value,
    tensor_nbytes,
    weight_input_indices,
)

logger = logging.getLogger(__name__)

_GLOBAL_STATE = (torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast)

#: The automatic ``max_unit_bytes`` of a graph without repeated blocks.
DEFAULT_MAX_UNIT_BYTES = 256 * 2**20


@dataclass
class _Segment:
    kind: str  # "pre", "block", "glue", "post", "all"
    label: str
    nodes: list[torch.fx.Node] = field(default_factory=list)
    #: The stack a block belongs to (None outside blocks): only blocks of one stack merge.
    stack: tuple[str, ...] | None = None


_Run = tuple[BlockKey | None, list[torch.fx.Node]]


def _runs(nodes: Sequence[torch.fx.Node], keys: dict[torch.fx.Node, BlockKey]) -> list[_Run]:
    """``nodes`` cut where the block changes; glue between two blocks of one stack joins the block before it."""
    raw: list[_Run] = []
    for node in nodes:
        key = keys.get(node)
        if raw and raw[-1][0] == key:
            raw[-1][1].append(node)
        else:
            raw.append((key, [node]))
    out: list[_Run] = []
    for i, (key, run) in enumerate(raw):
        before = raw[i - 1][0] if i > 0 else None
        after = raw[i + 1][0] if i + 1 < len(raw) else None
        same_stack = before is not None and after is not None and before.container == after.container
        if (key is None and same_stack) or (key is not None and out and out[-1][0] == key):
            out[-1][1].extend(run)
        else:
            out.append((key, list(run)))
    return out


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
        self.need: dict[torch.fx.Node, frozenset[int]] = {}
        self.container_name: str | None = None
        self.containers: tuple[str, ...] = ()
        self.cap = 0  # set by _choose_cap; unused by a one_unit split
        self.cap_rule = "one unit"

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
        # Free nodes move to their first user; a value written in place (a cache's length counter) is read
        # where the graph reads it, so neither it nor anything computed from it is free.
        sources: set[torch.fx.Node] = {n for n in self.weight_nodes if not is_mutated(n)}
        for ph in self.placeholders:
            v = node_value(ph)
            if is_host_scalar(v) or isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float)):
                if not is_mutated(ph):
                    sources.add(ph)
        free: set[torch.fx.Node] = set()
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr") or not _is_pure(node):
                continue
            inputs = node.all_input_nodes
            if inputs and all(n in sources or n in free for n in inputs) and not is_mutated(node):
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

    # -- sizes of node sets ---------------------------------------------------------------------------
    def _weights_of(self, nodes: Sequence[torch.fx.Node]) -> frozenset[int]:
        out: set[int] = set()
        for node in nodes:
            out |= self.need[node]
        return frozenset(out)

    def _size(self, weights: frozenset[int] | set[int]) -> int:
        return sum(self.bytes[i] for i in weights)

    # -- segments ---------------------------------------------------------------------------------
    def _stack_keys(self, body: list[torch.fx.Node]) -> dict[torch.fx.Node, BlockKey]:
        """Block keys of ``body``, leaving out containers whose blocks read no weight."""
        weightless: set[tuple[str, ...]] = set()
        while True:
            keys = block_keys(body, exclude=weightless)
            read: dict[tuple[str, ...], bool] = {}
            for node, key in keys.items():
                read[key.container] = read.get(key.container, False) or bool(self.need[node])
            empty = {path for path, any_weight in read.items() if not any_weight}
            if not empty:
                return keys
            weightless |= empty

    def _segments(self, body: list[torch.fx.Node]) -> list[_Segment]:
        """Blocks and the glue around them (see the module docstring, steps 1 and 2)."""
        if not body:
            return []
        if self.one_unit:
            logger.info("unit split: every weight stays resident; one unit holds the whole graph")
            return [_Segment("all", "all", body)]
        keys = self._stack_keys(body)
        runs = _runs(body, keys)
        blocks = [i for i, (key, _) in enumerate(runs) if key is not None]
        if not blocks:
            return [_Segment("all", "all", body)]
        segments: list[_Segment] = []
        for i, (key, nodes) in enumerate(runs):
            if key is not None:
                segments.append(_Segment("block", key.label, nodes, key.container))
            else:
                kind = "pre" if i < blocks[0] else "post" if i > blocks[-1] else "glue"
                segments.append(_Segment(kind, kind, nodes))
        self._name_stacks(keys, segments)
        merged: list[_Segment] = []
        for seg in segments:
            if merged and seg.kind != "block" and not self._weights_of(seg.nodes):
                merged[-1].nodes.extend(seg.nodes)
            elif merged and merged[-1].kind != "block" and not self._weights_of(merged[-1].nodes):
                seg.nodes[:0] = merged.pop().nodes
                merged.append(seg)
            else:
                merged.append(seg)
        return merged

    def _name_stacks(self, keys: dict[torch.fx.Node, BlockKey], segments: list[_Segment]) -> None:
        """Every stack in graph order, and the main one: the stack covering the most nodes (first on ties)."""
        order = list(dict.fromkeys(seg.stack for seg in segments if seg.stack is not None))
        covered = {path: 0 for path in order}
        for key in keys.values():
            covered[key.container] += 1
        self.containers = tuple(container_name(path) for path in order)
        main = max(range(len(order)), key=lambda k: (covered[order[k]], -k))
        self.container_name = self.containers[main]

    def _choose_cap(self, segments: list[_Segment]) -> None:
        if self.max_unit_bytes is not None:
            self.cap, self.cap_rule = self.max_unit_bytes, "max_unit_bytes"
            return
        blocks = [seg for seg in segments if seg.kind == "block"]
        if blocks:
            largest = max(blocks, key=lambda seg: self._size(self._weights_of(seg.nodes)))
            self.cap = self._size(self._weights_of(largest.nodes))
            self.cap_rule = f"automatic: the largest block, {largest.label}"
        else:
            self.cap, self.cap_rule = DEFAULT_MAX_UNIT_BYTES, "automatic: no repeated blocks, the default"

    def _atoms(self, nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
        """``nodes`` in consecutive pieces of at most the cap: along nested blocks first, then one node each."""
        if self._size(self._weights_of(nodes)) <= self.cap:
            return [nodes]
        runs = _runs(nodes, block_keys(nodes))
        if len(runs) < 2:
            return [[node] for node in nodes]
        return [atom for _, run in runs for atom in self._atoms(run)]

    def _cut(self, seg: _Segment) -> list[_Segment]:
        """``seg`` as it is when it fits the cap, else its pieces packed in order into parts of at most the cap."""
        if self._size(self._weights_of(seg.nodes)) <= self.cap:
            return [seg]
        parts: list[tuple[list[torch.fx.Node], set[int]]] = []
        for atom in self._atoms(seg.nodes):
            ws = self._weights_of(atom)
            if parts and not (ws - parts[-1][1] and parts[-1][1] and self._size(parts[-1][1] | ws) > self.cap):
                parts[-1][0].extend(atom)
                parts[-1][1].update(ws)
            else:
                parts.append((list(atom), set(ws)))
        if len(parts) == 1:
            return [seg]
        return [
            _Segment(seg.kind, f"{seg.label}[{k + 1}/{len(parts)}]", nodes, seg.stack)
            for k, (nodes, _) in enumerate(parts)
        ]

    def _merge_blocks(self, segments: list[_Segment]) -> list[_Segment]:
        """Consecutive blocks of one stack joined while their distinct weights fit an explicit ``max_unit_bytes``."""
        merged: list[_Segment] = []
        for seg in segments:
            prev = merged[-1] if merged else None
            if (
                prev is not None and seg.kind == "block" and prev.kind == "block" and seg.stack == prev.stack
                and self._size(self._weights_of(prev.nodes + seg.nodes)) <= self.cap
            ):
                first = prev.label.split("..")[0]
                merged[-1] = _Segment("block", f"{first}..{seg.label}", prev.nodes + seg.nodes, seg.stack)
            else:
                merged.append(seg)
        return merged

    def _plan(self) -> list[_Segment]:
        body = [n for n in self.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        segments = self._segments(body)
        if self.one_unit:
            return segments
        self._choose_cap(segments)
        segments = [piece for seg in segments for piece in self._cut(seg)]
        if self.max_unit_bytes is not None:
            segments = self._merge_blocks(segments)
        for seg in segments:
            size = self._size(self._weights_of(seg.nodes))
            if size > self.cap:
                logger.log(
                    logging.WARNING if self.max_unit_bytes is not None else logging.INFO,
                    "unit %s needs %d weight bytes, over max_unit_bytes=%d (%s): one of its ops alone reads more "
                    "than that, and one op's weights are never cut; raise max_unit_bytes to at least %d",
                    seg.label, size, self.cap, self.cap_rule, size,
                )
        return segments

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
        self.need = self._node_weights(free)
        segments = self._plan()
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
        split = SplitGraph(
            graph_module=split_gm, units=units, weights=slots, container=self.container_name,
            containers=self.containers, max_unit_bytes=None if self.one_unit else self.cap,
        )
        logger.info(
            "unit split: %d unit(s) along %s, %d weight(s), %.1f MiB; unit cap %s (%s), largest unit %.1f MiB",
            len(units), ", ".join(self.containers) or "(no blocks)", len(slots), split.weight_bytes / 2**20,
            "none" if self.one_unit else f"{self.cap / 2**20:.1f} MiB", self.cap_rule,
            max((u.nbytes for u in units), default=0) / 2**20,
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
    sizes exact; without them they come from the fake values. ``max_unit_bytes``: the cap on a unit's
    distinct weight bytes; None picks it automatically (the largest block, or
    :data:`DEFAULT_MAX_UNIT_BYTES` without blocks); the cap used is ``SplitGraph.max_unit_bytes``.
    ``include_buffers=False`` keeps static module buffers as plain inputs. ``one_unit``: the whole graph is
    one unit (nothing will stream, so unit boundaries would only stop fusions and kernel choices that span
    blocks).
    """
    return _Splitter(gm, example_inputs, max_unit_bytes, include_buffers, one_unit).run()


__all__ = ["DEFAULT_MAX_UNIT_BYTES", "split_into_units"]
