"""Non-persistent buffers of a model built on the meta device (rotary ``inv_freq``, masks, position ids).

They are not in a checkpoint (``register_buffer(..., persistent=False)``), so loading recomputes them the
way the model's own code does, module by module, first that works:

1. the weight source holds them (older checkpoints saved some): read from it;
2. the module's ``reset_parameters()``, run on a copy whose parameters stay on the meta device, sets them (it
   is run twice, on buffers pre-filled with different bytes, and must give the same values both times);
3. the module's constructor, re-run with the arguments it kept as attributes of the same name (e.g.
   ``config`` for transformers' rotary embeddings, ``dim`` and ``base`` for most hand-written ones),
   parameters created on the meta device, twice, with the same result both times.

Whatever is left is an error naming the buffers and how to fill them. The recomputed buffers are small
host tensors; loading then places them in the arena like every other tensor.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from magi_core.host.loading.base import ShapeMismatch, Staging, WeightSource

logger = logging.getLogger(__name__)

#: Largest parameter footprint (bytes, on the meta device) of a module whose constructor is re-run for its buffers.
MAX_REBUILD_PARAM_BYTES = 256 << 20


@dataclass
class BufferFix:
    """The non-persistent buffers replaced in the model (to undo on failure) and how each was obtained."""

    replaced: list[tuple[nn.Module, str, torch.Tensor]] = field(default_factory=list)
    how: dict[str, str] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)
    #: Buffers the source holds with another shape, left on the meta device (matching reports them).
    misshaped: list[str] = field(default_factory=list)

    def undo(self) -> None:
        """Put the meta buffers back."""
        for module, attr, old in reversed(self.replaced):
            new = module._buffers.get(attr)
            module._buffers[attr] = old
            _retarget(module, new, old)
        self.replaced.clear()


def _meta_nonpersistent(module: nn.Module) -> list[str]:
    return [b for b in sorted(module._non_persistent_buffers_set)
            if isinstance(module._buffers.get(b), torch.Tensor) and module._buffers[b].is_meta]  # type: ignore[union-attr]


def _retarget(module: nn.Module, old: Any, new: Any) -> None:
    """Plain attributes of ``module`` that are the tensor ``old`` (e.g. ``original_inv_freq = inv_freq``) -> ``new``."""
    if old is None:
        return
    for k, v in list(module.__dict__.items()):
        if v is old and not k.startswith("_"):
            module.__dict__[k] = new


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters registered while inside go to the meta device (buffers stay where they are made)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)


def _fit(module: nn.Module, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The values that fit the meta buffers (shape), converted to their dtype."""
    out = {}
    for name, v in got.items():
        want = module._buffers[name]
        if isinstance(v, torch.Tensor) and not v.is_meta and want is not None and tuple(v.shape) == tuple(want.shape):
            out[name] = v.detach().to(device="cpu", dtype=want.dtype).clone()
    return out


