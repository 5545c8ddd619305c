"""Device placement: make a graph Dynamo traced with host tensors run on the backend's device.

Dynamo, tracing with CPU inputs, specialises ``x.to(y.device)`` into ``x.to(device('cpu'))`` and
``torch.arange(n, device=y.device)`` into ``device=cpu``, and records CPU fake values. Moving only the
metadata is not enough (``x.index_select(0, idx.to(cpu))`` then meets a device mismatch), so
:func:`place_on_device` rewrites the nodes too. What it leaves alone, on purpose:

* ``.to(dtype)`` and any call whose device is an int (an accelerator index already);
* host scalars: 0-dim CPU tensors that are not parameters and are computed from host values only
  (Dynamo's lifted Python floats, read back with ``.item()``), both their nodes and their metadata;
* explicit ``x.cpu()`` calls (the model asked for the host).

Weights keep their ``nn.Parameter`` wrapping in the moved metadata: the split pass and the executor
recognise weights by it.

The target device and the backend's ``.to`` method aliases are always passed in (the compile backend passes
the active backend's); nothing here looks up a global backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from magi_core.passes.weights import (
    VALUE_KEYS,
    is_host_scalar,
    is_parameter_placeholder,
    is_parameter_value,
    node_value,
)

logger = logging.getLogger(__name__)

#: ``call_method`` names that take a ``device=`` keyword and create a new tensor there.
FACTORY_METHODS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided", "new_tensor"})


@dataclass
class PlacementReport:
    """What :func:`place_on_device` changed, counted by kind (all zero on a second run)."""

    device: torch.device
    to_calls: int = 0
    factory_kwargs: int = 0
    example_values: int = 0
    parameters_restored: int = 0
    modules_recompiled: int = 0

    @property
    def changed(self) -> bool:
        """True when anything in the graph or its metadata was changed."""
        return any(self.as_dict()[k] for k in self.as_dict() if k != "device")

    def as_dict(self) -> dict[str, Any]:
        """The counts as a plain dict (for logs and JSON)."""
        return {
            "device": str(self.device),
            "to_calls": self.to_calls,
            "factory_kwargs": self.factory_kwargs,
            "example_values": self.example_values,
            "parameters_restored": self.parameters_restored,
            "modules_recompiled": self.modules_recompiled,
        }


def is_cpu_device(value: Any) -> bool:
    """True for ``torch.device('cpu'[, i])`` or a string naming it; ints and everything else are not the CPU."""
    if isinstance(value, torch.device):
        return value.type == "cpu"
    if isinstance(value, str):
        try:
            return torch.device(value).type == "cpu"
        except (RuntimeError, ValueError):
            return False
    return False


def _is_device_like(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            return False
        return True
    return False


def _is_0dim_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _schema_device_index(target: Any) -> int | None:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "device" and not arg.kwarg_only:
            return i
    return None


class _Mover:
    """Moves CPU (fake) tensor values to the target device, keeping fake mode, symbolic shapes and Parameter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._fallback_mode: Any = None
        self.moved = 0

    def tensor(self, t: torch.Tensor, *, as_param: bool = False) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        was_param = as_param or is_parameter_value(t)
        with torch.no_grad():
            if isinstance(t, FakeTensor):
                with t.fake_mode:
                    if getattr(t, "constant", None) is not None:  # metadata only: its real value stays on the host
                        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
                    else:
                        new = t.to(self.device)
            elif self.device.type == "meta":
                new = t.to("meta")
            else:  # a real tensor as metadata: never copy real data to the device for metadata
                if self._fallback_mode is None:
                    self._fallback_mode = FakeTensorMode(allow_non_fake_inputs=True)
                fake = self._fallback_mode.from_tensor(t)
                with self._fallback_mode:
                    new = fake.to(self.device)
        self.moved += 1
        if was_param:
            return nn.Parameter(new, requires_grad=t.requires_grad)
        if t.requires_grad and new.is_leaf:
            new.requires_grad_(True)
        return new

    def value(self, v: Any, keep: Callable[[torch.Tensor], bool]) -> Any:
        """``v`` with every CPU tensor not kept by ``keep`` moved, through tuples, lists and dicts."""
        if isinstance(v, torch.Tensor):
            if v.device.type == "cpu" and not keep(v):
                return self.tensor(v)
            return v
        if isinstance(v, tuple):
            items = tuple(self.value(x, keep) for x in v)
            if all(a is b for a, b in zip(items, v, strict=True)):
                return v
            return type(v)(*items) if hasattr(v, "_fields") else items
        if isinstance(v, list):
            items_l = [self.value(x, keep) for x in v]
            return v if all(a is b for a, b in zip(items_l, v, strict=True)) else items_l
        if isinstance(v, dict):
            items_d = {k: self.value(x, keep) for k, x in v.items()}
            return v if all(items_d[k] is v[k] for k in v) else items_d
        return v


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    seen: set[int] = set()
    out: list[torch.fx.GraphModule] = []
    for _, mod in gm.named_modules(remove_duplicate=False):
        if isinstance(mod, torch.fx.GraphModule) and id(mod) not in seen:
            seen.add(id(mod))
            out.append(mod)
    return out


