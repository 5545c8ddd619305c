"""magidev tensors: a wrapper tensor (device ``magidev:N``) around a private host tensor, its device memory.

Every op on a magidev tensor reaches :meth:`MagidevTensor.__torch_dispatch__`, which unwraps the arguments,
runs the op on the private host tensors and wraps the results again (outputs of in-place and ``out=`` ops
are the argument tensors themselves, so identity and aliasing behave as on a real device). Copies between
the host and magidev therefore really copy: a host tensor changed after ``.to("magidev")`` leaves the
device copy as it was, exactly as on an accelerator.

Factory calls with ``device="magidev"`` (``torch.empty``, ``zeros``, ``full``, ``arange``, ``tensor``...)
carry no magidev tensor argument, so they reach torch's PrivateUse1 dispatch key instead: ``torch.library``
kernels registered for that key (:data:`FACTORIES`, plus a boxed fallback for every other op) run them on
the host and wrap the result.

Like a real accelerator, an op mixing a magidev tensor with a host tensor that is not 0-dim raises
("found at least two devices"); copies, ``_to_copy`` and indexing with host index tensors are allowed.
Each op is one step of the current stream, and what it reads and writes is reported to the stream-ordering
checker (:mod:`torch_magidev.checker`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torch_magidev import _state, memory
from torch_magidev._state import DEVICE_TYPE
from torch_magidev.checker import CHECKER, Block, Use
from torch_magidev.runtime import RUNTIME
from torch_magidev.streams import current_stream, lookup

aten = torch.ops.aten
_CPU = torch.device("cpu")

#: Ops that may take host tensors (any size) together with magidev tensors, as on CUDA.
_MIXED_OK = frozenset({
    aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default,
    aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
})
#: Ops whose result the host reads at once: they wait for the stream (a blocking read back).
_HOST_READS = frozenset({aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default})


class MagidevTensor(torch.Tensor):
    """A tensor on ``magidev:N`` whose data is a private host tensor (``_inner``), never shared with the host."""

    _inner: torch.Tensor
    _md_index: int
    _md_block: Block | None

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int, requires_grad: bool = False) -> MagidevTensor:
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device(DEVICE_TYPE, index), requires_grad=requires_grad,
        )
        t._inner = inner
        t._md_index = index
        t._md_block = None
        return t

    # plain torch functions reach __torch_dispatch__ below; no subclass handling at the torch-function level
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(self._inner)
        return text[:-1] + f", device='{DEVICE_TYPE}:{self._md_index}')" if text.endswith(")") else text

    # Traceable-subclass protocol: lets Dynamo trace functions that take magidev tensors (backend="eager").
    def __tensor_flatten__(self) -> tuple[list[str], dict[str, int]]:
        return ["_inner"], {"index": self._md_index}

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], meta: dict[str, int], outer_size: Any, outer_stride: Any
    ) -> MagidevTensor:
        return wrap(inner_tensors["_inner"], meta["index"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return dispatch(func, args, kwargs or {})


def wrap(inner: torch.Tensor, index: int, stream: tuple[int, int] | None = None, pos: int = 0) -> MagidevTensor:
    """A magidev tensor over ``inner`` (already private device memory), counted on its block."""
    t = MagidevTensor(inner, index)
    if type(inner) is torch.Tensor:  # real memory; fake and functional tensors (tracing) are not counted
        if stream is None:
            stream = current_stream(index).key
            pos = CHECKER.tick(stream)
        t._md_block = memory.attach(t, inner, index, stream, pos)
    return t


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_METADATA: dict[Any, bool] = {}


def _metadata_only(func: Any) -> bool:
    """True for ops that touch no device memory: views (outputs alias inputs, ``Tensor(a)``) and queries
    returning no tensor (``is_pinned``...). They run no kernel on a real device, so they need no ordering."""
    m = _METADATA.get(func)
    if m is None:
        returns = func._schema.returns
        views = [r.alias_info is not None and not r.alias_info.is_write for r in returns]
        tensors = [str(r.type).startswith("Tensor") for r in returns]
        m = (bool(returns) and all(views)) or (not any(tensors) and func not in _HOST_READS and not _written(func))
        _METADATA[func] = m
    return m


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes (schema alias annotations ``Tensor(a!)``)."""
    w = _WRITES.get(func)
    if w is None:
        w = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = w
    return w


