"""Device inputs for offloaded forwards: host proxies for Dynamo, and the map that swaps the real tensors back in.

Dynamo fake-runs the user's eager code while tracing; a device input times a host weight fails there
("found two different devices"), before any backend is called. :func:`~magi_core.api.offload`
therefore calls the compiled forward through :class:`OffloadedForward`, which replaces every device tensor
in the arguments by a cached, never-filled host *proxy* of the same shape, stride and dtype, and records
``{id(proxy): device_tensor}`` in a thread-local substitution map for the duration of the call. Dynamo traces
and guards on host tensors (consistent with the host weights); the executor's input preparation
(:mod:`magi_core.execute.inputs`, which holds the map) takes the device tensor for any graph input whose id is
in the current map. Device tensors are never copied to the host, proxies never read. Pass-through outputs come
back as the device tensors.

Arguments are walked through tuples, lists and dicts (rebuilt for the call) and through other objects' attributes
(changed in place for the call and put back afterwards, :mod:`.object_inputs`): a KV cache object the model updates
ends up holding the device tensors the executor produced, a proxied tensor written in place (``index_copy_``) is
written on the device tensor behind it.
"""

from __future__ import annotations

import functools
import importlib
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from magi_core.compile.object_inputs import MAX_DEPTH, ObjectSwap, walkable
from magi_core.errors import MagiError
from magi_core.execute.inputs import substituting

if TYPE_CHECKING:
    from magi_core.compile.handle import OffloadHandle

ProxyKey = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class ProxyPool:
    """Host proxies by (shape, stride, dtype), created once and reused across calls; never filled.

    Only the ``max_layouts`` layouts used most recently are kept: a growing KV cache brings a new layout every
    step, and the proxies of past lengths would otherwise stay allocated. ``fill_value`` (tests only) fills each
    new floating-point proxy, e.g. with NaN to show that nothing ever reads one (integer proxies get their dtype's
    minimum, an index no lookup accepts).
    """

    def __init__(self, fill_value: float | None = None, max_layouts: int = 64) -> None:
        self._pool: dict[ProxyKey, list[torch.Tensor]] = {}
        self._fill = fill_value
        self.max_layouts = max_layouts

    def take(self, t: torch.Tensor, used: dict[ProxyKey, int]) -> torch.Tensor:
        """The next proxy for ``t``'s layout not yet ``used`` in this call (distinct inputs get distinct proxies)."""
        key: ProxyKey = (tuple(t.shape), tuple(t.stride()), t.dtype)
        n = used.get(key, 0)
        used[key] = n + 1
        proxies = self._pool.pop(key, None)
        if proxies is None:
            proxies = []
            self._evict(used)
        self._pool[key] = proxies  # most recently used last
        if n == len(proxies):
            p = torch.empty_strided(key[0], key[1], dtype=key[2], device="cpu")
            if self._fill is not None:
                _poison(p, self._fill)
            proxies.append(p)
        return proxies[n]

    def _evict(self, used: dict[ProxyKey, int]) -> None:
        """Drop the least recently used layouts beyond the bound, never one this call uses."""
        for key in list(self._pool):
            if len(self._pool) < self.max_layouts:
                return
            if key not in used:
                del self._pool[key]

    def proxies(self) -> list[torch.Tensor]:
        """Every proxy kept."""
        return [p for ps in self._pool.values() for p in ps]

    def __len__(self) -> int:
        return sum(len(ps) for ps in self._pool.values())


def _poison(p: torch.Tensor, fill: float) -> None:
    if p.dtype.is_floating_point or p.dtype.is_complex:
        p.fill_(fill)
    elif p.dtype != torch.bool:
        p.fill_(torch.iinfo(p.dtype).min)


def replace_device_tensors(
    value: Any,
    is_device: Callable[[torch.Tensor], bool],
    pool: ProxyPool,
    subs: dict[int, torch.Tensor],
    seen: dict[int, torch.Tensor],
    used: dict[ProxyKey, int],
    objects: ObjectSwap | None = None,
) -> Any:
    """``value`` with every device tensor (recursively through tuples, lists and dicts) replaced by a host proxy.

    Records ``id(proxy) -> device tensor`` in ``subs``; the same device tensor twice gets the same proxy (``seen``).
    Other objects are handed to ``objects`` (which swaps the tensors in their attributes in place), else left.
    """
    if isinstance(value, torch.Tensor):
        p = proxy_for(value, is_device, pool, subs, seen, used)
        return value if p is None else p
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, lambda v: replace_device_tensors(v, is_device, pool, subs, seen, used, objects))
    if objects is not None and walkable(value):
        objects.enter(value)
    return value


