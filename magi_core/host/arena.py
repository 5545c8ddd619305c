"""Layout of a model's host weights in exact-size, aligned, per-dtype arenas, and the views into them.

Every distinct tensor (tied weights count once) is placed in a :class:`Slot`. A slot holds either a
whole storage (when several model tensors share it, or the tensor covers it exactly: aliasing and
strides are kept) or one tensor packed contiguously (a small view of a larger storage). Slots are
grouped into arenas (one per dtype and per set of ranks sharing them), each slot aligned to ``alignment``
bytes, each arena rounded up to a page. Tensors on the meta device (a model built without weights, filled
from a weight source) are grouped the same way, by their storage.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from magi_core.host.errors import HostStateError

PAGE = mmap.PAGESIZE


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size``."""
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def dtype_key(dtype: torch.dtype) -> str:
    """The name of a dtype without the ``torch.`` prefix (an arena's key)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Entry:
    """One distinct tensor of the model and every name it is reachable under."""

    tensor: torch.Tensor
    names: list[str]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    #: (module, attribute, is_parameter) for every place the module tree holds it (a meta tensor is replaced there).
    homes: list[tuple[nn.Module, str, bool]] = field(default_factory=list)
    #: False for a buffer registered with ``persistent=False`` (not in the state dict).
    persistent: bool = True
    #: The meta tensor this entry's tensor replaced in the module tree (loaded from a weight source), else None.
    original: torch.Tensor | None = None

    @property
    def is_meta(self) -> bool:
        """True while the tensor is on the meta device (no values yet)."""
        return self.tensor.is_meta


@dataclass
class Slot:
    """A region of an arena: a whole storage (``whole=True``) or one packed tensor."""

    arena: str
    offset: int
    nbytes: int
    whole: bool
    entries: list[Entry] = field(default_factory=list)

    def views(self, buf: torch.Tensor, base: int) -> list[torch.Tensor]:
        """Tensors equal in layout to this slot's entries, placed at byte ``base`` of uint8 tensor ``buf``."""
        out = []
        for e in self.entries:
            dtype = e.tensor.dtype
            item = dtype.itemsize
            typed = buf.view(dtype) if buf.numel() % item == 0 else buf[: buf.numel() // item * item].view(dtype)
            if self.whole:
                out.append(typed.as_strided(e.size, e.stride, base // item + e.storage_offset))
            else:
                out.append(typed.as_strided(e.size, contiguous_stride(e.size), base // item))
        return out

    def copy_from_model(self, dst_u8: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Copy the entries' current values into this slot's region (``dst_u8`` = the region's bytes)."""
        if self.whole:
            dst_u8.copy_(self.source_bytes())
        else:
            views[0].copy_(self.entries[0].tensor)

    def source_bytes(self) -> torch.Tensor:
        """The bytes the entries live in now (whole: their storage region; packed: the one tensor's bytes)."""
        e = self.entries[0]
        t = e.tensor
        if not self.whole:
            return t.detach().contiguous().reshape(-1).view(torch.uint8)
        storage = t.untyped_storage()
        start = t.data_ptr() - e.storage_offset * t.element_size() - storage.data_ptr()  # region start
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        return whole[start: start + self.nbytes]

    def describe(self) -> tuple[object, ...]:
        """A hashable description of the slot's layout (for cross-rank comparison)."""
        return (self.arena, self.offset, *self.shape_key())

    def shape_key(self) -> tuple[object, ...]:
        """What two ranks' slots must agree on to hold one copy: names, dtypes, sizes, strides, bytes."""
        return (self.nbytes, self.whole,
                tuple((tuple(e.names), str(e.tensor.dtype), e.size, e.stride, e.storage_offset) for e in self.entries))

    def signature(self) -> str:
        """A short hash of :meth:`shape_key`: equal on two ranks when their slots can share one copy."""
        return hashlib.blake2b(repr(self.shape_key()).encode(), digest_size=12).hexdigest()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the slot's (first) tensor, which names its arena."""
        return self.entries[0].tensor.dtype


@dataclass
class Layout:
    """Slots in copy order, and the size of each arena."""

    slots: list[Slot]
    arena_bytes: dict[str, int]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights (slot sizes without padding)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def entries(self) -> list[Entry]:
        """Every distinct tensor, in copy order."""
        return [e for s in self.slots for e in s.entries]

    def digest(self) -> str:
        """A hash of the whole layout: ranks may share a file only when theirs are equal."""
        h = hashlib.sha256()
        for s in self.slots:
            h.update(repr(s.describe()).encode())
        h.update(repr(sorted(self.arena_bytes.items())).encode())
        return h.hexdigest()


def collect(model: nn.Module, *, allow_meta: bool = False) -> list[Entry]:
    """Every distinct parameter and buffer of ``model`` (tied ones once, with all their names and homes).

    ``allow_meta``: tensors on the meta device are collected too (to be filled from a weight source).
    """
    seen: dict[int, Entry] = {}
    order: list[Entry] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        stores = ((module._parameters, True), (module._buffers, False))
        for store, is_param in stores:
            for attr, t in store.items():
                if t is None:
                    continue
                name = dot + attr
                home = (module, attr, is_param)
                if id(t) in seen:
                    e = seen[id(t)]
                    if name not in e.names:
                        e.names.append(name)
                    if not any(m is module and a == attr for m, a, _ in e.homes):
                        e.homes.append(home)
                    continue
                _check_supported(name, t, allow_meta)
                e = Entry(tensor=t, names=[name], size=tuple(t.shape), stride=tuple(t.stride()),
                          storage_offset=int(t.storage_offset()), homes=[home],
                          persistent=is_param or attr not in module._non_persistent_buffers_set)
                seen[id(t)] = e
                order.append(e)
    params = [e for e in order if e.homes[0][2]]
    return params + [e for e in order if not e.homes[0][2]]  # parameters first, as named_parameters() gives them


def _check_supported(name: str, t: torch.Tensor, allow_meta: bool = False) -> None:
    if type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, nn.parameter.Buffer):
        raise HostStateError(
            f"{name}: tensor subclass {type(t).__name__} cannot be placed in host memory; convert it to a plain "
            "tensor (e.g. dequantise or unwrap it) before offloading"
        )
    if t.is_meta and not allow_meta:
        raise HostStateError(f"{name} is on the meta device: load its weights from a checkpoint with "
                             "magi_core.load(model, checkpoint) (or load real weights first, e.g. "
                             "load_state_dict(assign=True), then offload)")
    if t.layout != torch.strided:
        raise HostStateError(f"{name} has layout {t.layout}; only dense (strided) tensors can be offloaded")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    if t.is_meta:  # every meta storage has data_ptr 0: tell them apart by the storage object itself
        return ("meta", int(storage._cdata))
    return (str(t.device), storage.data_ptr())


def group(entries: list[Entry]) -> list[Slot]:
    """One unplaced :class:`Slot` per storage (tensors of one storage together; empty tensors get none)."""
    groups: dict[tuple[str, int], list[Entry]] = {}
    for e in entries:
        if e.tensor.numel() == 0:
            continue
        groups.setdefault(_storage_key(e.tensor), []).append(e)
    slots: list[Slot] = []
    for members in groups.values():
        t = members[0].tensor
        storage_bytes = t.untyped_storage().nbytes()
        tensor_bytes = t.numel() * t.element_size()
        whole = len(members) > 1 or storage_bytes <= tensor_bytes
        slots.append(Slot(arena="", offset=0, nbytes=storage_bytes if whole else tensor_bytes, whole=whole,
                          entries=members))
    return slots


def place(slots: list[Slot], alignment: int, arena_of: Callable[[Slot], str] | None = None) -> dict[str, int]:
    """Give every slot its arena (``arena_of(slot)``, default its dtype's name) and aligned offset, in order;
    return each arena's size (rounded up to a page)."""
    cursor: dict[str, int] = {}
    for slot in slots:
        arena = arena_of(slot) if arena_of is not None else dtype_key(slot.dtype)
        off = _align(cursor.get(arena, 0), alignment)
        cursor[arena] = off + slot.nbytes
        slot.arena, slot.offset = arena, off
    return {k: _align(v, PAGE) for k, v in cursor.items()}


def plan(entries: list[Entry], alignment: int) -> Layout:
    """Place ``entries`` into per-dtype arenas (deterministic: same model structure, same layout)."""
    slots = group(entries)
    return Layout(slots=slots, arena_bytes=place(slots, alignment))


_CHUNK = 64 << 20
_memcmp: Callable[[int, int, int], int] | None = None


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    global _memcmp
    if _memcmp is None:
        try:
            fn = ctypes.CDLL(None).memcmp
        except (OSError, AttributeError):  # no C library to call: torch.equal does it
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _memcmp = fn
    return _memcmp


def _equal_host(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two contiguous uint8 CPU tensors of one length hold the same bytes (libc memcmp: one thread at memory
    speed, stops at the first difference; torch.equal's parallel path is far slower on few cores)."""
    cmp = _libc_memcmp()
    if cmp is not None and a.is_contiguous() and b.is_contiguous():
        return a.numel() == 0 or cmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0
    return bool(torch.equal(a, b))


def same_bytes(own: torch.Tensor, host: torch.Tensor) -> bool:
    """True when the uint8 tensors ``own`` (any device) and ``host`` (CPU) hold exactly the same bytes.

    Compares bit patterns (NaN payloads and signed zeros count); a device tensor is brought over in chunks
    of 64 MiB.
    """
    if own.numel() != host.numel():
        return False
    if own.device.type == "cpu":
        return _equal_host(own, host)
    for lo in range(0, own.numel(), _CHUNK):
        part = own[lo: lo + _CHUNK].to("cpu")
        if not _equal_host(part, host[lo: lo + part.numel()]):
            return False
    return True


def fingerprint(t: torch.Tensor, samples: int) -> int:
    """A cheap hash of ``t``: dtype, shape and ``samples`` evenly spaced elements (bit patterns)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    n = t.numel()
    if n:
        k = min(samples, n)
        idx = torch.arange(k, dtype=torch.int64) * n // k
        idx[-1] = n - 1
        flat = t.reshape(1) if t.dim() == 0 else t
        coords = torch.unravel_index(idx.to(t.device), tuple(flat.shape))
        vals = flat.detach()[coords].to("cpu").contiguous()
        h.update(vals.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")
