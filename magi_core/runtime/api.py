"""``offload(model, config)``: weights into pinned host memory, forward through the ``magi_offload`` backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from magi_core.errors import ConfigError
from magi_core.registry import get_backend
from magi_core.runtime.config import OffloadConfig, resolve_config
from magi_core.runtime.device_inputs import OffloadedForward

if TYPE_CHECKING:
    from magi_core.host.materialize import HostWeights

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
_HOST_ATTR = "_magi_offload_host_weights"


def offload(model: M, config: OffloadConfig | None = None, *, host_options: Any = None, **compile_kwargs: Any) -> M:
    """Materialise ``model``'s weights in host memory and make its forward run through the offload backend.

    Returns the same module (type, parameters and ``state_dict`` unchanged; parameters now live in
    exact-size host arenas registered in place, and ``model.to(device)`` leaves them there). Inputs may be
    on the host or the device (device inputs are never copied: Dynamo sees host proxies of them, see
    :mod:`magi_core.runtime.device_inputs`); outputs are on the device. The forward must compile to one
    graph (``fullgraph=True``); a graph break raises :class:`~magi_core.errors.MagiError` saying how to fix
    it. ``host_options`` are passed to :func:`magi_core.host.materialize.materialize`; ``compile_kwargs``
    (e.g. ``dynamic=False``) to :func:`torch.compile`. Inference only: the offloaded forward runs without
    autograd.
    """
    from magi_core.host.materialize import materialize

    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() takes an nn.Module, got {type(model).__name__}")
    _check_compile_kwargs(compile_kwargs)  # before any host work
    cfg = resolve_config(config)
    model.__dict__[_HOST_ATTR] = materialize(model, options=host_options)
    # nn.Module.__call__ runs ``_compiled_call_impl`` when set: exactly what ``nn.Module.compile`` installs,
    # here behind the host-side wrapper that hands Dynamo host proxies for device inputs.
    model._compiled_call_impl = compile_offloaded(model._call_impl, cfg, name=type(model).__name__, **compile_kwargs)
    logger.info("magi offload: %s forward runs through magi_offload (%s)", type(model).__name__, cfg.to_dict())
    return model


def compile_offloaded(
    fn: Callable[..., Any], config: OffloadConfig | None = None, *, name: str | None = None, **compile_kwargs: Any
) -> OffloadedForward:
    """``fn`` (a module or function whose weights are already on the host) compiled through ``magi_offload``.

    One graph (``fullgraph=True``), called through :class:`~magi_core.runtime.device_inputs.OffloadedForward`
    so device inputs work; weights are left as they are (:func:`offload` also materialises them).
    """
    _check_compile_kwargs(compile_kwargs)
    compile_kwargs["fullgraph"] = True
    options: dict[str, Any] = {"config": resolve_config(config)}
    compiled = torch.compile(fn, backend="magi_offload", options=options, **compile_kwargs)
    backend = get_backend()
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    return OffloadedForward(compiled, _device_predicate(backend.device_type, backend.is_accelerator), model_name=label)


def _check_compile_kwargs(compile_kwargs: dict[str, Any]) -> None:
    if compile_kwargs.get("fullgraph", True) is not True:
        raise ConfigError(
            "offload compiles the forward with fullgraph=True (device inputs and host weights cannot meet in "
            "eager code between graphs); drop fullgraph=False, or use torch.compile(model, backend='magi_offload') "
            "with host inputs"
        )
    if "backend" in compile_kwargs or "options" in compile_kwargs:
        raise ConfigError("offload sets torch.compile's backend and options itself; pass an OffloadConfig instead")


def _device_predicate(device_type: str, is_accelerator: bool) -> Any:
    if not is_accelerator:
        return lambda t: False  # host backend: every tensor is already where the executor computes
    return lambda t: t.device.type == device_type


def offloaded_forward(model: nn.Module) -> OffloadedForward | None:
    """The host-side forward wrapper :func:`offload` installed on ``model`` (``None`` if not offloaded)."""
    fwd = model.__dict__.get("_compiled_call_impl")
    return fwd if isinstance(fwd, OffloadedForward) else None


def host_weights(model: nn.Module) -> HostWeights | None:
    """The host weights :func:`offload` materialised for ``model`` (``None`` if not offloaded or released)."""
    return model.__dict__.get(_HOST_ATTR)


def release(model: nn.Module, *, restore: bool = False) -> None:
    """Unpin and unmap the host weights :func:`offload` made (``restore=True`` keeps the model usable on the host)."""
    hw = model.__dict__.pop(_HOST_ATTR, None)
    if hw is not None:
        hw.release(restore=restore)