def _arg(func: Any, args: Any, kwargs: Any, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else default
    return default


def _two_devices(a: str, b: str, func: Any) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(emulated magidev device, op {func})"
    )


def dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on the private host tensors of its magidev arguments and wrap what it returns."""
    if func is aten.record_stream.default:
        t, s = args
        if t._md_block is not None:
            CHECKER.on_record_stream(t._md_block, lookup(s).key)
        return None
    CHECKER.raise_pending()
    target: Any = None  # device= of the op: an index (magidev), "host", or None (follow the arguments)
    if kwargs.get("device") is not None:
        dev = torch.device(kwargs["device"])
        target = _state.index_of(dev) if dev.type == DEVICE_TYPE else "host"
        kwargs = {**kwargs, "device": _CPU}
    flat, spec = tree_flatten((args, kwargs))
    index: int | None = None
    wrappers: list[MagidevTensor] = []
    uflat: list[Any] = []
    host_ids: set[int] = set()
    tracing = False
    for x in flat:
        if isinstance(x, MagidevTensor):
            if index is None:
                index = x._md_index
            elif x._md_index != index:
                raise _two_devices(f"{DEVICE_TYPE}:{index}", f"{DEVICE_TYPE}:{x._md_index}", func)
            wrappers.append(x)
            tracing = tracing or type(x._inner) is not torch.Tensor
            uflat.append(x._inner)
        elif isinstance(x, torch.Tensor):
            if x.device.type == DEVICE_TYPE:  # a fake magidev tensor made by a tracer's fake mode
                x = x.to(_CPU)
            elif x.dim() > 0 and func not in _MIXED_OK:
                raise _two_devices(f"{DEVICE_TYPE}:{wrappers[0]._md_index if wrappers else 0}", str(x.device), func)
            host_ids.add(id(x))
            uflat.append(x)
        else:
            uflat.append(x)
    uargs, ukwargs = tree_unflatten(uflat, spec)
    dev_index = target if isinstance(target, int) else index if index is not None else _state.current_index()
    to_device = target != "host"
    s: tuple[int, int] | None = None
    pos = 0
    writes = _written(func)
    if not tracing and _metadata_only(func):
        s = current_stream(dev_index).key  # views share their base's block; the op itself is no device work
        pos = CHECKER.tick(s)
    elif not tracing:
        s = current_stream(dev_index).key
        pos = CHECKER.tick(s)
        written = {
            id(v) for i, name in writes
            for v in _as_list(args[i] if i < len(args) else kwargs.get(name)) if isinstance(v, MagidevTensor)
        }
        wuses = _uses(w for w in wrappers if id(w) in written)
        ruses = [u for u in _uses(w for w in wrappers if id(w) not in written) if u not in wuses]
        CHECKER.on_op(str(func), ruses, wuses, s, pos)
    if not tracing and func in (aten.copy_.default, aten._copy_from.default):
        _check_host_side(func, args)
    out = func(*uargs, **ukwargs)
    if writes:
        for w in wrappers:
            i = w._inner
            if i.shape != w.shape or i.stride() != w.stride() or i.storage_offset() != w.storage_offset():
                raise RuntimeError(
                    f"{func} resized or restrided a magidev tensor in place ({list(w.shape)} -> {list(i.shape)}): "
                    "the emulated device cannot change a tensor's shape in place; allocate it with its final shape"
                )
    by_inner = {id(w._inner): w for w in wrappers}

    def out_tensor(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        w = by_inner.get(id(o))
        if w is not None:
            return w
        if id(o) in host_ids or not to_device:
            return o
        return wrap(o, dev_index, s, pos) if s is not None else wrap(o, dev_index)

    result = tree_map(out_tensor, out)
    if s is not None and wrappers:
        _count_copies(func, args, kwargs, out, result, wrappers, s)
    return result


def _check_host_side(func: Any, args: Any) -> None:
    """A copy between host and device: its host bytes must lie inside one registration or outside all (CUDA)."""
    dst, src = (args[0], args[1]) if func is aten.copy_.default else (args[1], args[0])
    for host, dev in ((src, dst), (dst, src)):
        if isinstance(dev, MagidevTensor) and isinstance(host, torch.Tensor) and not isinstance(host, MagidevTensor):
            if host.numel():
                extent = (sum((n - 1) * st for n, st in zip(host.shape, host.stride(), strict=True)) + 1)
                RUNTIME.check_copy(host.data_ptr(), extent * host.element_size(), str(func))


def _count_copies(
    func: Any, args: Any, kwargs: Any, out: Any, result: Any, wrappers: list[MagidevTensor], s: tuple[int, int]
) -> None:
    """Copy counters, and the host's wait when it reads device data back without ``non_blocking``."""
    host_read = func in _HOST_READS
    if func in (aten.copy_.default, aten._copy_from.default):
        dst, src = (args[0], args[1]) if func is aten.copy_.default else (args[1], args[0])
        if isinstance(dst, MagidevTensor) and not isinstance(src, MagidevTensor) and isinstance(src, torch.Tensor):
            memory.COUNTERS["h2d_copies"] += 1
            memory.COUNTERS["h2d_bytes"] += src.nbytes
        elif not isinstance(dst, MagidevTensor) and isinstance(src, MagidevTensor):
            memory.COUNTERS["d2h_copies"] += 1
            memory.COUNTERS["d2h_bytes"] += src.nbytes
            host_read = not _arg(func, args, kwargs, "non_blocking", False)
    elif func is aten._to_copy.default and not isinstance(result, MagidevTensor):  # .cpu(), .to("cpu")
        memory.COUNTERS["d2h_copies"] += 1
        memory.COUNTERS["d2h_bytes"] += out.nbytes
        host_read = not _arg(func, args, kwargs, "non_blocking", False)
    if host_read:
        CHECKER.host_wait_stream(s)


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _uses(ts: Any) -> list[Use]:
    """The blocks the tensors ``ts`` live in, each with the byte range ``[lo, hi)`` the tensor spans."""
    out: list[Use] = []
    for t in ts:
        b = t._md_block
        if b is None:
            continue
        item = t.element_size()
        lo = t.storage_offset() * item
        extent = 0 if t.numel() == 0 else sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
        u = (b, lo, lo + extent * item)
        if u not in out:
            out.append(u)
    return out