def proxy_for(
    t: torch.Tensor,
    is_device: Callable[[torch.Tensor], bool],
    pool: ProxyPool,
    subs: dict[int, torch.Tensor],
    seen: dict[int, torch.Tensor],
    used: dict[ProxyKey, int],
) -> torch.Tensor | None:
    """The host proxy standing in for ``t`` in this call (recorded in ``subs``), or None when ``t`` is no device
    tensor."""
    if not is_device(t):
        return None
    p = seen.get(id(t))
    if p is None:
        p = pool.take(t, used)
        seen[id(t)] = p
        subs[id(p)] = t
    return p


def restore_device_tensors(value: Any, subs: dict[int, torch.Tensor]) -> Any:
    """``value`` with every proxy in ``subs`` (recursively) replaced by its device tensor: pass-through outputs."""
    if isinstance(value, torch.Tensor):
        return subs.get(id(value), value)
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, lambda v: restore_device_tensors(v, subs))
    return value


def _map_container(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        out = {k: fn(v) for k, v in value.items()}
        return out if type(value) is dict else _rebuild(value, out)
    items = [fn(v) for v in value]
    if isinstance(value, list):
        return items if type(value) is list else _rebuild(value, items)
    if hasattr(value, "_fields"):  # namedtuple
        return type(value)(*items)
    return tuple(items) if type(value) is tuple else _rebuild(value, items)


def _rebuild(value: Any, content: Any) -> Any:
    try:
        return type(value)(content)
    except TypeError:
        return content


GRAPH_BREAK_HELP = (
    "magi offload() compiles the model's forward as ONE graph (fullgraph=True): device inputs reach it as "
    "host proxies and its weights live on the host, so any code that ran eagerly between graphs would compute "
    "on proxies or mix device intermediates with host weights. Dynamo found a graph break in the forward of "
    "{model}.{advice} Fix: remove the break (see Dynamo's reason below), or move the part that cannot compile "
    "out of this module's forward and run it before/after the call (torch.compiler.disable inside the forward "
    "is a graph break too), or offload() the submodules that do compile to one graph. "
    "Dynamo said:\n{reason}"
)

#: Specific advice by kind of graph break (see :func:`graph_break_advice`).
ADVICE_DATA_DEPENDENT = (
    "a Python branch on a tensor value (.item(), bool(tensor), `if tensor:`, `and`/`or` between tensors, "
    "int(tensor), range(tensor.item())) cannot be compiled into one graph, since the value is only known when "
    "the step runs: use torch.where / torch.cond (or branchless code such as torch.clamp, torch.nan_to_num), "
    "keep the value a tensor, or move the decision out of the forward and pass its result in"
)
ADVICE_RECOMPILES = (
    "the forward was recompiled more than torch._dynamo.config.recompile_limit times (inputs of new shapes "
    "or dtypes, or Python values the forward reads changing between calls): mark the varying dimensions "
    "dynamic (torch._dynamo.mark_dynamic, or offload(model, dynamic=True)), keep those values constant, or "
    "raise the limit"
)
ADVICE_PRINT = (
    "a print / logging call in the forward: remove it or log outside the forward, or add the function to "
    "torch._dynamo.config.reorderable_logging_functions"
)
ADVICE_EXPLICIT = (
    "an explicit graph break (torch._dynamo.graph_break(), or a function under torch.compiler.disable / "
    "torch._dynamo.disable): remove it, or move that code out of the forward"
)


_DYNAMO_BREAKS = ("Unsupported", "UserError", "FailOnRecompileLimitHit", "UncapturedHigherOrderOpError",
                  "CondOpArgsMismatchError")
_DATA_DEPENDENT = (
    ("torch.fx.experimental.symbolic_shapes", ("GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound")),
    ("torch._subclasses.fake_tensor", ("DataDependentOutputException", "DynamicOutputShapeException")),
)


def _classes(groups: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    for module, names in groups:
        try:
            mod = importlib.import_module(module)
        except ImportError:  # pragma: no cover - private torch modules; the set is best effort
            continue
        for name in names:
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


@functools.lru_cache(maxsize=1)
def data_dependent_classes() -> tuple[type[BaseException], ...]:
    """Exception classes of a value or shape that depends on tensor data (raised while Dynamo fake-runs ops)."""
    return _classes(_DATA_DEPENDENT)


@functools.lru_cache(maxsize=1)
def graph_break_classes() -> tuple[type[BaseException], ...]:
    """Exception classes that mean "this forward does not compile to one graph" (Dynamo's graph breaks and
    data-dependent failures); :class:`OffloadedForward` turns them into a :class:`~magi_core.errors.MagiError`."""
    return _classes((("torch._dynamo.exc", _DYNAMO_BREAKS), *_DATA_DEPENDENT))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (causes first met first), without cycles."""
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def is_graph_break(exc: BaseException) -> bool:
    """True when ``exc`` is a graph break, or a data-dependent failure (also wrapped in another error).

    An op that fails on its (fake) inputs, e.g. a shape mismatch in the model, is the model's bug and not a
    graph break, although Dynamo reports it through an ``Unsupported`` ("when making fake tensor call").
    """
    if any(isinstance(e, data_dependent_classes()) for e in _chain(exc)):
        return True
    return isinstance(exc, graph_break_classes()) and "when making fake tensor call" not in str(exc)


def graph_break_advice(exc: BaseException) -> str | None:
    """The specific advice for the kind of graph break ``exc`` is (None: only the general help applies)."""
    chain = _chain(exc)
    text = "\n".join(str(e) for e in chain).lower()
    names = {type(e).__name__ for e in chain}
    if names & {"GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound", "DataDependentOutputException",
                "DynamicOutputShapeException"} or any(
        word in text for word in ("data-dependent", "data dependent", "generic_jump", "tensor.item", "unbacked")
    ):
        return ADVICE_DATA_DEPENDENT
    if "FailOnRecompileLimitHit" in names or "recompile limit" in text or "recompile_limit" in text:
        return ADVICE_RECOMPILES
    if "graph_break()" in text or "marked as skipped" in text or "torch.compiler.disable" in text:
        return ADVICE_EXPLICIT
    if "`print`" in text or "'print'" in text or "logging" in text:
        return ADVICE_PRINT
    return None


def graph_break_error(exc: BaseException, model_name: str) -> MagiError:
    """The :class:`~magi_core.errors.MagiError` for graph break ``exc`` in the forward of ``model_name``."""
    advice = graph_break_advice(exc)
    return MagiError(GRAPH_BREAK_HELP.format(model=model_name, advice=f" Cause: {advice}." if advice else "",
                                             reason=exc))


class _InferenceOnly(torch.autograd.Function):
    """Gives the outputs of an offloaded forward, called with grad enabled, a backward that says why there is no
    gradient (instead of torch's "does not require grad"): the offloaded forward runs without autograd."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, model_name: str, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.model_name = model_name
        return tuple(t.detach() for t in outputs)  # the same storage: no copy

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise MagiError(
            f"{ctx.model_name} is offloaded, which is inference only: its forward ran without autograd, so backward() "
            "cannot reach its weights or inputs. Train without offloading; for inference call the model under "
            "torch.no_grad() or torch.inference_mode()"
        )


#: The leaf that makes :class:`_InferenceOnly`'s outputs part of the autograd graph (its grad is never computed).
_ANCHOR = torch.zeros((), requires_grad=True)


def mark_inference_only(out: Any, model_name: str) -> Any:
    """``out`` with its floating-point tensors (that do not already require grad) given a backward that raises
    :class:`~magi_core.errors.MagiError` saying the model is inference only; tuples and lists are rebuilt, dicts
    updated in place. Called only with grad enabled (a few microseconds a call)."""
    found: list[torch.Tensor] = []
    _collect(out, found)
    if not found:
        return out
    marked = dict(zip(map(id, found), _InferenceOnly.apply(_ANCHOR, model_name, *found), strict=True))
    return _swap(out, marked)


def _wants_mark(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if _wants_mark(value):
        if all(value is not f for f in found):
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)


def _swap(value: Any, marked: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return marked.get(id(value), value)
    if isinstance(value, list):
        value[:] = [_swap(v, marked) for v in value]
        return value
    if isinstance(value, tuple):
        items = [_swap(v, marked) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        for k, v in list(value.items()):
            value[k] = _swap(v, marked)
    return value


def _any_requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_any_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_any_requires_grad(v) for v in value.values())
    return False


class OffloadedForward:
    """The host-side forward :func:`~magi_core.api.offload` installs: device inputs in, proxies to Dynamo.

    ``compiled`` is the Dynamo-compiled model entry; ``is_device`` says which tensors to replace (device
    tensors of the active backend), directly in the arguments or inside their objects. Graph breaks and
    data-dependent failures (every class of :func:`graph_break_classes`, also when wrapped in another Dynamo error)
    surface as a :class:`~magi_core.errors.MagiError` with advice for the kind of break
    (:func:`graph_break_advice`); a :class:`~magi_core.errors.MagiError` the ``magi_offload`` backend raised while
    compiling comes out as itself, not wrapped in Dynamo's ``BackendCompilerFailed``.
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        is_device: Callable[[torch.Tensor], bool],
        model_name: str = "the model",
        pool: ProxyPool | None = None,
        handle: OffloadHandle | None = None,
    ) -> None:
        self.compiled = compiled
        #: The handle that owns what this forward compiles (its runtimes, the model's host weights).
        self.handle = handle
        self.is_device = is_device
        self.model_name = model_name
        self.pool = pool if pool is not None else ProxyPool()
        #: Calls that had at least one device input replaced by a proxy.
        self.substituted_calls = 0
        #: Held by the first call (Dynamo compiles then): callers racing it wait instead of compiling again.
        self._first_call = threading.Lock()
        self._called = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replace device inputs by proxies, run the compiled forward with the substitution map set, restore."""
        if self.handle is not None and self.handle.released:
            self.handle.check_usable()
        if not self._called:
            if torch.is_grad_enabled() and _any_requires_grad((args, kwargs)):
                warnings.warn(
                    f"{self.model_name} is offloaded: the forward runs without autograd (inference only), so no "
                    "gradient reaches an input or a weight (backward() raises); run it under torch.no_grad() or "
                    "torch.inference_mode(), and train without offloading", stacklevel=2,
                )
            with self._first_call:
                out = self._call(args, kwargs)
                self._called = True
        else:
            out = self._call(args, kwargs)
        return mark_inference_only(out, self.model_name) if torch.is_grad_enabled() else out

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        subs: dict[int, torch.Tensor] = {}
        seen: dict[int, torch.Tensor] = {}
        used: dict[ProxyKey, int] = {}
        pool, is_device = self.pool, self.is_device
        objects = ObjectSwap(lambda t: proxy_for(t, is_device, pool, subs, seen, used))
        out: Any = None
        try:
            pargs = replace_device_tensors(args, is_device, pool, subs, seen, used, objects)
            pkwargs = replace_device_tensors(kwargs, is_device, pool, subs, seen, used, objects)
            if not subs:
                return self.compiled(*args, **kwargs)
            self.substituted_calls += 1
            with substituting(subs):
                out = self.compiled(*pargs, **pkwargs)
            return restore_device_tensors(out, subs)
        except Exception as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) and isinstance(inner, MagiError):
                raise inner from None  # magi's own answer (the backend raised it), not Dynamo's wrapper
            if isinstance(e, MagiError):
                raise
            if isinstance(e, torch._dynamo.exc.TorchDynamoException):
                explained = self._device_state_error(e, (args, kwargs), objects.too_deep)
                if explained is not None:
                    raise explained from e
            if not is_graph_break(e):
                raise
            raise graph_break_error(e, self.model_name) from e
        finally:
            if subs:  # the caller's objects hold their device tensors again (or what the forward wrote), no proxy
                objects.restore(subs, out)

    def _device_state_error(self, e: Exception, inputs: Any, too_deep: list[str]) -> MagiError | None:
        """Dynamo failed: the error saying so when device tensors met the host weights where no proxy stands in
        for them (the model's own parameters or buffers, or input objects nested deeper than the walk goes), else
        None."""
        caused = f"The error they caused: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        host = self.handle.host if self.handle is not None else None
        model = host.model if host is not None else None
        named = ([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
                 if model is not None else [])
        off_host = [f"{name} ({t.device})" for name, t in named if t.device.type != "cpu"]
        if off_host:
            names = ", ".join(off_host[:8]) + (" and more" if len(off_host) > 8 else "")
            return MagiError(
                f"{self.model_name}: {names} {'is' if len(off_host) == 1 else 'are'} on the device, but an "
                "offloaded model keeps its weights and buffers on the host and streams them (model.to(device) "
                "leaves the offloaded ones there and moves only tensors added after offload). Keep them on the "
                "host: assign host tensors (register_buffer(name, t.cpu()), nn.Parameter(t.cpu())), or "
                f"magi_core.release(model, restore=True), change the model and offload it again. {caused}")
        if too_deep:
            return MagiError(
                f"{self.model_name}: what {', '.join(too_deep[:4])} holds lies more than {MAX_DEPTH} levels (objects, "
                "lists, tuples, dicts) deep in an argument, past where device tensors are handed to the compiled "
                "forward as host proxies: a device tensor there met the model's host weights. Pass that state less "
                f"deeply nested, or on the host. {caused}")
        return None
