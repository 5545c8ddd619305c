"""The public entry points: :func:`offload` a model (or :func:`load` one built on the meta device from a
checkpoint), reach its :func:`handle`, :func:`release` it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from magi_core.compile import submodules
from magi_core.compile.device_inputs import OffloadedForward
from magi_core.compile.handle import OffloadHandle
from magi_core.config import OffloadConfig, resolve_config
from magi_core.errors import ConfigError, MagiError
from magi_core.host.config import HostOptions
from magi_core.host.loading import Rename, SourceSpec
from magi_core.host.materialize import materialize
from magi_core.host.topology import Coordinator
from magi_core.plan.registry import check_policy
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


class InferenceOnlyWarning(UserWarning):
    """An offloaded model was set up or called as if for training (offloading is inference-only)."""
_HANDLE_ATTR = "_magi_offload_handle"


def offload(model: M, config: OffloadConfig | None = None, *, host_options: HostOptions | None = None,
            methods: Sequence[str] = (), **compile_kwargs: Any) -> M:
    """Materialise ``model``'s weights in host memory and make its forward run through the offload backend.

    Returns the same module (type, parameters and ``state_dict`` unchanged; parameters now live in
    exact-size host arenas registered in place, and ``model.to(device)`` leaves them there). Inputs may be
    on the host or the device (device inputs are never copied: Dynamo sees host proxies of them, see
    :mod:`magi_core.compile.device_inputs`); outputs are on the device. The forward must compile to one
    graph (``fullgraph=True``); a graph break raises :class:`~magi_core.errors.MagiError` saying how to fix
    it. ``host_options`` (a :class:`~magi_core.host.HostOptions`) are passed to
    :func:`magi_core.host.materialize`; ``compile_kwargs`` (e.g. ``dynamic=False``) to :func:`torch.compile`.
    :func:`handle` gives the model's :class:`~magi_core.compile.handle.OffloadHandle`. Inference only: the
    offloaded forward runs without autograd. A model built on the meta device: use :func:`load`.
    ``methods``: other methods of the model that callers use instead of ``forward`` and that must run offloaded
    too, e.g. ``("decode",)`` for a diffusers ``AutoencoderKL`` (pipelines call ``vae.decode``); each compiles
    to its own graph, on the same host weights and device budget. The config is resolved once, here (the
    environment applied, see :func:`~magi_core.config.resolve_config`). A wrong argument (a dict for the config, a
    config field as a keyword) is a :class:`~magi_core.errors.ConfigError` naming what to pass, raised before any
    host work; under torch.distributed one rank's wrong argument raises on every rank at once.
    """
    return _offload(model, config, host_options, compile_kwargs, "offload", methods=methods)


def load(model: M, source: SourceSpec, config: OffloadConfig | None = None, *, strict: bool = True,
         rename: Rename | None = None, host_options: HostOptions | None = None, methods: Sequence[str] = (),
         **compile_kwargs: Any) -> M:
    """Fill ``model`` (built on the meta device) from ``source`` straight into host memory, then offload it.

    ``source``: a safetensors file, a directory of them, a sharded index (``*.safetensors.index.json``, as
    transformers and diffusers save), a list of files, a :class:`~magi_core.host.WeightSource`, or a function
    ``(name, meta_tensor) -> tensor`` (see :class:`~magi_core.host.CallableSource`). Each tensor is read once,
    converted to the model's dtype where the checkpoint's differs (cast the meta model first:
    ``model.to(torch.bfloat16)`` costs nothing), and written into its place in the shared host arena, through a
    staging window of at most 5% of the weights; non-persistent buffers are recomputed by the model's own code.
    ``strict`` (like ``load_state_dict``): tensors missing from the source or unknown to the model are an error
    listing them; ``strict=False`` zero-fills missing ones and skips unknown ones (both listed in a warning).
    Mis-shaped tensors are always an error. ``rename`` maps a checkpoint name to the model's (None: skip it).
    Real tensors of the model that the source also holds are overwritten by it; the others keep their values.
    Under torch.distributed every rank calls this: each tensor is read by one rank of a node and mapped by the
    others. On failure nothing is left behind (no file, nothing registered) and the model is as it was. The
    rest as for :func:`offload`; returns the same module (its parameters are new ``nn.Parameter`` objects).
    """
    return _offload(model, config, host_options, compile_kwargs, "load",
                    {"source": source, "strict": strict, "rename": rename}, methods=methods)


def _offload(model: M, config: OffloadConfig | None, host_options: HostOptions | None,
             compile_kwargs: dict[str, Any], entry: str, weights: dict[str, Any] | None = None,
             methods: Sequence[str] = ()) -> M:
    # what this rank checks alone (the model, the arguments, the config and its environment) fails inside one
    # agreed status: every rank raises at once instead of the others waiting in materialize's first gather
    cfg: OffloadConfig | None = None
    setup: BaseException | None = None
    try:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{entry}() takes an nn.Module, got {type(model).__name__}")
        methods = _check_methods(model, methods, entry)
        if isinstance(model.__dict__.get(_HANDLE_ATTR), OffloadHandle) and not model.__dict__[_HANDLE_ATTR].released:
            raise MagiError(f"{type(model).__name__} is already offloaded; magi_core.release(model) it first")
        if weights is not None:
            _check_source(weights["source"])
        _check_compile_kwargs(compile_kwargs, entry)
        cfg = _resolve(config, entry)
        _check_budget_share(cfg)
    except (MagiError, TypeError) as exc:
        setup = exc
    _agree(setup, entry)
    assert cfg is not None
    training = sorted({type(m).__name__ for m in model.modules() if m.training})
    if training:
        _inference_only(f"{type(model).__name__} is in training mode ({', '.join(training[:5])}"
                        f"{', ...' if len(training) > 5 else ''} train); offloading is for inference: dropout stays "
                        f"active and nothing is learned. Call model.eval() before magi_core.{entry}(model)",
                        stacklevel=4)  # the caller of offload() / load()
    h = OffloadHandle(type(model).__name__, cfg)
    h.host = materialize(model, options=host_options, **(weights or {}))
    try:
        # nn.Module.__call__ runs ``_compiled_call_impl`` when set: what ``nn.Module.compile`` installs, here
        # behind the host-side wrapper that hands Dynamo host proxies for device inputs. Dynamo compiles a
        # per-model entry function that calls ``model._call_impl`` (hooks included), so modules whose forward
        # lives in torch.nn (Sequential, Linear, ...) compile too.
        h.forward = _compile_resolved(model, cfg, h.name, h, compile_kwargs)
        for name in methods:  # an instance attribute: it shadows the class's method until release(restore=True)
            h.methods[name] = _compile_resolved(method_entry(model, name), cfg, f"{h.name}.{name}", h, compile_kwargs)
        # a submodule called on its own with device inputs (an encoder-decoder's generate calls the encoder alone)
        # compiles on its first such call, into the same handle
        backend = get_backend()
        h.submodules = submodules.install(
            model, h, functools.partial(_compile_submodule, cfg=cfg, compile_kwargs=compile_kwargs),
            _device_predicate(backend.device_type, backend.is_accelerator))
        model._compiled_call_impl = h.forward
        model.__dict__.update(h.methods)
        model.__dict__[_HANDLE_ATTR] = h
    except BaseException:  # nothing may be left behind: host weights restored, ranges and mappings released
        _uninstall(model, h)
        h.release(restore=True)
        raise
    logger.info("magi %s: %s forward runs through magi_offload (%s)", entry, h.name, cfg.to_dict())
    return model


def compile_offloaded(
    fn: Callable[..., Any],
    config: OffloadConfig | None = None,
    *,
    name: str | None = None,
    handle: OffloadHandle | None = None,
    **compile_kwargs: Any,
) -> OffloadedForward:
    """``fn`` (a module or function whose weights are already on the host) compiled through ``magi_offload``.

    One graph (``fullgraph=True``), called through :class:`~magi_core.compile.device_inputs.OffloadedForward`
    so device inputs work; weights are left as they are (:func:`offload` also materialises them). A module is
    compiled through :func:`module_entry` (its hooks run inside the graph). The runtimes it compiles are
    recorded in ``handle`` (a new one when None: ``forward.handle``).
    """
    _check_compile_kwargs(compile_kwargs, "compile_offloaded")
    cfg = _resolve(config, "compile_offloaded")
    return _compile_resolved(fn, cfg, name, handle, compile_kwargs)


def _compile_resolved(fn: Callable[..., Any], cfg: OffloadConfig, name: str | None, handle: OffloadHandle | None,
                      compile_kwargs: dict[str, Any]) -> OffloadedForward:
    """:func:`compile_offloaded` with ``cfg`` already resolved (:func:`_resolve`): the Dynamo backend uses it as
    it is."""
    if isinstance(fn, nn.Module):
        label = name or type(fn).__name__
        target: Callable[..., Any] = module_entry(fn)
    else:
        label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        target = fn
    h = handle if handle is not None else OffloadHandle(label, cfg)
    options: dict[str, Any] = {"config": cfg}
    compiled = torch.compile(target, backend=h.backend, options=options, **{**compile_kwargs, "fullgraph": True})
    backend = get_backend()
    return OffloadedForward(compiled, _device_predicate(backend.device_type, backend.is_accelerator),
                            model_name=label, handle=h)


def _check_budget_share(cfg: OffloadConfig) -> None:
    """A budget given as a share of the device's memory needs a device that says how much it has: refused before
    any host work, not at the first planning call."""
    if isinstance(cfg.device_memory_budget_bytes, str):
        backend = get_backend()
        info = backend.device_memory(backend.device())
        cfg.budget_bytes(None if info is None else int(info.total))


def _compile_submodule(h: OffloadHandle, module: nn.Module, path: str, cfg: OffloadConfig,
                       compile_kwargs: dict[str, Any]) -> OffloadedForward:
    """A submodule of ``h``'s model compiled into ``h`` (what its direct call with device inputs runs)."""
    return _compile_resolved(module, cfg, f"{h.name}.{path}", h, compile_kwargs)


