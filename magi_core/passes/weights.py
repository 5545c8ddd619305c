"""Which graph inputs are weights, which are host scalars, and how many bytes a tensor value holds.

Rules (read from Dynamo metadata, never from node or submodule names):

* **parameter**: a placeholder whose ``example_value`` is an ``nn.Parameter`` (for fake tensors:
  ``_is_param`` set, so ``isinstance(ev, nn.Parameter)``), or whose real example input is one
  (``example_inputs[i]`` or Dynamo's ``meta["grapharg"]``), which catches a weight whose fake value
  lost its Parameter wrapping in an earlier pass.
* **static buffer**: a placeholder that is not a parameter, whose Dynamo ``grapharg.source`` comes from
  a module's parameters/buffers (``torch._dynamo.source.is_from_unspecialized_param_buffer_source``),
  and which nothing in the graph mutates (no in-place method, ``setitem``, ``out=`` or mutable-schema op
  on it or on a view of it, and it is not handed to a higher-order op). ``grapharg`` only exists while
  Dynamo calls the backend, so buffers are recognised only there; elsewhere they are plain inputs.
* **host scalar**: a 0-dim tensor on the CPU that is not a parameter (Dynamo's lifted Python floats,
  read back with ``.item()``); it stays on the host.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

#: Node-meta keys that hold a node's (fake) value: Dynamo's and the one used after AOT tracing.
VALUE_KEYS = ("example_value", "val")

#: Tensor methods / functions that return a view of their first argument (used for mutation tracking).
_VIEW_NAMES = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "t", "T", "mT", "transpose", "permute", "expand",
        "expand_as", "narrow", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided",
        "split", "chunk", "unbind", "movedim", "swapaxes", "swapdims", "diagonal", "detach", "alias",
        "unfold", "contiguous", "real", "imag", "view_as_real", "view_as_complex", "__getitem__",
    }
)


def node_value(node: torch.fx.Node) -> Any:
    """The (fake) value recorded for ``node`` (``example_value`` or ``val``), or None."""
    for key in VALUE_KEYS:
        if key in node.meta:
            return node.meta[key]
    return None


def is_parameter_value(value: Any) -> bool:
    """True when ``value`` is an ``nn.Parameter`` (real, or a fake tensor flagged ``_is_param``)."""
    return isinstance(value, nn.Parameter)


def is_host_scalar(value: Any) -> bool:
    """True for a 0-dim CPU tensor that is not a parameter: a lifted Python scalar that stays on the host."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.device.type == "cpu"
        and not is_parameter_value(value)
    )


def _grapharg(node: torch.fx.Node) -> Any:
    return node.meta.get("grapharg")


def _grapharg_example(node: torch.fx.Node) -> Any:
    ga = _grapharg(node)
    if ga is None:
        return None
    try:
        return ga.example
    except Exception:  # the weak reference died, or the arg is not a tensor
        return None


def is_parameter_placeholder(node: torch.fx.Node, example_input: Any = None) -> bool:
    """True when placeholder ``node`` is a module parameter (see the module docstring for the rule)."""
    if node.op != "placeholder":
        return False
    if is_parameter_value(node_value(node)) or is_parameter_value(example_input):
        return True
    ga = _grapharg(node)
    if ga is not None and is_parameter_value(getattr(ga, "fake_tensor", None)):
        return True
    return is_parameter_value(_grapharg_example(node))


#: Augmented assignments (``t += v``...): on a tensor they write it in place.
_AUGMENTED = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                        operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                        operator.irshift, operator.imatmul})


def _is_mutating(user: torch.fx.Node, arg: torch.fx.Node) -> bool:
    target = user.target
    if user.op == "call_method" and isinstance(target, str):
        return target.endswith("_") and not target.endswith("__") and user.args[:1] == (arg,)
    if user.op != "call_function":
        return False
    if target is operator.setitem or target in _AUGMENTED:  # ``t[i] = v``; ``t += v`` (Dynamo keeps it an iadd)
        return user.args[:1] == (arg,)
    if "out" in user.kwargs:
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True  # cannot see through it cheaply: treat as possibly mutating
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                given = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
                if given is arg:
                    return True
        return False
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") and user.args[:1] == (arg,)


