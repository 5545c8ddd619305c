"""Weight sources: where a model built on the meta device gets its tensors, by name.

:func:`open_source` turns what a user passes into a source: :class:`SafetensorsSource` for files (a file,
several, a directory, or a sharded index ``*.safetensors.index.json``; :mod:`.safetensors_source`),
:class:`CallableSource` for a function ``(name, meta) -> tensor``, a :class:`WeightSource` (:mod:`.base`) as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Union

import torch

from magi_core.host.arena import same_bytes
from magi_core.host.errors import WeightSourceError
from magi_core.host.loading.base import (
    MissingTensor,
    PathLike,
    ShapeMismatch,
    Staging,
    TensorInfo,
    WeightSource,
    as_bytes,
)
from magi_core.host.loading.safetensors_source import SafetensorsSource, file_paths, open_regular

#: What :func:`magi_core.load` accepts as weights.
SourceSpec = Union["WeightSource", Callable[[str, torch.Tensor], "torch.Tensor | None"], PathLike, Sequence[PathLike]]


# -- a function --------------------------------------------------------------------------------------------
class CallableSource(WeightSource):
    """Tensors from ``fn(name, meta)``, where ``meta`` is a meta tensor with the model's shape and dtype; ``fn``
    returns a tensor of that shape (any dtype or device: converted), or None when it has no such tensor.

    ``identical_across_ranks`` (True, or a predicate on the name): ``fn`` returns the same values for that name on
    every rank of a node, so one rank calls it and the others map its copy without comparing (e.g. weights
    seeded by name). False (default): every rank calls ``fn``; tensors that come out byte-identical are shared
    after a full comparison, the others get a copy per rank.

    ``thread_safe``: ``fn`` may be called from several threads at once (``HostOptions.load_threads`` of them,
    default the cores shared by the node's ranks, at most 8), each holding one returned tensor at a time; False
    (default): one thread calls it.
    """

    def __init__(self, fn: Callable[[str, torch.Tensor], torch.Tensor | None], *,
                 identical_across_ranks: bool | Callable[[str], bool] = False, thread_safe: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"CallableSource takes a function (name, meta_tensor) -> tensor, got {type(fn).__name__}")
        self.fn = fn
        self.identical = identical_across_ranks
        self.parallel_safe = bool(thread_safe)

    def token(self, name: str, dtype: torch.Tensor | torch.dtype) -> Hashable | None:
        """``("callable", name, dtype)`` where declared identical across ranks, else None."""
        same = self.identical(name) if callable(self.identical) else bool(self.identical)
        return ("callable", name, str(dtype)) if same else None

    def _produce(self, name: str, like: torch.Tensor, staging: Staging) -> torch.Tensor:
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        t = self.fn(name, meta)
        if t is None:
            raise MissingTensor(name)
        if not isinstance(t, torch.Tensor):
            raise WeightSourceError(f"the weight function returned a {type(t).__name__} for {name!r}; return a tensor "
                                    "(or None when it has none)")
        if tuple(t.shape) != tuple(like.shape):
            raise ShapeMismatch(name, tuple(t.shape), tuple(like.shape))
        staging.largest = max(staging.largest, t.numel() * t.element_size())
        return t

    def read_into(self, name: str, out: torch.Tensor, staging: Staging) -> int:
        """Call ``fn`` and copy (converting) its tensor into ``out``."""
        t = self._produce(name, out, staging)
        with torch.no_grad():
            out.copy_(t)
        return t.numel() * t.element_size()

    def write_to(self, name: str, out: torch.Tensor, fd: int, offset: int, staging: Staging) -> int | None:
        """Call ``fn``; a host tensor of the model's dtype is written into the file ``fd`` at ``offset`` (no page
        faults on this process's mapping), anything else is copied (converting) into ``out``."""
        t = self._produce(name, out, staging)
        if t.dtype != out.dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            with torch.no_grad():
                out.copy_(t)
            return t.numel() * t.element_size()
        view: memoryview = as_bytes(t.detach()).numpy().data.cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done: done + (1 << 30)], offset + done)
        return done

    def matches(self, name: str, view: torch.Tensor, staging: Staging) -> bool:
        """Call ``fn`` and compare its values, converted chunk by chunk through ``staging``, with ``view``."""
        t = self._produce(name, view, staging)
        if t.dtype == view.dtype and t.device.type == "cpu" and t.is_contiguous() and view.is_contiguous():
            return same_bytes(as_bytes(t), as_bytes(view))
        src = t.reshape(-1)
        dst = view.contiguous().reshape(-1)
        per = staging.elements(view.dtype)
        for lo in range(0, dst.numel(), per):
            k = min(per, dst.numel() - lo)
            conv = staging.take(k * view.dtype.itemsize).view(view.dtype)
            conv.copy_(src[lo: lo + k])
            if not same_bytes(as_bytes(conv), as_bytes(dst[lo: lo + k])):
                return False
        return True

    def describe(self) -> str:
        """The function's name."""
        return f"function {getattr(self.fn, '__qualname__', type(self.fn).__name__)}"