def _tensor_inputs(node: torch.fx.Node) -> Iterable[torch.fx.Node]:
    for n in node.all_input_nodes:
        v = node_value(n)
        if v is None or isinstance(v, torch.Tensor) or isinstance(v, (tuple, list)):
            yield n


class _GraphPlacer:
    """Rewrites one graph (not its children) and tracks which nodes hold host scalars."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        mover: _Mover,
        aliases: Sequence[str],
        report: PlacementReport,
        example_inputs: Sequence[Any] | None,
        is_root: bool,
    ) -> None:
        self.gm = gm
        self.mover = mover
        self.aliases = frozenset(aliases)
        self.alias_functions = {getattr(torch.Tensor, a) for a in aliases if hasattr(torch.Tensor, a)}
        self.report = report
        self.example_inputs = example_inputs if is_root else None
        self.host: set[torch.fx.Node] = set()
        self.code_changed = False

    def run(self) -> bool:
        """Rewrite the graph; True when its code changed (needs recompiling)."""
        placeholder_index = 0
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node, placeholder_index)
                placeholder_index += 1
                continue
            if node.op == "output":
                if any(n in self.host for n in node.all_input_nodes):
                    self.host.add(node)  # keeps the 0-dim host scalars it returns on the host
                self._move_meta(node)
                continue
            if node.op == "get_attr":
                continue
            rewritten = False
            if self._is_to_call(node):
                rewritten = self._rewrite_to(node)
            elif node.op == "call_function" or (node.op == "call_method" and node.target in FACTORY_METHODS):
                rewritten = self._rewrite_factory(node)
            if not rewritten and self._computes_host_scalar(node):
                self.host.add(node)
            self._move_meta(node)
        return self.code_changed

    # -- placeholders ---------------------------------------------------------------------------
    def _placeholder(self, node: torch.fx.Node, index: int) -> None:
        v = node_value(node)
        ex = None
        if self.example_inputs is not None and index < len(self.example_inputs):
            ex = self.example_inputs[index]
        is_param = is_parameter_placeholder(node, ex)
        if not is_param and is_host_scalar(v):
            self.host.add(node)
            return
        key = next((k for k in VALUE_KEYS if k in node.meta), None)
        if key is None or not isinstance(v, torch.Tensor):
            if key is not None:
                self._move_meta(node)
            return
        if v.device.type == "cpu":
            node.meta[key] = self.mover.tensor(v, as_param=is_param)
            self.report.example_values += 1
            if is_param and not is_parameter_value(v):
                self.report.parameters_restored += 1
        elif is_param and not is_parameter_value(v):
            node.meta[key] = nn.Parameter(v, requires_grad=v.requires_grad)
            self.report.parameters_restored += 1

    # -- .to(...) -------------------------------------------------------------------------------
    def _is_to_call(self, node: torch.fx.Node) -> bool:
        if node.op == "call_method":
            return node.target in self.aliases
        if node.op == "call_function":
            try:
                return node.target in self.alias_functions
            except TypeError:  # unhashable target
                return False
        return False

    def _rewrite_to(self, node: torch.fx.Node) -> bool:
        src = node.args[0] if node.args else node.kwargs.get("self")
        if isinstance(src, torch.fx.Node) and src in self.host:
            return False  # a host scalar moved to the host: leave it
        changed = False
        if len(node.args) > 1 and _is_device_like(node.args[1]) and is_cpu_device(node.args[1]):
            args = list(node.args)
            args[1] = self.mover.device
            node.args = tuple(args)
            changed = True
        if is_cpu_device(node.kwargs.get("device")):
            node.kwargs = {**node.kwargs, "device": self.mover.device}
            changed = True
        if changed:
            self.report.to_calls += 1
            self.code_changed = True
        return changed

    # -- device= in factories ---------------------------------------------------------------------
    def _rewrite_factory(self, node: torch.fx.Node) -> bool:
        if _is_0dim_tensor(node_value(node)):
            return False  # a 0-dim result made on the host stays a host scalar
        changed = False
        if is_cpu_device(node.kwargs.get("device")):
            node.kwargs = {**node.kwargs, "device": self.mover.device}
            changed = True
        if node.op == "call_function":
            idx = _schema_device_index(node.target)
            if idx is not None and idx < len(node.args) and is_cpu_device(node.args[idx]):
                args = list(node.args)
                args[idx] = self.mover.device
                node.args = tuple(args)
                changed = True
        if changed:
            self.report.factory_kwargs += 1
            self.code_changed = True
        return changed

    # -- metadata -------------------------------------------------------------------------------
    def _computes_host_scalar(self, node: torch.fx.Node) -> bool:
        v = node_value(node)
        if not is_host_scalar(v):
            return False
        return all(n in self.host for n in _tensor_inputs(node))

    def _move_meta(self, node: torch.fx.Node) -> None:
        host = node in self.host
        before = self.mover.moved

        def keep(t: torch.Tensor) -> bool:
            return host and is_host_scalar(t)

        for key in VALUE_KEYS:
            if key in node.meta:
                node.meta[key] = self.mover.value(node.meta[key], keep)
        self.report.example_values += self.mover.moved - before


def place_on_device(
    gm: torch.fx.GraphModule,
    device: torch.device | str,
    aliases: Sequence[str],
    *,
    example_inputs: Sequence[Any] | None = None,
) -> PlacementReport:
    """Rewrite ``gm`` (and nested GraphModules) in place so tensors it places on the CPU go to ``device``.

    ``aliases``: the names of ``Tensor.to`` in traced graphs (the backend's ``to_method_aliases``, e.g.
    ``("to",)``). ``example_inputs`` (the real graph inputs, optional) lets a weight whose fake value lost
    its ``nn.Parameter`` wrapping get it back. Idempotent; returns what changed.
    """
    target = torch.device(device)
    report = PlacementReport(device=target)
    if target.type == "cpu":
        logger.debug("device placement: target is the CPU, nothing to rewrite")
        return report
    mover = _Mover(target)
    for mod in _graph_modules(gm):
        placer = _GraphPlacer(mod, mover, tuple(aliases), report, example_inputs, is_root=mod is gm)
        if placer.run():
            mod.recompile()
            report.modules_recompiled += 1
    logger.info("device placement onto %s: %s", target, report.as_dict())
    return report


__all__ = ["FACTORY_METHODS", "PlacementReport", "is_cpu_device", "place_on_device"]
