"""Device tensors inside argument objects (a KV cache, a dataclass of state): host proxies for one call, then back.

Dynamo traces an object argument through its attributes (``cache.layers[0].keys``), so a device tensor held there
meets the host weights in the trace just like a direct device argument. :class:`ObjectSwap` walks the objects
reachable from the arguments (``__dict__``, ``__slots__``, dataclasses and ``ModelOutput`` s, the lists, tuples and
dicts inside them, nested objects; each object once, at most :data:`MAX_DEPTH` levels deep) and writes a host proxy
in place of each device tensor, *in the object itself*: the compiled forward must see the caller's object, since
the model updates it (Dynamo replays the attribute writes of the forward on the real object after the graph ran).

After the call :meth:`ObjectSwap.restore` puts back whatever still holds a proxy: an attribute the forward left
alone gets its original device tensor, and an attribute the forward wrote keeps what it was given (the device
tensor the executor produced) unless that is itself a proxy (a pass-through write), which becomes its device
tensor. No proxy is left behind in the caller's objects, whether the call succeeded or failed. In-place updates of
a proxied tensor (``index_copy_``, ``copy_``) reach the real tensor: the executor runs the graph on the device
tensors the substitution map names, not on the proxies.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from typing import Any

import torch

#: Objects never walked: their attributes are no caller state (modules hold the offloaded weights themselves).
_OPAQUE: tuple[type, ...] = (
    str, bytes, bytearray, int, float, complex, bool, type(None), type, enum.Enum, torch.device, torch.dtype,
    torch.Size, torch.nn.Module, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    range, slice, memoryview,
)

#: How many levels (objects, lists, tuples, dicts) below an argument object the walk goes: ``cache.layers[i].keys``
#: is four (the cache, its list, the layer, the tensor).
MAX_DEPTH = 8


#: Packages whose objects are never caller state (torch's streams, generators, ...; Python's and numpy's types).
_NOT_WALKED_PACKAGES = frozenset({"torch", "builtins", "numpy"})

#: What the walk does with a value, by its type: leave it, map it (a tensor), rebuild it (a tuple), walk its items in
#: place (a list or dict, subclasses included) or walk its fields in place (an object).
LEAVE, TENSOR, TUPLE, ITEMS, OBJECT = range(5)


def _kind(cls: type) -> int:
    """The walk's kind for values of type ``cls`` (cached: one look-up per value)."""
    kind = _KINDS.get(cls)
    if kind is None:
        if len(_KINDS) > _TYPES_CACHED:  # classes made per call must not pile up
            _KINDS.clear()
        kind = _KINDS[cls] = _kind_of(cls)
    return kind


_KINDS: dict[type, int] = {}
_TYPES_CACHED = 4096


def _kind_of(cls: type) -> int:
    if issubclass(cls, torch.Tensor):
        return TENSOR
    if issubclass(cls, tuple):
        return TUPLE
    if issubclass(cls, (list, dict)):
        return ITEMS
    if issubclass(cls, (set, frozenset, *_OPAQUE)):
        return LEAVE
    if str(getattr(cls, "__module__", "")).split(".", 1)[0] in _NOT_WALKED_PACKAGES:
        return LEAVE
    if "__dict__" in dir(cls) or _slot_names(cls):
        return OBJECT
    return LEAVE


def walkable(value: Any) -> bool:
    """True for an object whose attributes may hold caller state: not a tensor, container, module or value type."""
    return _kind(type(value)) == OBJECT