def _resolve(config: Any, entry: str) -> OffloadConfig:
    """The effective config (environment applied, policy checked), resolved once on the way in; a value that is
    not an :class:`OffloadConfig` raises saying what to pass instead."""
    if config is not None and not isinstance(config, OffloadConfig):
        raise ConfigError(f"{entry}(): the config must be a magi_core.OffloadConfig, got {type(config).__name__} "
                          f"{_short(config)}; pass {_config_hint(config)}")
    cfg = resolve_config(config)
    check_policy(cfg.policy)
    return cfg


def _config_hint(value: Any) -> str:
    """What to pass instead of ``value`` where an :class:`OffloadConfig` belongs."""
    fields = OffloadConfig.field_names()
    if isinstance(value, Mapping) and value and all(isinstance(k, str) and k in fields for k in value):
        return "OffloadConfig(" + ", ".join(f"{k}={v!r}" for k, v in value.items()) + ")"
    if isinstance(value, str):
        return f"OffloadConfig(policy={value!r})"
    return "OffloadConfig(policy='BASE') (or leave it out for the defaults)"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_source(source: Any) -> None:
    """``load``'s source is not a config (the checkpoint comes first: ``load(model, source, config)``)."""
    if isinstance(source, OffloadConfig) or source is None:
        got = "an OffloadConfig" if source is not None else "None"
        raise ConfigError(f"load(model, source, config): the source comes first, got {got}; pass the "
                          "checkpoint (a safetensors file, a directory, an index, a WeightSource or a function), "
                          "then the config: magi_core.load(model, 'model.safetensors', OffloadConfig(...))")


