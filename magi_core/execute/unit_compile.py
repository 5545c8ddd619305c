"""Per-unit compilation: run the unit's GraphModule eagerly, or compile it with Inductor at its first real call."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx

from magi_core.errors import ConfigError

logger = logging.getLogger(__name__)

#: A unit as the executor calls it: boxed (one list of arguments, which the callee may clear).
UnitFn = Callable[[list[Any]], Any]


class _Unhashable(Exception):
    """A graph argument the structure key cannot stand for exactly."""


class CompiledUnits:
    """Inductor code of one graph's units by :func:`structure_key`: units that differ only in names (the blocks
    of a model, each with its own weights as inputs) are compiled once (a 20-block diffusion transformer in ~3
    compiles instead of 22; Inductor's FX graph cache misses there, names being part of its key)."""

    def __init__(self) -> None:
        self.by_key: dict[Hashable, Callable[..., Any]] = {}
        self.compiles = 0
        self.reused = 0

    def get(self, module: torch.fx.GraphModule, args: Sequence[Any], name: str) -> Callable[..., Any]:
        """The compiled code for ``module`` at ``args``: reused from a unit of the same structure, else compiled."""
        key = structure_key(module, args)
        found = self.by_key.get(key) if key is not None else None
        if found is not None:
            self.reused += 1
            logger.debug("magi offload: unit %s reuses the Inductor code of a unit of the same structure", name)
            return found
        logger.debug("magi offload: compiling unit %s with inductor", name)
        compiled = compile_unit(module, args)
        self.compiles += 1
        if key is not None:
            self.by_key[key] = compiled
        return compiled


def structure_key(module: torch.fx.GraphModule, args: Sequence[Any]) -> Hashable | None:
    """A key equal for two units exactly when one's compiled code computes the other: the same operations wired
    the same way with the same constants (names ignored), inputs of one layout (shape, stride, dtype, device,
    16-byte alignment, grad); None when the graph reads module attributes (``get_attr``, ``call_module``: their
    values belong to the module) or holds a constant the key cannot state exactly (a tensor)."""
    index: dict[torch.fx.Node, int] = {}

    def norm(a: Any) -> Hashable:
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if a is None or isinstance(a, (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)) or a is Ellipsis:
            return (type(a).__name__, repr(a))
        raise _Unhashable(type(a).__name__)

    parts: list[Hashable] = []
    try:
        for i, node in enumerate(module.graph.nodes):
            if node.op in ("get_attr", "call_module"):
                return None
            target = node.target if node.op in ("call_function", "call_method") else None  # placeholder names: no
            index[node] = i
            parts.append((node.op, target, norm(node.args), norm(node.kwargs)))
        metas: list[Hashable] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                metas.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad, a.data_ptr() % 16 == 0))
            else:
                metas.append(norm(a))
        key = (tuple(parts), tuple(metas))
        hash(key)
    except (_Unhashable, TypeError):
        return None
    return key


class LazyUnit:
    """A unit callable that compiles itself with Inductor on its first call, using that call's device tensors.

    With ``direct`` the installed callable is the unit's Inductor code itself when :func:`direct_call` can
    verify it on this first call (see there); otherwise the compiled function as Dynamo would call it.
    ``shared``: the graph's :class:`CompiledUnits`, whose code a unit of the same structure reuses.
    """

    def __init__(
        self, module: torch.fx.GraphModule, name: str, on_compiled: Callable[[UnitFn, bool], None], direct: bool = True,
        shared: CompiledUnits | None = None,
    ) -> None:
        self.module = module
        self.name = name
        self._on_compiled = on_compiled
        self._direct = direct
        self._shared = shared if shared is not None else CompiledUnits()

    def __call__(self, args: list[Any]) -> Any:
        """Compile with Inductor (example inputs: these device args) or reuse a same-structure unit's code,
        install the result, run it."""
        compiled = self._shared.get(self.module, args, self.name)
        result = compiled(*args)
        fast = direct_call(compiled, args, result, self.name) if self._direct else None
        self._on_compiled(fast if fast is not None else _boxed(compiled), fast is not None)
        return result


def _boxed(fn: Callable[..., Any]) -> UnitFn:
    def call(args: list[Any]) -> Any:
        return fn(*args)

    return call