def _slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` names of ``cls`` and its bases (``__dict__`` and ``__weakref__`` aside; cached)."""
    names_of = _SLOTS.get(cls)
    if names_of is not None:
        return names_of
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in names and name not in ("__dict__", "__weakref__"):
                names.append(name)
    if len(_SLOTS) > _TYPES_CACHED:
        _SLOTS.clear()
    names_of = _SLOTS[cls] = tuple(names)
    return names_of


_SLOTS: dict[type, tuple[str, ...]] = {}


def _fields(obj: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of ``obj``'s instance attributes: ``__dict__`` entries, then set ``__slots__``."""
    d = getattr(obj, "__dict__", None)
    out = list(d.items()) if isinstance(d, dict) else []
    for name in _slot_names(type(obj)):
        try:
            out.append((name, object.__getattribute__(obj, name)))
        except AttributeError:
            continue
    return out


def _set_field(obj: Any, name: str, value: Any) -> None:
    """Write ``obj.name`` without the class's ``__setattr__`` (a frozen dataclass, a ``ModelOutput``'s syncing)."""
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and name in d:
        d[name] = value
    else:
        object.__setattr__(obj, name, value)


def _get_field(obj: Any, name: str) -> Any:
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and name in d:
        return d[name]
    return object.__getattribute__(obj, name)


_MISSING = object()


class _Slot:
    """One place in a caller's object (an attribute, a list index, a dict key) that now holds ``put`` instead of
    ``original``."""

    __slots__ = ("holder", "key", "kind", "put", "original")

    def __init__(self, holder: Any, key: Any, kind: str, put: Any, original: Any) -> None:
        self.holder, self.key, self.kind, self.put, self.original = holder, key, kind, put, original

    def read(self) -> Any:
        try:
            if self.kind == "attr":
                return _get_field(self.holder, self.key)
            return self.holder[self.key]
        except (AttributeError, IndexError, KeyError):
            return _MISSING

    def write(self, value: Any) -> None:
        if self.kind == "attr":
            _set_field(self.holder, self.key, value)
        else:
            self.holder[self.key] = value


class _Walk:
    """One walk through objects: ``tensor_fn(t)`` is what tensor ``t`` becomes (None: unchanged); lists and dicts
    are changed in place, tuples rebuilt, objects entered and written in place (each place written is recorded in
    ``slots`` when given). Each object or container is visited once; ``max_depth`` bounds the nesting."""

    def __init__(self, tensor_fn: Callable[[torch.Tensor], torch.Tensor | None], max_depth: int,
                 slots: list[_Slot] | None = None) -> None:
        self.tensor_fn = tensor_fn
        self.max_depth = max_depth
        self.slots = slots
        self.visited: set[int] = set()
        self.entered: list[Any] = []
        #: Places (``Type.attr``) whose contents lie deeper than ``max_depth``, left as they are.
        self.too_deep: list[str] = []

    def enter(self, obj: Any, depth: int, where: tuple[Any, str] | None = None) -> None:
        """Walk object ``obj``'s fields, writing what changed back into it."""
        if id(obj) in self.visited:
            return
        if depth > self.max_depth:
            self._too_deep(where)
            return
        self.visited.add(id(obj))
        self.entered.append(obj)
        for name, value in _fields(obj):
            new = self.value(value, depth + 1, (obj, name))
            if new is not value:
                _set_field(obj, name, new)
                if self.slots is not None:
                    self.slots.append(_Slot(obj, name, "attr", new, value))

    def value(self, value: Any, depth: int, where: tuple[Any, str] | None) -> Any:
        """What ``value`` becomes: a tensor mapped, a container or object walked (the same object comes back, but
        for a tuple with a changed item)."""
        kind = _kind(type(value))
        if kind == LEAVE:
            return value
        if kind == TENSOR:
            new = self.tensor_fn(value)
            return value if new is None else new
        if depth > self.max_depth:
            self._too_deep(where)
            return value
        if kind == TUPLE:
            items = [self.value(v, depth + 1, where) for v in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else _rebuilt(value, items)
        if kind == ITEMS:  # subclasses too (a ModelOutput is a dict): their items, in place
            if id(value) not in self.visited:
                self.visited.add(id(value))
                self._items(value, depth, where)
            return value
        self.enter(value, depth, where)
        return value

    def _too_deep(self, where: tuple[Any, str] | None) -> None:
        """Note the place (the object and attribute name an over-deep value lies under) as ``Type.attr``."""
        if where is not None:
            text = f"{type(where[0]).__name__}.{where[1]}"
            if text not in self.too_deep:
                self.too_deep.append(text)

    def _items(self, c: list[Any] | dict[Any, Any], depth: int, where: tuple[Any, str] | None) -> None:
        keys = list(c.keys()) if isinstance(c, dict) else range(len(c))
        for k in keys:
            old = c[k]
            new = self.value(old, depth + 1, where)
            if new is not old:
                c[k] = new
                if self.slots is not None:
                    self.slots.append(_Slot(c, k, "item", new, old))


class ObjectSwap:
    """Swaps device tensors inside argument objects for host proxies, in place, and puts them back.

    ``to_proxy(t)`` is the proxy for a device tensor ``t`` (None for a tensor to leave as it is); it records the
    substitution. :meth:`enter` is called for each object found in the arguments; :meth:`restore` undoes every
    swap still in place and turns any proxy the forward stored in a walked object into its device tensor.
    """

    def __init__(self, to_proxy: Callable[[torch.Tensor], torch.Tensor | None], max_depth: int = MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self._slots: list[_Slot] = []
        self._walk = _Walk(to_proxy, max_depth, self._slots)

    @property
    def too_deep(self) -> list[str]:
        """Places (``Type.attr``) nested deeper than ``max_depth``: device tensors there were not swapped."""
        return self._walk.too_deep

    def enter(self, obj: Any, depth: int = 1) -> None:
        """Replace the device tensors reachable from object ``obj``'s attributes by proxies, in place."""
        self._walk.enter(obj, depth)

    def restore(self, subs: dict[int, torch.Tensor], also: Any = None) -> None:
        """Put the caller's values back where a swap is still in place, then turn every proxy left in the walked
        objects (and in objects reachable from ``also``, e.g. the outputs) into its device tensor."""
        for slot in reversed(self._slots):
            if slot.read() is slot.put:
                slot.write(slot.original)
        self._slots.clear()
        fix = _Walk(lambda t: subs.get(id(t)), self.max_depth)
        for obj in self._walk.entered:
            fix.enter(obj, 1)
        if also is not None:
            fix.value(also, 0, None)
        self._walk = _Walk(self._walk.tensor_fn, self.max_depth, self._slots)


def _rebuilt(value: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if type(value) is tuple:
        return tuple(items)
    try:
        return type(value)(items)
    except TypeError:
        return tuple(items)
