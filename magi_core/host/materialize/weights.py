"""A model's weights in host arenas (:class:`HostWeights`) and the process's registries of them.

The registries answer, for every materialisation of this process: which weights are still held (released at
exit), which tensor belongs to which :class:`HostWeights` (a tensor materialised twice is refused), and which
model already has host weights (materialising it again returns them).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from magi_core.errors import MagiError
from magi_core.host import memstat, moves, pinning
from magi_core.host.arena import Entry, Layout
from magi_core.host.config import HostOptions
from magi_core.host.errors import HostStateError
from magi_core.plugin.facade import Backend

logger = logging.getLogger("magi_core.host.materialize")

_live_lock = threading.Lock()
_live: dict[int, HostWeights] = {}
_owned: dict[int, HostWeights] = {}  # id(tensor) -> owner, for tensors kept alive by their HostWeights
_by_model: weakref.WeakKeyDictionary[nn.Module, HostWeights] = weakref.WeakKeyDictionary()
#: Set when the interpreter exits (:func:`_release_all`): mappings still viewed then go with the process, so
#: :meth:`HostWeights.release` says so at DEBUG only.
_exiting = False

#: What :meth:`HostWeights.release` says when tensors outside the model still view some of its mappings.
STILL_MAPPED = (
    "%d host mapping(s) of the released weights (%s) stay mapped, no longer pinned, while tensors still view them "
    "(e.g. a weight or state_dict() kept from the model); the memory is freed with the last of those tensors. "
    "Nothing to do, unless that memory is needed back now: then drop those tensors"
)


@dataclass
class Arena:
    """One mapping (or plain buffer) holding the slots of one dtype that one set of ranks shares."""

    key: str
    nbytes: int
    buf: torch.Tensor  # uint8 view of the whole mapping
    path: str | None = None
    inode: int | None = None
    shared_by: tuple[int, ...] = ()
    writer: int = 0
    mapping: Any = None  # the mmap object (kept alive by the views too)
    private: bool = False  # copy-on-write mapping (MAP_PRIVATE): this rank's writes stay its own
    read_only: bool = False  # mprotect-ed read-only (a write is a SIGSEGV)
    write_map: Any = None  # while filling a copy-on-write arena: the shared mapping the bytes go through

    def info(self) -> dict[str, Any]:
        """JSON-able description."""
        return {"dtype": self.key, "nbytes": self.nbytes, "path": self.path, "inode": self.inode,
                "shared_by": list(self.shared_by), "writer": self.writer,
                "mapping": "copy_on_write" if self.private else "read_only" if self.read_only else
                "shared" if self.mapping is not None else "plain"}


@dataclass(frozen=True)
class HostLocation:
    """Where a tensor's bytes lie in the host arenas (see :meth:`HostWeights.locate`)."""

    arena: str
    """The arena's key: its dtype's name, followed by ``-r<ranks>`` when not all the node's ranks share it."""
    offset: int
    """Byte offset of the tensor's first element from the start of the arena."""
    nbytes: int
    """Bytes from the first to one past the last element (``numel * element_size`` for a contiguous tensor)."""
    path: str | None
    """The arena's shared-memory file (``None`` for plain host memory; files are unlinked once mapped)."""
    pinned: bool
    """True when all of the bytes lie in a range registered with the backend."""