# -- what users pass -----------------------------------------------------------------------------------------
_INDEX_SUFFIX = ".safetensors.index.json"


def _from_index(path: Path) -> SafetensorsSource:
    fd = open_regular(str(path), "checkpoint index")
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightSourceError(f"cannot read the checkpoint index {path}: {exc}") from exc
    except RecursionError as exc:  # nested deeper than Python's JSON parser goes: no index is
        raise WeightSourceError(f"cannot read the checkpoint index {path}: its JSON nests too deeply; it is not a "
                                "safetensors index, download it again") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightSourceError(f"{path} has no 'weight_map' (name -> file): not a sharded safetensors index")
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v or "\x00" in v]
    if bad:
        k, v = bad[0]
        raise WeightSourceError(f"the index {path}: weight_map[{k!r}] is {v!r} ({type(v).__name__}), not a file name "
                                f"such as 'model-00001-of-00002.safetensors' ({len(bad)} entr"
                                f"{'y' if len(bad) == 1 else 'ies'} of this kind); the index is corrupt")
    files = sorted({str(path.parent / f) for f in weight_map.values()})
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
        raise WeightSourceError(f"the index {path} names {len(absent)} file(s) that do not exist, e.g. {absent[:3]}; "
                                "download the whole checkpoint")
    return SafetensorsSource(files, weight_map=dict(weight_map), origin=str(path))


def _from_dir(path: Path) -> SafetensorsSource:
    indexes = sorted(path.glob(f"*{_INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return _from_index(indexes[0])
    if len(indexes) > 1:
        raise WeightSourceError(f"{path} holds several checkpoint indexes ({', '.join(p.name for p in indexes)}); "
                                "pass the one to load")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))[:3]
        hint = (f" (it has {', '.join(other)}: convert them to safetensors, e.g. with safetensors.torch.save_file)"
                if other else "; for a diffusers pipeline pass the component's folder (e.g. .../transformer or "
                ".../unet)")
        raise WeightSourceError(f"no *.safetensors file or *{_INDEX_SUFFIX} in {path}{hint}")
    return SafetensorsSource(files, origin=str(path))


def open_source(source: SourceSpec) -> WeightSource:
    """A :class:`WeightSource` for ``source``: a source as is, a callable, a safetensors file, a sharded index
    (``*.safetensors.index.json``), a directory holding either, or a list of safetensors files."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            return _from_dir(path)
        if not path.exists():
            raise WeightSourceError(f"weight source {path} does not exist")
        if path.name.endswith(".json"):
            return _from_index(path)
        if path.suffix == ".safetensors":
            return SafetensorsSource([path])
        raise WeightSourceError(f"{path}: only safetensors checkpoints are read (a .safetensors file, a "
                                f"*{_INDEX_SUFFIX} or a directory of them); convert it, e.g. with "
                                "safetensors.torch.save_file")
    if callable(source):
        return CallableSource(source)
    if isinstance(source, (list, tuple)):
        return SafetensorsSource(file_paths(source))
    raise TypeError(f"weights must be a path, a list of safetensors files, a WeightSource or a function "
                    f"(name, meta_tensor) -> tensor; got {type(source).__name__}")


__all__ = [
    "CallableSource",
    "MissingTensor",
    "PathLike",
    "SafetensorsSource",
    "ShapeMismatch",
    "SourceSpec",
    "Staging",
    "TensorInfo",
    "WeightSource",
    "open_source",
]