def _agree(setup: BaseException | None, entry: str) -> None:
    """Raise on every rank when one rank's arguments failed (its own error there, one naming it on the others).

    Without torch.distributed (or with one rank) this raises ``setup`` when set; otherwise the ranks gather their
    statuses on the gloo group materialisation uses (one small collective), so no rank waits for another that left.
    """
    coord = Coordinator() if _distributed() else None
    if coord is None or coord.world_size <= 1:
        if setup is not None:
            raise setup
        return
    statuses = coord.all_gather(None if setup is None else (type(setup).__name__, str(setup)))
    if setup is not None:
        raise setup
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not bad:
        return
    kinds = {kind for _, (kind, _) in bad}
    cls = _AGREED_CLASSES.get(kinds.pop(), MagiError) if len(kinds) == 1 else MagiError
    raise cls(f"magi_core.{entry}: " + "; ".join(f"rank {r}: {kind}: {text}" for r, (kind, text) in bad)
              + " (every rank raises; fix that rank's input)")


#: Classes another rank's argument error is raised as on this rank (by name).
_AGREED_CLASSES: dict[str, type[Exception]] = {c.__name__: c for c in (ConfigError, MagiError, TypeError)}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def module_entry(model: nn.Module) -> Callable[..., Any]:
    """A function, with a code object of its own, that calls ``model`` (``_call_impl``: forward and hooks).

    Dynamo never starts tracing at a frame of torch.nn code, so compiling ``model._call_impl`` (or the
    forward of an ``nn.Sequential``, ``nn.Linear``, ...) finds no frame to compile; it starts here instead and
    traces into the module. Dynamo keeps compiled graphs, guards and the recompile limit per code object:
    each model gets its own copy of the code, so offloading many models (several instances of one class)
    never shares or exhausts one cache.
    """

    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        return model._call_impl(*args, **kwargs)

    return _with_own_code(offloaded_forward, model, "offloaded_forward")