def compile_unit(module: torch.fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
    """``module`` compiled by Inductor for ``args``, from fakes under a shape environment.

    Two reasons for the shape environment. Dynamo lifts Python floats to 0-dim host tensors that the graph
    reads back with ``.item()`` (host scalars, see :mod:`magi_core.passes.weights`); Inductor fake-copies
    real example inputs without a shape environment, where ``.item()`` raises
    ``DataDependentOutputException``; under one, ``.item()`` is a symbolic float and the compiled unit reads
    the value on every call. And without a shape environment Inductor bypasses its FX graph cache ("No shape
    env"), so every configuration, process and run would compile every unit again; with it, a unit compiled
    once (same graph, shapes, dtypes and devices) is reused from the cache.

    Shapes are static where Dynamo's graph has them static. Where it made a size dynamic (a KV cache's length
    growing with every decode step, recorded as a symbol in the placeholders' ``val`` meta), the unit is compiled
    for any value of that size: one compiled unit serves every step. Should Inductor specialise such a size
    anyway, nothing would check it on later calls, so the unit runs eagerly instead.
    """
    dynamic = _dynamic_placeholders(module)
    if not any(d if isinstance(d, bool) else any(d) for d in dynamic):
        static = _compile(module, args, None)
        assert static is not None  # nothing symbolic to specialise
        return static
    compiled = _compile(module, args, dynamic)
    if compiled is None:
        logger.info("magi offload: Inductor specialised a dynamic size of a unit; it runs eagerly")
        return eager_forward(module)
    return compiled


def _dynamic_placeholders(module: torch.fx.GraphModule) -> list[list[bool] | bool]:
    """Per placeholder: for a tensor, which of its sizes Dynamo made symbolic; for an int, whether it is a symbol."""
    out: list[list[bool] | bool] = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(val, torch.Tensor):
            out.append([not isinstance(d, int) for d in val.shape])
        else:
            out.append(isinstance(val, torch.SymInt))
    return out


def _compile(module: torch.fx.GraphModule, args: Sequence[Any],
             dynamic: list[list[bool] | bool] | None) -> Callable[..., Any] | None:
    """Inductor's code for ``module``: static fakes of ``args``, or with the ``dynamic`` sizes and ints symbolic
    (None when Inductor specialised one of them)."""
    from torch._dynamo.source import LocalSource
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv() if dynamic is None else ShapeEnv(duck_shape=False, specialize_zero_one=False)
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols = []
    fakes: list[Any] = []
    for i, a in enumerate(args):
        dyn = dynamic[i] if dynamic is not None and i < len(dynamic) else False
        if isinstance(a, torch.Tensor):
            if isinstance(dyn, list) and any(dyn) and len(dyn) == a.dim():
                ctx: StatelessSymbolicContext[Any, Any] = StatelessSymbolicContext(
                    dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dyn])
                fake = fake_mode.from_tensor(a, source=LocalSource(f"unit_input_{i}"), symbolic_context=ctx)
                symbols += [d.node.expr for d in fake.shape if isinstance(d, torch.SymInt)]  # type: ignore[attr-defined]
                fakes.append(fake)
            else:
                fakes.append(fake_mode.from_tensor(a, static_shapes=True))
        elif dyn is True and isinstance(a, int) and not isinstance(a, bool):
            sym = shape_env.create_symbol(a, LocalSource(f"unit_int_{i}"), dynamic_dim=DimDynamic.DYNAMIC,
                                          do_not_specialize_zero_one=True)
            symbols.append(sym)
            fakes.append(shape_env.create_symintnode(sym, hint=a))
        else:
            fakes.append(a)
    with tracing(TracingContext(fake_mode)):
        compiled: Callable[..., Any] = compile_fx(module, fakes)  # type: ignore[assignment]
    if any(getattr(shape_env.replacements.get(sym), "is_number", False) for sym in symbols):
        return None
    return compiled


def unit_callable(
    module: torch.fx.GraphModule, name: str, compiler: str, install: Callable[[UnitFn, bool], None],
    direct: bool = True, shared: CompiledUnits | None = None,
) -> UnitFn:
    """The boxed callable the executor launches for one unit (eager: the module's ``forward``)."""
    if compiler == "eager":
        return _boxed(eager_forward(module))
    if compiler == "inductor":
        return LazyUnit(module, name, install, direct, shared)
    raise ConfigError(f"unit compiler must be 'eager' or 'inductor' here, got {compiler!r}")


