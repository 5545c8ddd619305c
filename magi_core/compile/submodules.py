"""Direct calls of an offloaded model's submodules run offloaded too.

Callers do not always go through the model's forward: ``generate`` of an encoder-decoder (T5, BART, Whisper) runs
``model.get_encoder()(...)`` on its own, then the model's forward for every decoding step; user code may call
``model.text_encoder(...)`` or one block. Those submodules' weights are the model's host weights, so an eager call
with device inputs would meet host weights. :func:`install` gives every submodule that holds weights an entry
(``nn.Module._compiled_call_impl``, what ``nn.Module.compile`` sets): a direct call with a device tensor among its
arguments compiles the submodule through the model's offload backend (once) and runs it offloaded; its graphs are
runtimes of the model's handle, sharing its resident weights, copy buffer and device budget. A call with host
tensors only runs eagerly on the host, as before offloading (on the host backend the host is the device). Inside
the model's own graph (Dynamo tracing) the entry is not taken: the submodule is traced inline.

An entry holds its handle weakly and the compiled forward lives in the handle: the host weights keep the submodules
alive until the model is collected, and a submodule must not keep the model alive in turn.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from magi_core.compile.handle import OffloadHandle

#: Compiles one submodule (given by its qualified name) through the offload backend of a handle.
Compile = Callable[["OffloadHandle", nn.Module, str], Callable[..., Any]]


class SubmoduleEntry:
    """What a direct call of one submodule runs: its offloaded forward for device inputs (compiled on the first such
    call, kept in the handle), its own code otherwise."""

    def __init__(self, module: nn.Module, path: str, handle: OffloadHandle, compile_fn: Compile,
                 is_device: Callable[[torch.Tensor], bool]) -> None:
        self.module = module
        self.path = path
        self._handle = weakref.ref(handle)
        self._compile = compile_fn
        self._is_device = is_device
        self._lock = threading.Lock()

    @property
    def forward(self) -> Callable[..., Any] | None:
        """The submodule's offloaded forward (None until its first direct call with device inputs)."""
        h = self._handle()
        return None if h is None else h.submodule_forwards.get(self.path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        h = self._handle()
        if h is None or torch.compiler.is_compiling() or not self._on_device(args, kwargs):
            # traced as part of an enclosing graph, or host inputs computing with the host weights: its own code
            return self.module._call_impl(*args, **kwargs)
        forward = h.submodule_forwards.get(self.path)
        if forward is None:
            with self._lock:
                forward = h.submodule_forwards.get(self.path)
                if forward is None:
                    forward = h.submodule_forwards[self.path] = self._compile(h, self.module, self.path)
        return forward(*args, **kwargs)

    def _on_device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a tensor among the arguments (in tuples, lists and dicts) is on the device."""
        return any(isinstance(t, torch.Tensor) and self._is_device(t) for t in tree_leaves((args, kwargs)))


def holds_weights(module: nn.Module) -> bool:
    """Whether ``module`` or a module under it has a parameter or buffer."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def install(model: nn.Module, handle: OffloadHandle, compile_fn: Compile,
            is_device: Callable[[torch.Tensor], bool]) -> dict[str, SubmoduleEntry]:
    """Give each submodule of ``model`` that holds weights (the model itself aside) a :class:`SubmoduleEntry`
    (``is_device``: which tensors are on the device); returns them by qualified name. A submodule reached under
    several names gets one entry (its first name)."""
    entries: dict[str, SubmoduleEntry] = {}
    for path, module in model.named_modules(remove_duplicate=True):
        if module is model or not path or not holds_weights(module):
            continue
        entry = SubmoduleEntry(module, path, handle, compile_fn, is_device)
        module._compiled_call_impl = entry
        entries[path] = entry
    return entries


def uninstall(entries: dict[str, SubmoduleEntry]) -> None:
    """Take the entries away again (each submodule's eager call comes back)."""
    for entry in entries.values():
        if entry.module.__dict__.get("_compiled_call_impl") is entry:
            entry.module._compiled_call_impl = None


__all__ = ["SubmoduleEntry", "holds_weights", "install", "uninstall"]