# -- the PrivateUse1 dispatch key: factories, and copies that arrive with the Python key excluded ----------
def factory(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a factory op (``device=magidev``) on the host and wrap its result as new device memory."""
    if any(isinstance(x, MagidevTensor) for x in tree_flatten((args, kwargs))[0]):
        return dispatch(op, args, kwargs)
    CHECKER.raise_pending()
    device = kwargs.get("device")
    index = _state.index_of(device) if device is not None else _state.current_index()
    kwargs = {**kwargs, "device": _CPU}
    kwargs.pop("pin_memory", None)
    s = current_stream(index).key
    pos = CHECKER.tick(s)
    out = op(*args, **kwargs)
    return tree_map(lambda o: wrap(o, index, s, pos) if isinstance(o, torch.Tensor) else o, out)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::_copy_from`` (``copy_`` between devices when the Python key is excluded, e.g. ``torch.tensor``)."""
    return dispatch(aten.copy_.default, (dst, src, non_blocking), {})


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``aten::_copy_from_and_resize``: only without a resize (the emulation cannot resize in place)."""
    if dst.shape != src.shape:
        raise RuntimeError(f"magidev: cannot resize {list(dst.shape)} to {list(src.shape)} in place")
    return dispatch(aten.copy_.default, (dst, src, False), {})


#: Factory overloads with their own PrivateUse1 kernel. The composite ones among them (``arange``, ``eye``,
#: ``range``) would otherwise allocate an empty tensor and resize it in place, which a wrapper cannot follow.
FACTORIES = (
    "empty.memory_format", "empty_strided", "arange", "arange.start", "arange.start_step", "eye", "eye.m",
    "range", "range.step", "linspace", "logspace",
)
_libs: list[torch.library.Library] = []


def register_kernels() -> None:
    """Register the PrivateUse1 kernels (once per process)."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kernels for an existing namespace
    for name in FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")

        def kernel(*args: Any, _op: Any = op, **kwargs: Any) -> Any:
            return factory(_op, *args, **kwargs)

        lib.impl(name, kernel, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    fallback = torch.library.Library("_", "IMPL")  # noqa: TOR901
    fallback.fallback(factory, "PrivateUse1")
    _libs.extend((lib, fallback))