class HostWeights:
    """A model's weights in host arenas: release with :meth:`release` (also on ``with`` exit and at exit)."""

    def __init__(self, model: nn.Module, layout: Layout, options: HostOptions, backend: Backend) -> None:
        self.options = options
        self.backend = backend
        self.layout = layout
        self.arenas: list[Arena] = []
        self.files: list[str] = []
        self.report: dict[str, Any] = {"timings": {}, "memory": {}}
        self.released = False
        self._ranges: list[tuple[int, int]] = []
        self._entries: list[Entry] = []
        self._patched: list[weakref.ref[nn.Module]] = []
        self._model = weakref.ref(model)
        self._lock = threading.Lock()
        self._mapping_refs: list[weakref.ref[Any]] = []

    # -- public ------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module | None:
        """The model these weights belong to (None once it was garbage-collected)."""
        return self._model()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held (no padding)."""
        return self.layout.weight_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered with the backend now."""
        return sum(n for _, n in self._ranges)

    @property
    def pinned_ranges(self) -> list[tuple[int, int]]:
        """The registered (ptr, nbytes) ranges."""
        return list(self._ranges)

    @property
    def mapped_ranges(self) -> list[tuple[int, int]]:
        """The (ptr, nbytes) of every arena backed by a shared-memory mapping."""
        return [(a.buf.data_ptr(), a.nbytes) for a in self.arenas if a.mapping is not None]

    def mapping_memory(self) -> dict[str, int]:
        """This process's ``Size``, ``Rss`` and ``Pss`` bytes of the arena mappings (see memstat.mapping_memory)."""
        return memstat.mapping_memory(self.mapped_ranges, [a.path for a in self.arenas if a.path])

    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t`` is one of the offloaded tensors."""
        return _owned.get(id(t)) is self

    def is_pinned(self, t: torch.Tensor) -> bool:
        """True when all of ``t``'s bytes lie in a registered range (safe for non_blocking copies)."""
        if t.numel() == 0:
            return False
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(p <= lo and hi <= p + n for p, n in self._ranges)

    def locate(self, t: torch.Tensor) -> HostLocation | None:
        """Where ``t``'s bytes lie in this object's arenas, or ``None`` when they are not (all) in one of them."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        lo = t.data_ptr()
        span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()
        for a in self.arenas:
            base = a.buf.data_ptr()
            if base <= lo and lo + span <= base + a.nbytes:
                return HostLocation(a.key, lo - base, span, a.path, self.is_pinned(t))
        return None

    def release(self, *, restore: bool = False) -> None:
        """Unregister every range, then unmap (idempotent).

        Default: the offloaded tensors become empty and the model refuses to run (its weights are gone).
        ``restore=True`` first copies the weights into ordinary host memory, so the model stays usable.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
            errors = pinning.unpin_ranges(self.backend, self._ranges)
            self._ranges = []
            moves.uninstall(self._patched)
            if restore:
                self._restore()
            else:
                for e in self._entries:
                    e.tensor.data = torch.empty(0, dtype=e.tensor.dtype)
            with _live_lock:
                _live.pop(id(self), None)
                for e in self._entries:
                    if _owned.get(id(e.tensor)) is self:
                        del _owned[id(e.tensor)]
            model = self._model()
            if model is not None:
                if _by_model.get(model) is self:
                    del _by_model[model]
                if not restore:
                    model.register_forward_pre_hook(_released_hook)
            self._entries = []
            self.arenas = []
            still = sum(1 for r in self._mapping_refs if r() is not None)
            if still:
                logger.log(logging.DEBUG if _exiting else logging.WARNING, STILL_MAPPED, still,
                           _mapped_size(self._mapping_refs))
            self.report["released"] = {"restore": restore, "still_mapped": still, "unregister_errors": errors}
            if errors:
                raise MagiError(f"unregistering host ranges failed: {'; '.join(errors)}")

    def unmapped(self) -> bool:
        """True once every mapping of this object has been unmapped."""
        return all(r() is None for r in self._mapping_refs)

    def __enter__(self) -> HostWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.pinned_bytes}/{self.weight_bytes} bytes pinned"
        return f"HostWeights({len(self.arenas)} arena(s), {state})"

    # -- internals ---------------------------------------------------------------------------------
    def _restore(self) -> None:
        for slot in self.layout.slots:
            buf = torch.empty(slot.nbytes, dtype=torch.uint8)
            views = slot.views(buf, 0)
            buf.copy_(slot.source_bytes())
            for e, v in zip(slot.entries, views, strict=True):
                e.tensor.data = v

    def _adopt(self, slot_views: list[tuple[Entry, torch.Tensor]]) -> None:
        with _live_lock:
            for e, v in slot_views:
                if e.tensor.is_meta:  # a meta tensor cannot take host data: a new one replaces it in every module
                    _replace(e, v)
                else:
                    e.tensor.data = v
                _owned[id(e.tensor)] = self
                self._entries.append(e)

    def _disown(self, tensors: Iterable[torch.Tensor]) -> None:
        """Forget that ``tensors`` belong to these weights (they get memory of their own again)."""
        with _live_lock:
            for t in tensors:
                if _owned.get(id(t)) is self:
                    del _owned[id(t)]


