"""Keep offloaded host weights where they are when the model is moved (``model.to(device)`` and kin).

Each module that owns offloaded parameters or buffers gets an instance-level ``_apply`` that hides
them from ``nn.Module._apply`` while the rest of the module's state moves as usual. A conversion that
would change an offloaded tensor's dtype raises: cast before offloading.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from magi_core.host.errors import HostStateError

_ATTR = "_apply"


def _changes_dtype(fn: Callable[[torch.Tensor], Any], dtype: torch.dtype, cache: dict[torch.dtype, bool]) -> bool:
    if dtype not in cache:
        out = fn(torch.empty(0, dtype=dtype))
        cache[dtype] = isinstance(out, torch.Tensor) and out.dtype != dtype
    return cache[dtype]


def install(modules: list[nn.Module], owned: Callable[[torch.Tensor], bool]) -> list[weakref.ref[nn.Module]]:
    """Patch every module in ``modules``; ``owned(t)`` says whether t is an offloaded tensor."""
    patched = []
    for module in modules:
        if _ATTR in module.__dict__:
            continue
        original = type(module)._apply

        def _apply(self: nn.Module, fn: Callable[[torch.Tensor], Any], *args: Any,
                   _original: Any = original, **kwargs: Any) -> nn.Module:
            hidden: list[tuple[dict[str, Any], str, Any]] = []
            cache: dict[torch.dtype, bool] = {}
            try:
                stores: tuple[dict[str, Any], ...] = (self._parameters, self._buffers)
                for store in stores:
                    for name, t in store.items():
                        if t is not None and owned(t):
                            if _changes_dtype(fn, t.dtype, cache):
                                raise HostStateError(
                                    f"{type(self).__name__}.{name} lives in offloaded host memory and cannot change "
                                    f"dtype ({t.dtype}); cast the model (e.g. model.to(torch.bfloat16)) before "
                                    "offloading it"
                                )
                            hidden.append((store, name, t))
                for store, name, _ in hidden:
                    store[name] = None
                result: nn.Module = _original(self, fn, *args, **kwargs)
                return result
            finally:
                for store, name, t in hidden:
                    store[name] = t

        object.__setattr__(module, _ATTR, types.MethodType(_apply, module))
        patched.append(weakref.ref(module))
    return patched


def uninstall(patched: list[weakref.ref[nn.Module]]) -> None:
    """Undo :func:`install` on the modules still alive."""
    for ref in patched:
        module = ref()
        if module is not None and _ATTR in module.__dict__:
            del module.__dict__[_ATTR]