def _is_view(user: torch.fx.Node) -> bool:
    if user.op == "call_method":
        return user.target in _VIEW_NAMES
    if user.op == "call_function":
        if user.target is operator.getitem:
            return True
        return getattr(user.target, "__name__", "") in _VIEW_NAMES
    return False


def is_mutated(node: torch.fx.Node) -> bool:
    """True when the graph writes to ``node``'s tensor or to a view of it (conservative)."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            if _is_mutating(user, cur):
                return True
            if _is_view(user):
                stack.append(user)
    return False


def is_static_buffer_placeholder(node: torch.fx.Node) -> bool:
    """True when placeholder ``node`` is a module buffer that the graph never mutates (Dynamo metadata only)."""
    if node.op != "placeholder" or is_parameter_placeholder(node):
        return False
    value = node_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    ga = _grapharg(node)
    source = getattr(ga, "source", None)
    if source is None:
        return False
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source
    except ImportError:  # older torch: no way to tell buffers from inputs robustly
        return False
    if not is_from_unspecialized_param_buffer_source(source):
        return False
    return not is_mutated(node)


def concrete_int(value: Any) -> int:
    """An int for a size that may be symbolic (its hint); raises when it has none."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"size {value} has no concrete hint; weights must have static shapes")
        return int(hint)
    return int(value)


def tensor_nbytes(value: torch.Tensor) -> int:
    """Bytes of a (possibly fake or symbolic-shaped) tensor's elements."""
    numel = 1
    for s in value.shape:
        numel *= concrete_int(s)
    return numel * value.element_size()


def weight_input_indices(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    include_buffers: bool = True,
) -> dict[int, bool]:
    """Input index -> is-buffer for every weight placeholder of ``gm`` (parameters, and static buffers)."""
    found: dict[int, bool] = {}
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        ex = example_inputs[i] if example_inputs is not None and i < len(example_inputs) else None
        if is_parameter_placeholder(node, ex):
            found[i] = False
        elif include_buffers and is_static_buffer_placeholder(node):
            found[i] = True
    return found


#: Functions that update a module's running statistics in place when called with ``training=True``.
_STAT_UPDATERS = frozenset({"batch_norm", "instance_norm"})


def _source_name(node: torch.fx.Node) -> str:
    """``blocks.0.norm.weight`` for Dynamo's ``L['self']._modules['blocks']._modules['0']...`` (else the node name)."""
    source = getattr(_grapharg(node), "source", None)
    name = getattr(source, "name", None)
    text = name() if callable(name) else name if isinstance(name, str) else node.name
    parts = re.findall(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", text)
    return ".".join(parts) if parts else text


def mutated_module_state(gm: torch.fx.GraphModule) -> list[str]:
    """Names of parameters and buffers the graph writes to (in-place ops, training-mode norm statistics).

    Such writes would land on a device copy and never reach the host tensor the module holds.
    """
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source
    except ImportError:  # older torch: parameters only
        is_from_unspecialized_param_buffer_source = None  # type: ignore[assignment]
    state: dict[torch.fx.Node, str] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(_grapharg(node), "source", None)
        from_module = (
            source is not None and is_from_unspecialized_param_buffer_source is not None
            and is_from_unspecialized_param_buffer_source(source)
        )
        if is_parameter_placeholder(node) or from_module:
            state[node] = _source_name(node)
    found = [name for node, name in state.items() if is_mutated(node)]
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "") not in _STAT_UPDATERS:
            continue
        training = node.kwargs.get("training", node.kwargs.get("use_input_stats"))
        if training is None and len(node.args) > 5:
            training = node.args[5]
        if training is True:
            found += [state[a] for a in (*node.args[1:3], node.kwargs.get("running_mean"),
                                         node.kwargs.get("running_var")) if isinstance(a, torch.fx.Node) and a in state]
    return sorted(set(found))