def eager_forward(module: torch.fx.GraphModule) -> Callable[..., Any]:
    """The generated ``forward`` of ``module``, bound, skipping lazy-recompile and ``nn.Module.__call__`` layers."""
    real = getattr(module, "real_recompile", None)
    if callable(real):
        real()  # a lazy GraphModule generates its code now instead of on every call's check
    return module.forward


def output_code(compiled: Any, depth: int = 0, seen: set[int] | None = None) -> Any | None:
    """The Inductor output object (``CompiledFxGraph``) under the wrappers of ``compile_fx``'s result, or None.

    Searched through closures and ``__wrapped__`` attributes (torch internals; the layers differ between
    torch versions and between a fresh compile and an FX-graph-cache hit).
    """
    seen = set() if seen is None else seen
    if depth > 12 or id(compiled) in seen:
        return None
    seen.add(id(compiled))
    if type(compiled).__name__ == "CompiledFxGraph" and callable(getattr(compiled, "current_callable", None)):
        return compiled
    inner: list[Any] = []
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    wrapped = getattr(compiled, "__wrapped__", None)
    if wrapped is not None:
        inner.append(wrapped)
    for value in inner:
        if value is not compiled and (callable(value) or hasattr(value, "current_callable")):
            found = output_code(value, depth + 1, seen)
            if found is not None:
                return found
    return None


def direct_call(compiled: Callable[..., Any], args: Sequence[Any], expected: Any, name: str = "") -> UnitFn | None:
    """The unit's Inductor code, called without the Dynamo / AOT wrapper layers around it, or None.

    ``compile_fx`` returns the generated code wrapped in several Python layers (Dynamo's disable, AOT
    Autograd's runtime wrapper for input mutations, aliased outputs, grad and autocast modes, effect tokens,
    RNG state). For a unit that needs none of them they only cost host time: tens of microseconds per call,
    more than the executor's own work per unit. The inner object is found through the wrappers'
    closures (torch internals: None when the structure is not found) and used only when, on this first call:
    no autocast is active, the code mutates no input in place (the wrapped call already applied it once),
    and calling it with the same ``args`` returns the same structure and values as ``compiled`` did
    (``expected``). Anything else keeps the wrapped call.
    """
    if _autocast_active(args):
        return None
    inner = output_code(compiled)
    if inner is None or getattr(inner, "mutated_input_idxs", None):
        return None
    try:
        got = inner(list(args))
    except Exception as exc:  # noqa: BLE001 - any failure keeps the wrapped call
        logger.debug("magi offload: unit %s keeps the wrapped call (direct call raised %s)", name, exc)
        return None
    unwrap = isinstance(expected, torch.Tensor)
    want = (expected,) if unwrap else expected
    if not isinstance(want, (tuple, list)) or not isinstance(got, (tuple, list)) or len(got) != len(want) \
            or not all(_same(a, b) for a, b in zip(got, want, strict=True)):
        logger.debug("magi offload: unit %s keeps the wrapped call (direct call returned something else)", name)
        return None
    if unwrap:
        def call_one(args: list[Any]) -> Any:
            return inner(args)[0]

        return call_one
    if type(got) is type(expected):
        return inner
    if type(expected) in (tuple, list):
        container = type(expected)

        def call_as(args: list[Any]) -> Any:
            return container(inner(args))

        return call_as
    return None


def _autocast_active(args: Sequence[Any]) -> bool:
    """True when any autocast is on (the AOT wrapper would switch it off around the unit's code)."""
    any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
    if callable(any_enabled):
        return bool(any_enabled())
    kinds = {a.device.type for a in args if isinstance(a, torch.Tensor)} | {"cpu"}
    return any(torch.is_autocast_enabled(k) for k in kinds)


def _same(a: Any, b: Any) -> bool:
    """Same value for the direct-call check: tensors of one layout and (nearly) equal values, else ``==``."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        if a.stride() != b.stride() and a.numel() > 1:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-6, equal_nan=True))
        return bool(torch.equal(a, b))
    return bool(a == b) if not isinstance(a, torch.Tensor) else False


def like_with_like(compiler: str) -> contextlib.AbstractContextManager[Any]:
    """Inductor settings under which a whole-graph compile and per-unit compiles round alike (no-op for eager).

    With ``emulate_precision_casts`` Inductor rounds low-precision values where the model's code casts them,
    not wherever a fused kernel ends, so results no longer depend on fusion (hence unit) boundaries: use it
    around both the reference and the offloaded run when comparing them. Not applied to normal runs.
    """
    if compiler != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(emulate_precision_casts=True)
