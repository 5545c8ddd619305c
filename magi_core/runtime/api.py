"""``offload(model, config)``: weights into pinned host memory, forward through the ``magi_offload`` backend."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from torch import nn

from magi_core.runtime.config import OffloadConfig, resolve_config

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
_HOST_ATTR = "_magi_offload_host_weights"


def offload(model: M, config: OffloadConfig | None = None, *, host_options: Any = None, **compile_kwargs: Any) -> M:
    """Materialise ``model``'s weights in host memory and make its forward run through the offload backend.

    Returns the same module (type, parameters and ``state_dict`` unchanged; parameters now live in
    exact-size host arenas registered in place, and ``model.to(device)`` leaves them there). Inputs may be
    on the host or the device; outputs are on the device. ``host_options`` are passed to
    :func:`magi_core.host.materialize.materialize`; ``compile_kwargs`` (e.g. ``dynamic=False``) to
    ``nn.Module.compile``. Inference only: the offloaded forward runs without autograd.
    """
    from magi_core.host.materialize import materialize

    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() takes an nn.Module, got {type(model).__name__}")
    cfg = resolve_config(config)
    model.__dict__[_HOST_ATTR] = materialize(model, options=host_options)
    model.compile(backend="magi_offload", options={"config": cfg}, **compile_kwargs)
    logger.info("magi offload: %s forward runs through magi_offload (%s)", type(model).__name__, cfg.to_dict())
    return model


def release(model: nn.Module, *, restore: bool = False) -> None:
    """Unpin and unmap the host weights :func:`offload` made (``restore=True`` keeps the model usable on the host)."""
    hw = model.__dict__.pop(_HOST_ATTR, None)
    if hw is not None:
        hw.release(restore=restore)
