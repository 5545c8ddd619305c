"""Layout of a model's host weights in exact-size, aligned, per-dtype arenas, and the views into them.

Every distinct tensor (tied weights count once) is placed in a :class:`Slot`. A slot holds either a
whole storage (when several model tensors share it, or the tensor covers it exactly: aliasing and
strides are kept) or one tensor packed contiguously (a small view of a larger storage). Slots are
grouped into one arena per dtype, each slot aligned to ``alignment`` bytes, each arena rounded up
to a page.
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


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Entry:
    """One distinct tensor of the model and every name it is reachable under."""

    tensor: torch.Tensor
    names: list[str]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


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
                out.append(typed.as_strided(e.size, _contiguous_stride(e.size), base // item))
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
        return (self.arena, self.offset, self.nbytes, self.whole,
                tuple((tuple(e.names), str(e.tensor.dtype), e.size, e.stride, e.storage_offset) for e in self.entries))


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


def collect(model: nn.Module) -> list[Entry]:
    """Every distinct parameter and buffer of ``model`` (tied ones once, with all their names)."""
    seen: dict[int, Entry] = {}
    order: list[Entry] = []
    items = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in items:
        if t is None:
            continue
        if id(t) in seen:
            seen[id(t)].names.append(name)
            continue
        _check_supported(name, t)
        e = Entry(tensor=t, names=[name], size=tuple(t.shape), stride=tuple(t.stride()),
                  storage_offset=int(t.storage_offset()))
        seen[id(t)] = e
        order.append(e)
    return order


def _check_supported(name: str, t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, nn.parameter.Buffer):
        raise HostStateError(
            f"{name}: tensor subclass {type(t).__name__} cannot be placed in host memory; convert it to a plain "
            "tensor (e.g. dequantise or unwrap it) before offloading"
        )
    if t.is_meta:
        raise HostStateError(f"{name} is on the meta device: load real weights (e.g. load_state_dict(assign=True)) "
                             "before offloading")
    if t.layout != torch.strided:
        raise HostStateError(f"{name} has layout {t.layout}; only dense (strided) tensors can be offloaded")


def plan(entries: list[Entry], alignment: int) -> Layout:
    """Place ``entries`` into per-dtype arenas (deterministic: same model structure, same layout)."""
    groups: dict[tuple[str, int], list[Entry]] = {}
    for e in entries:
        t = e.tensor
        if t.numel() == 0:
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        groups.setdefault(key, []).append(e)
    cursor: dict[str, int] = {}
    slots: list[Slot] = []
    for group in groups.values():
        t = group[0].tensor
        storage_bytes = t.untyped_storage().nbytes()
        tensor_bytes = t.numel() * t.element_size()
        whole = len(group) > 1 or storage_bytes <= tensor_bytes
        nbytes = storage_bytes if whole else tensor_bytes
        arena = _dtype_key(t.dtype)
        off = _align(cursor.get(arena, 0), alignment)
        cursor[arena] = off + nbytes
        slots.append(Slot(arena=arena, offset=off, nbytes=nbytes, whole=whole, entries=group))
    arena_bytes = {k: _align(v, PAGE) for k, v in cursor.items()}
    return Layout(slots=slots, arena_bytes=arena_bytes)


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
    speed, stops at the first difference; torch.equal's parallel path was 10-100x slower on 2 cores)."""
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


def fingerprints(entries: list[Entry], samples: int) -> list[int]:
    """:func:`fingerprint` of every entry, in order."""
    return [fingerprint(e.tensor, samples) for e in entries]