def _by_reset(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Run ``reset_parameters()`` on two copies (parameters on meta, buffers pre-filled 0x00 and 0xFF)."""
    reset = getattr(type(module), "reset_parameters", None)
    if not callable(reset):
        return {}
    results = []
    for fill in (0, 255):
        try:
            clone = copy.deepcopy(module)
            for b in names:
                want = module._buffers[b]
                assert want is not None
                buf = torch.empty(want.shape, dtype=want.dtype)
                if buf.numel():
                    buf.reshape(-1).view(torch.uint8).fill_(fill)
                clone._buffers[b] = buf
            with torch.no_grad():
                clone.reset_parameters()  # type: ignore[operator]
        except Exception as exc:  # its code cannot run on a copy with meta parameters: try the next way
            logger.debug("%s.reset_parameters() on a meta copy failed: %s", type(module).__name__, exc)
            return {}
        results.append({b: t for b in names if isinstance(t := clone._buffers.get(b), torch.Tensor)})
    got = {k: v for k, v in results[0].items() if k in results[1] and _same({k: v}, {k: results[1][k]})}
    return _fit(module, got)


def _by_constructor(module: nn.Module, names: list[str]) -> tuple[dict[str, torch.Tensor], str]:
    """Re-run the module's ``__init__`` with the arguments it kept as attributes (parameters on meta), twice."""
    cls = type(module)
    if _param_bytes(module) > MAX_REBUILD_PARAM_BYTES:
        return {}, ""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}, ""
    kwargs: dict[str, Any] = {}
    for p in list(sig.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in module.__dict__ or hasattr(module, p.name):
            value = getattr(module, p.name)
            if isinstance(value, (nn.Module, torch.Tensor)):
                return {}, ""  # a submodule or tensor argument: not something to rebuild from
            kwargs[p.name] = value
        elif p.default is p.empty:
            return {}, ""  # a required argument it did not keep
    results = []
    for _ in range(2):
        try:
            with _params_on_meta(), torch.device("cpu"), torch.no_grad():
                fresh = cls(**kwargs)
        except Exception as exc:  # the kept attributes are not what the constructor takes
            logger.debug("re-running %s(%s) failed: %s", cls.__name__, ", ".join(kwargs), exc)
            return {}, ""
        results.append({b: t for b in names if isinstance(t := fresh._buffers.get(b), torch.Tensor) and not t.is_meta})
    got = {k: v for k, v in results[0].items() if k in results[1] and _same({k: v}, {k: results[1][k]})}
    return _fit(module, got), f"{cls.__name__}({', '.join(kwargs)})"


def resolve(model: nn.Module, source: WeightSource, staging: Staging, fix: BufferFix,
            rename: Callable[[str], str | None] | None = None) -> None:
    """Give every non-persistent buffer on the meta device real values (see the module docstring), recorded in
    ``fix`` as they are replaced (so :meth:`BufferFix.undo` also undoes a call that raised part way); what cannot be
    resolved is listed in ``unresolved``, what the source holds with another shape in ``misshaped``."""
    names = source.names()
    by_model: dict[str, str] = {}
    if names is not None:
        for n in names:
            target = rename(n) if rename is not None else n
            if target is not None:
                by_model.setdefault(target, n)
    for prefix, module in model.named_modules():
        pending = _meta_nonpersistent(module)
        if not pending:
            continue
        dot = f"{prefix}." if prefix else ""
        values: dict[str, torch.Tensor] = {}
        for b in pending:
            src = by_model.get(dot + b)
            if src is not None:
                want = module._buffers[b]
                assert want is not None
                info = source.info(src)
                if info is not None and tuple(info.shape) != tuple(want.shape):
                    fix.misshaped.append(dot + b)
                    continue
                t = torch.empty(want.shape, dtype=want.dtype)
                try:
                    source.read_into(src, t, staging)
                except ShapeMismatch:  # a source that knows shapes only when read (a function)
                    fix.misshaped.append(dot + b)
                    continue
                values[b] = t
                fix.how[dot + b] = f"read from the source ({src})"
        left = [b for b in pending if b not in values and dot + b not in fix.misshaped]
        if left:
            got = _by_reset(module, left)
            for b in got:
                fix.how[dot + b] = f"{type(module).__name__}.reset_parameters()"
            values.update(got)
            left = [b for b in left if b not in values]
        if left:
            got, call = _by_constructor(module, left)
            for b in got:
                fix.how[dot + b] = f"re-running {call}"
            values.update(got)
            left = [b for b in left if b not in values]
        for b, v in values.items():
            old = module._buffers[b]
            assert old is not None
            module._buffers[b] = v
            _retarget(module, old, v)
            fix.replaced.append((module, b, old))
        fix.unresolved += [dot + b for b in left]
    for name, how in fix.how.items():
        logger.info("non-persistent buffer %s: %s", name, how)
