"""Find the repeated blocks of a Dynamo graph from ``node.meta["nn_module_stack"]``.

The block container is the module path whose integer-indexed children (``layers.0``, ``layers.1``,
...) cover the most graph nodes (ties: more children, then the shallower path): the largest
``ModuleList``/``Sequential`` of blocks. Nested containers (``layers.3.experts.7``) cover fewer nodes
than the one holding them, so the outer stack wins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx

_TOKEN = re.compile(r"""\[\s*['"]?([^'"\]]+?)['"]?\s*\]|\.?([A-Za-z_][\w]*|\d+)""")
_SKIP_TOKENS = frozenset({"_modules", "L", "G"})


def module_path_tokens(path: str) -> tuple[str, ...]:
    """Split a module path (``L['self'].layers.0`` or ``L['self']._modules['layers']._modules['0']``) into names."""
    tokens: list[str] = []
    for m in _TOKEN.finditer(path):
        tok = m.group(1) if m.group(1) is not None else m.group(2)
        if tok and tok not in _SKIP_TOKENS:
            tokens.append(tok)
    return tuple(tokens)


def node_module_paths(node: torch.fx.Node) -> list[tuple[str, ...]]:
    """The module paths (as token tuples) in ``node``'s ``nn_module_stack``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    paths: list[tuple[str, ...]] = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        if isinstance(path, str):
            paths.append(module_path_tokens(path))
    return paths


@dataclass(frozen=True)
class BlockContainer:
    """The repeated-block container: its module path and the block index of each node inside it."""

    path: tuple[str, ...]
    node_block: dict[torch.fx.Node, int]

    @property
    def name(self) -> str:
        """Dotted path of the container, without Dynamo's root (``L['self']``)."""
        return ".".join(self.path[1:]) if len(self.path) > 1 else ".".join(self.path)

    @property
    def num_blocks(self) -> int:
        """Distinct block indices seen in the graph."""
        return len(set(self.node_block.values()))


def find_block_container(nodes: Iterable[torch.fx.Node]) -> BlockContainer | None:
    """The container of repeated blocks among ``nodes``, or None when no container has two blocks."""
    covered: dict[tuple[str, ...], dict[torch.fx.Node, int]] = {}
    first_seen: dict[tuple[str, ...], int] = {}
    for order, node in enumerate(nodes):
        for tokens in node_module_paths(node):
            for j in range(1, len(tokens)):
                if tokens[j].isdigit():
                    prefix = tokens[:j]
                    owner = covered.setdefault(prefix, {})
                    owner.setdefault(node, int(tokens[j]))
                    first_seen.setdefault(prefix, order)
    best: tuple[tuple[int, int, int, int], tuple[str, ...]] | None = None
    for prefix, node_block in covered.items():
        children = len(set(node_block.values()))
        if children < 2:
            continue
        key = (len(node_block), children, -len(prefix), -first_seen[prefix])
        if best is None or key > best[0]:
            best = (key, prefix)
    if best is None:
        return None
    return BlockContainer(path=best[1], node_block=covered[best[1]])


__all__ = ["BlockContainer", "find_block_container", "module_path_tokens", "node_module_paths"]
