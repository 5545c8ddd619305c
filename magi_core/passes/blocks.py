"""Find the repeated blocks of a Dynamo graph from ``node.meta["nn_module_stack"]``.

A *container* is a module path whose integer-indexed children (``layers.0``, ``layers.1``, ...) occur
with at least two distinct indices among the nodes looked at, two of them of one class: a
``ModuleList``/``Sequential`` of repeated blocks. A node's *block key* is the OUTERMOST such container
on its module stack plus the index below it, so a stack nested in a block (``layers.3.experts.7``,
``down_blocks.1.resnets.0``) belongs to the outer block, and only shows up when the caller looks at
that block's nodes alone. Every container found is a stack of its own: a model with several (Flux's
dual- and single-stream blocks, an encoder and a decoder, a vision tower and a language model) gets
keys in all of them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch.fx

_TOKEN = re.compile(r"""\[\s*['"]?([^'"\]]+?)['"]?\s*\]|\.?([A-Za-z_][\w]*|\d+)""")
#: Names Dynamo puts in a module path that are not modules: its scopes and the attribute dicts it reads.
_SKIP_TOKENS = frozenset({"_modules", "__dict__", "L", "G"})


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
    return [path for path, _ in _module_stack(node)]


def _module_stack(node: torch.fx.Node) -> list[tuple[tuple[str, ...], object]]:
    """(module path as tokens, module class or its name, None when not recorded) per ``nn_module_stack`` entry."""
    stack = node.meta.get("nn_module_stack") or {}
    entries: list[tuple[tuple[str, ...], object]] = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        cls = value[1] if isinstance(value, tuple) and len(value) > 1 else None
        if isinstance(path, str):
            entries.append((module_path_tokens(path), cls))
    return entries


def container_name(path: tuple[str, ...]) -> str:
    """Dotted path of a container, without Dynamo's root (``L['self']``)."""
    return ".".join(path[1:]) if len(path) > 1 else ".".join(path)


@dataclass(frozen=True)
class BlockKey:
    """One block: its container's module path and its index there."""

    container: tuple[str, ...]
    index: int

    @property
    def label(self) -> str:
        """``transformer_blocks.3``: the block's dotted path."""
        return f"{container_name(self.container)}.{self.index}"


def _indexed_prefixes(node: torch.fx.Node) -> list[tuple[tuple[str, ...], int, object]]:
    """Every (container path, index, class of that child) on ``node``'s module stack, outermost call first.

    The class is the one recorded for the child module itself (None when only modules inside it were called).
    """
    entries = _module_stack(node)
    classes = {path: cls for path, cls in entries}
    found: list[tuple[tuple[str, ...], int, object]] = []
    seen: set[tuple[str, ...]] = set()
    for tokens, _ in entries:
        for j in range(1, len(tokens)):
            if tokens[j].isdigit() and tokens[: j + 1] not in seen:
                seen.add(tokens[: j + 1])
                found.append((tokens[:j], int(tokens[j]), classes.get(tokens[: j + 1])))
    return found


def block_keys(
    nodes: Iterable[torch.fx.Node], exclude: Collection[tuple[str, ...]] = ()
) -> dict[torch.fx.Node, BlockKey]:
    """The block key of each of ``nodes`` that lies in a container (nodes outside every container are left out).

    A container counts when at least two distinct indices of it occur among ``nodes`` and two of those
    children are of one class (repeated blocks, not a ``Sequential(Linear, Dropout)`` or a
    ``Sequential(backbone, head)``); ``exclude`` names containers not to count (their nodes take the next
    container inside, if any). Outermost means the first counted container in call order (the stack's
    outer module first, then the shorter path), so a module of one stack that a block of another calls
    stays with the calling block.
    """
    prefixes = {node: _indexed_prefixes(node) for node in nodes}
    children: dict[tuple[str, ...], dict[int, object]] = {}
    for found in prefixes.values():
        for path, index, cls in found:
            child = children.setdefault(path, {})
            if child.get(index) is None:
                child[index] = cls
    counted = {
        path for path, child in children.items()
        if len(child) >= 2 and len(set(map(_class_key, child.values()))) < len(child) and path not in exclude
    }
    keys: dict[torch.fx.Node, BlockKey] = {}
    for node, found in prefixes.items():
        for path, index, _ in found:
            if path in counted:
                keys[node] = BlockKey(path, index)
                break
    return keys


def _class_key(cls: object) -> str:
    """A comparable name for a recorded module class (a type, or already its name)."""
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)


__all__ = ["BlockKey", "block_keys", "container_name", "module_path_tokens", "node_module_paths"]