def is_owned(t: torch.Tensor) -> bool:
    """True when ``t`` already lives in host weights materialised for some model."""
    return id(t) in _owned


def weights_of(model: nn.Module) -> HostWeights | None:
    """The host weights last materialised for ``model`` and not released (None when there are none)."""
    return _by_model.get(model)


def register(hw: HostWeights, model: nn.Module) -> None:
    """Record ``hw`` as ``model``'s host weights: released at exit, or when the model is garbage-collected."""
    with _live_lock:
        _live[id(hw)] = hw
    _by_model[model] = hw
    # at exit :func:`_release_all` releases it, as an exit (weakref's own exit hook may run before that one)
    weakref.finalize(model, _model_gone, weakref.ref(hw)).atexit = False


def _mapped_size(refs: Iterable[weakref.ref[Any]]) -> str:
    """Bytes of the mappings ``refs`` still reach, in MiB."""
    total = 0
    for r in refs:
        m = r()
        try:
            total += len(m) if m is not None else 0
        except (TypeError, ValueError):  # closed, or not sized
            pass
    return f"{total / (1 << 20):.1f} MiB"


def _retarget(module: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """Plain attributes of ``module`` holding the tensor ``old`` (an alias of a buffer) now hold ``new``."""
    for k, v in list(module.__dict__.items()):
        if v is old and not k.startswith("_"):
            module.__dict__[k] = new


def _replace(e: Entry, view: torch.Tensor) -> None:
    """Put ``view`` where the meta tensor of ``e`` was (a new Parameter for a parameter), everywhere it is held."""
    old = e.tensor
    new: torch.Tensor = nn.Parameter(view, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else view
    for module, attr, is_param in e.homes:
        (module._parameters if is_param else module._buffers)[attr] = new  # type: ignore[assignment]
        _retarget(module, old, new)
    e.original, e.tensor = old, new


def unreplace(e: Entry) -> None:
    """Undo the replacement of a meta tensor (:meth:`HostWeights._adopt`): the meta tensor is back in every module."""
    old = e.original
    if old is None:
        return
    for module, attr, is_param in e.homes:
        (module._parameters if is_param else module._buffers)[attr] = old  # type: ignore[assignment]
        _retarget(module, e.tensor, old)
    e.tensor, e.original = old, None


#: Why a model whose weights were released without restore cannot run or be filled again.
RELEASED_MODEL = ("{name}: its host weights were released (magi_core.release() without restore=True), and its "
                  "tensors are empty. Build the model again (on the meta device, to magi_core.load into it), or "
                  "release with restore=True to keep using a model")


def _released_hook(module: nn.Module, args: Any) -> None:
    raise HostStateError(RELEASED_MODEL.format(name=type(module).__name__))


def was_released(model: nn.Module) -> bool:
    """True when ``model``'s weights were released without restore (its tensors are empty)."""
    return any(h is _released_hook for h in model._forward_pre_hooks.values())


@atexit.register
def _release_all() -> None:
    global _exiting
    _exiting = True
    with _live_lock:
        live = list(_live.values())
    for hw in live:
        try:
            hw.release()
        except Exception as exc:  # at exit: log and go on with the others
            logger.error("releasing host weights at exit failed: %s", exc)


def _model_gone(hw_ref: weakref.ref[HostWeights]) -> None:
    hw = hw_ref()
    if hw is not None and not hw.released:
        hw.release()