def _with_own_code(fn: Callable[..., Any], model: nn.Module, label: str) -> Callable[..., Any]:
    """``fn`` (a closure) with a code object of its own, named ``<label>_<model class>``: Dynamo's caches, guards
    and recompile limit are per code object, so each model gets its own."""
    code = fn.__code__.replace(co_name=f"{label}_{type(model).__name__}")
    entry = types.FunctionType(code, fn.__globals__, code.co_name, None, fn.__closure__)
    entry.__qualname__ = f"{type(model).__qualname__}.{label}"
    return entry


def method_entry(model: nn.Module, name: str) -> Callable[..., Any]:
    """A function, with a code object of its own, that calls ``model``'s method ``name`` as the class defines it
    (what :func:`offload`'s ``methods`` compile; see :func:`module_entry`)."""
    method = getattr(type(model), name)

    def offloaded_method(*args: Any, **kwargs: Any) -> Any:
        return method(model, *args, **kwargs)

    return _with_own_code(offloaded_method, model, f"offloaded_{name}")


def _check_methods(model: nn.Module, methods: Sequence[str], entry: str) -> tuple[str, ...]:
    """``methods`` as a tuple of method names of ``model``'s class, or a ConfigError saying which is not one."""
    if isinstance(methods, str):
        methods = (methods,)
    names = tuple(methods)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ConfigError(f"{entry}(methods=...): {name!r} is not a public method name")
        if name == "forward":
            raise ConfigError(f"{entry}(methods=...): forward is always offloaded; list only other methods")
        if not callable(getattr(type(model), name, None)):
            raise ConfigError(f"{entry}(methods=...): {type(model).__name__} has no method {name!r}")
    return names


def _uninstall(model: nn.Module, h: OffloadHandle) -> None:
    """Take what offloading installed on ``model`` away again (the eager forward and methods come back)."""
    if model.__dict__.get("_compiled_call_impl") is h.forward:
        model._compiled_call_impl = None
    submodules.uninstall(h.submodules)
    for name, fwd in h.methods.items():
        if model.__dict__.get(name) is fwd:
            del model.__dict__[name]
    model.__dict__.pop(_HANDLE_ATTR, None)


def _inference_only(message: str, stacklevel: int = 3) -> None:
    """Warn the user (their code is at fault: Python's ``warnings``) and log it."""
    warnings.warn(message, InferenceOnlyWarning, stacklevel=stacklevel)
    logger.warning("magi offload: %s", message)


def _check_compile_kwargs(compile_kwargs: dict[str, Any], entry: str = "offload") -> None:
    """Refuse what torch.compile must not get from the caller, naming what to pass instead."""
    if compile_kwargs.get("fullgraph", True) is not True:
        raise ConfigError(
            f"{entry} compiles the forward with fullgraph=True (device inputs and host weights cannot meet in "
            "eager code between graphs); drop fullgraph=False, or use torch.compile(model, backend='magi_offload') "
            "with host inputs"
        )
    if "backend" in compile_kwargs or "options" in compile_kwargs:
        raise ConfigError(f"{entry} sets torch.compile's backend and options itself; pass an OffloadConfig instead")
    settings = {k: v for k, v in compile_kwargs.items() if k in OffloadConfig.field_names()}
    if settings:
        given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        call = {"load": "load(model, source, ", "compile_offloaded": "compile_offloaded(fn, "}.get(
            entry, f"{entry}(model, ")
        raise ConfigError(f"{entry}() has no argument {given}: it is an OffloadConfig setting; pass "
                          f"{call}OffloadConfig({given}))")
    host = {k: v for k, v in compile_kwargs.items() if k in _HOST_OPTION_FIELDS}
    if host:
        given = ", ".join(f"{k}={v!r}" for k, v in host.items())
        raise ConfigError(f"{entry}() has no argument {given}: it is a host option; pass "
                          f"host_options=magi_core.host.HostOptions({given})")
    unknown = sorted(k for k in compile_kwargs if k not in _COMPILE_KWARGS)
    if unknown:
        raise ConfigError(f"{entry}() got unexpected argument(s) {', '.join(unknown)}; it passes only "
                          f"{', '.join(sorted(_COMPILE_KWARGS))} on to torch.compile; settings of the offload belong "
                          "in OffloadConfig(...), host memory settings in host_options=HostOptions(...)")


#: torch.compile's keyword arguments a caller may pass through offload(), load() and compile_offloaded().
_COMPILE_KWARGS = frozenset(
    name for name, p in inspect.signature(torch.compile).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("backend", "options")
)
_HOST_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(HostOptions) if not f.name.startswith("_"))


def _device_predicate(device_type: str, is_accelerator: bool) -> Any:
    if not is_accelerator:
        return lambda t: False  # host backend: every tensor is already where the executor computes
    return lambda t: t.device.type == device_type


def handle(model: nn.Module) -> OffloadHandle:
    """The :class:`~magi_core.compile.handle.OffloadHandle` :func:`offload` attached to ``model``."""
    h = model.__dict__.get(_HANDLE_ATTR)
    if not isinstance(h, OffloadHandle):
        raise MagiError(f"{type(model).__name__} is not offloaded; call magi_core.offload(model) first")
    return h


def release(model: nn.Module, *, restore: bool = False) -> None:
    """Free what :func:`offload` made: resident device copies, registered host ranges, host mappings.

    ``restore=True`` copies the weights back into ordinary host memory and gives the model its plain eager
    forward back; otherwise the model is unusable afterwards (calling it raises). A model that is not
    offloaded is left alone.
    """
    h = model.__dict__.get(_HANDLE_ATTR)
    if not isinstance(h, OffloadHandle):
        return
    h.release(restore=restore)
    if restore:
        _uninstall(model, h)
