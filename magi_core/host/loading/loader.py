"""Matching a model built on the meta device with a weight source, and filling its arena slots from it.

:class:`Loader` decides, before anything is read, where every tensor comes from: the source (a meta tensor,
or a real one the source also holds, which the source overwrites as ``load_state_dict`` would), the model
itself (a real tensor the source does not hold), or zeros (a missing tensor under ``strict=False``). It lists
missing, unexpected and mis-shaped tensors in one error, gives each slot the claim the ranks of a node share
by (:mod:`magi_core.host.topology`), and writes a slot's bytes into its place in an arena.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from magi_core.host.arena import Entry, Slot, contiguous_stride
from magi_core.host.loading import buffers
from magi_core.host.loading.base import MissingTensor, ShapeMismatch, Staging, WeightSource
from magi_core.host.topology import Claim

logger = logging.getLogger(__name__)

#: Default staging window: this fraction of the weight bytes, within [STAGING_MIN, STAGING_MAX] (4%: with the rest
#: of loading's own allocations the anonymous memory it adds stays within 5% of the weights).
STAGING_FRACTION = 0.04
STAGING_MIN = 4096
STAGING_MAX = 64 << 20

Rename = Callable[[str], "str | None"]


def staging_window(weight_bytes: int, explicit: int | None = None) -> int:
    """Bytes of the staging buffer: ``explicit``, else 4% of the weights clamped to [4 KiB, 64 MiB]."""
    if explicit is not None:
        return int(explicit)
    return int(min(STAGING_MAX, max(STAGING_MIN, weight_bytes * STAGING_FRACTION)))


def _show(names: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


class Loader:
    """Where each tensor of a model comes from, and the writing of it (see the module docstring)."""

    #: True: the slots it owns are read from a weight source (:class:`NoSource` says False).
    from_source = True

    def __init__(self, source: WeightSource, *, strict: bool = True, rename: Rename | None = None) -> None:
        self.source = source
        self.strict = strict
        self.rename = rename
        self.staging = Staging(STAGING_MIN)
        self.fix = buffers.BufferFix()
        self.plans: dict[int, list[tuple[str, str | None]]] = {}  # id(slot) -> per entry (kind, source name)
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []
        self.late_missing: list[str] = []  # found while reading (a function source is asked name by name)
        self.late_misshaped: list[str] = []
        self.kept: list[str] = []  # real tensors the source does not hold: their values are kept
        self.ignored: list[str] = []  # the source's copies of buffers the model recomputes (older checkpoints)
        self.emptied: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
        self.bytes_read = 0
        self.tensors_read = 0
        self.seconds = 0.0  # wall time of the fills (set by the caller, which may fill in several threads)
        self.threads = 1
        self._lock = threading.Lock()
        self._by_model: dict[str, str] | None = None
        names = source.names()
        if names is not None:
            self._by_model = {}
            for n in names:
                target = rename(n) if rename is not None else n
                if target is not None:
                    self._by_model.setdefault(target, n)

    # -- before anything is placed --------------------------------------------------------------------------
    def resolve_buffers(self, model: nn.Module) -> None:
        """Give the non-persistent buffers on the meta device values (:func:`buffers.resolve`)."""
        self.fix = buffers.BufferFix()  # filled as it goes: a resolve that raises part way is undone with it
        buffers.resolve(model, self.source, self.staging, self.fix, self.rename)

    def set_window(self, weight_bytes: int, explicit: int | None) -> None:
        """Size the staging buffer for ``weight_bytes`` of weights."""
        self.staging = Staging(staging_window(weight_bytes, explicit))

    def match(self, slots: list[Slot], entries: list[Entry]) -> None:
        """Decide how every slot is filled; collect missing, unexpected and mis-shaped tensors."""
        listed = self._by_model
        used: set[str] = set()
        for e in entries:  # empty meta tensors get empty host tensors (no slot holds them), if the source agrees
            if e.is_meta and e.tensor.numel() == 0:
                src = next((listed[n] for n in e.names if n in listed), None) if listed is not None else None
                if src is not None:
                    used.add(src)
                    info = self.source.info(src)
                    if info is not None and tuple(info.shape) != tuple(e.size):
                        self.misshaped.append(f"{e.names[0]}: source {list(info.shape)}, model {list(e.size)}")
                self._replace_empty(e)
        for slot in slots:
            plan: list[tuple[str, str | None]] = []
            for e in slot.entries:
                src = next((listed[n] for n in e.names if n in listed), None) if listed is not None else None
                if not e.is_meta and not e.persistent:  # computed by the model's code, not part of a checkpoint
                    plan.append(("model", None))
                    if src is not None:
                        used.add(src)
                elif src is not None:
                    info = self.source.info(src)
                    if info is not None and info.shape != e.size:
                        self.misshaped.append(f"{e.names[0]}: source {list(info.shape)}, model {list(e.size)}")
                    used.add(src)
                    plan.append(("source", src))
                elif not e.is_meta:
                    plan.append(("model", None))
                    if listed is not None and e.persistent:
                        self.kept.append(e.names[0])
                elif listed is None:
                    plan.append(("call", None))
                else:
                    self.missing.append(e.names[0])
                    plan.append(("zeros", None))
            if any(kind != "model" for kind, _ in plan):
                self.plans[id(slot)] = plan
        if listed is not None:
            model_names = {n for e in entries for n in e.names} | set(self.fix.how)
            # an older checkpoint may hold a non-persistent buffer under its old place (transformers' per-layer
            # rotary_emb.inv_freq): recomputed here, so not unexpected
            tails = {".".join(n.split(".")[-2:]) for e in entries if not e.persistent for n in e.names}
            extra = {target: n for target, n in listed.items() if n not in used and target not in model_names}
            self.ignored = sorted(n for target, n in extra.items() if ".".join(target.split(".")[-2:]) in tails)
            self.unexpected = sorted(set(extra.values()) - set(self.ignored))

    def _replace_empty(self, e: Entry) -> None:
        new: torch.Tensor = torch.empty(e.size, dtype=e.tensor.dtype)
        if e.homes and e.homes[0][2]:
            new = nn.Parameter(new, requires_grad=e.tensor.requires_grad)
        for module, attr, is_param in e.homes:
            (module._parameters if is_param else module._buffers)[attr] = new  # type: ignore[assignment]
            self.emptied.append((module, attr, is_param, e.tensor))
        e.tensor = new

    def problems(self) -> str | None:
        """The error text for what does not fit (None when loading may go on); warnings for the rest."""
        parts = []
        if self.fix.unresolved:
            parts.append(
                f"{len(self.fix.unresolved)} non-persistent buffer(s) are on the meta device, are not in the source "
                f"and their modules cannot recompute them: {_show(self.fix.unresolved)}. Give them values before "
                "loading (module.register_buffer(name, tensor, persistent=False)), or build the model with "
                "accelerate's init_empty_weights(), which keeps buffers real")
        if self.misshaped:
            parts.append(f"{len(self.misshaped)} tensor(s) have another shape in the source: {_show(self.misshaped)}")
        if self.strict and self.missing:
            parts.append(f"{len(self.missing)} tensor(s) of the model are not in the source: {_show(self.missing)} "
                         "(a weight tied to another, such as an output embedding, must be the same Parameter before "
                         "loading: for transformers models call model.tie_weights() first)")
        if self.strict and self.unexpected:
            parts.append(f"{len(self.unexpected)} tensor(s) of the source are not in the model: "
                         f"{_show(self.unexpected)}")
        if not parts:
            if self.missing:
                logger.warning("loading with strict=False: %d tensor(s) of the model are not in %s and are "
                               "zero-filled: %s", len(self.missing), self.source.describe(), _show(self.missing))
            if self.unexpected:
                logger.warning("loading with strict=False: %d tensor(s) of %s are not in the model and are skipped: "
                               "%s", len(self.unexpected), self.source.describe(), _show(self.unexpected))
            return None
        fix = ("Check that the checkpoint belongs to this model and configuration; pass rename=... to map the "
               "checkpoint's names onto the model's (e.g. to drop a prefix)")
        if not self.misshaped and not self.fix.unresolved:
            fix += ", or strict=False to zero-fill missing tensors and skip unexpected ones"
        return f"cannot load {self.source.describe()}: " + "; ".join(parts) + f". {fix}. The model was left unchanged."

    # -- per slot ------------------------------------------------------------------------------------------
    def owns(self, slot: Slot) -> bool:
        """True when (part of) the slot's values come from the source (or are zeros), not from the model."""
        return id(slot) in self.plans

    def claim(self, slot: Slot) -> Claim:
        """The slot's claim for sharing across the node's ranks (equal provenance: equal bytes)."""
        tokens: list[Any] = []
        for (kind, src), e in zip(self.plans[id(slot)], slot.entries, strict=True):
            if kind == "model":
                return ("own",)  # a storage partly from the model, partly from the source: rare, never shared
            if kind == "zeros":
                tokens.append(("zeros",))
                continue
            tok = self.source.token(src if src is not None else e.names[0], e.tensor.dtype)
            if tok is None:
                return ("unk",)
            tokens.append(tok)
        return ("tok", hashlib.blake2b(repr((slot.shape_key(), tokens)).encode(), digest_size=16).hexdigest())

    @property
    def parallel(self) -> bool:
        """True when slots may be filled from several threads at once (files; a function declared thread-safe)."""
        return bool(getattr(self.source, "parallel_safe", False))

    def reads_in_place(self, slot: Slot) -> bool:
        """True when every tensor of the slot is read straight into its place by read system calls (contiguous,
        stored in the model's dtype): nothing is stored through the mapping, so a full filesystem fails the read
        (EFAULT) instead of raising SIGBUS, and the slot's pages need no allocation beforehand."""
        plan = self.plans.get(id(slot))
        if plan is None:
            return False
        for (kind, src), e in zip(plan, slot.entries, strict=True):
            if kind != "source" or src is None or e.stride != contiguous_stride(e.size):
                return False
            if not self.source.reads_in_place(src, e.tensor.dtype):
                return False
        return True

    def thread_staging(self, threads: int) -> Staging:
        """A staging buffer for one of ``threads`` filling threads: its share of the window."""
        return Staging(max(STAGING_MIN, self.staging.nbytes // max(1, threads)))

    def fill(self, slot: Slot, buf: torch.Tensor, base: int, fd: int | None = None,
             staging: Staging | None = None) -> int:
        """Write the slot's values at byte ``base`` of the uint8 arena tensor ``buf`` (through ``fd``, the arena's
        file, where the source can: no page faults in this process); return the bytes read. Thread-safe for a
        :attr:`parallel` source, each thread with its own ``fd`` and ``staging``."""
        st = staging if staging is not None else self.staging
        plan = self.plans[id(slot)]
        views = slot.views(buf, base)
        if any(kind == "model" for kind, _ in plan):
            slot.copy_from_model(buf[base: base + slot.nbytes], views)
        n = 0
        start = buf.data_ptr()
        for (kind, src), e, view in zip(plan, slot.entries, views, strict=True):
            sink = (fd, view.data_ptr() - start) if fd is not None and view.is_contiguous() else None
            if kind == "source":
                assert src is not None
                n += self._read(src, view, e, sink, st)
            elif kind == "call":
                n += self._call(e, view, sink, st)
            elif kind == "zeros":
                view.zero_()
        with self._lock:
            self.bytes_read += n
            self.tensors_read += 1
            self.staging.largest = max(self.staging.largest, st.largest)
        return n

    def _write_or_read(self, name: str, view: torch.Tensor, sink: tuple[int, int] | None, st: Staging) -> int:
        """The source's tensor ``name`` into ``view``: through the arena's file (``sink``: fd, offset) where the
        source can, else read into the mapping."""
        if sink is not None:
            done = self.source.write_to(name, view, sink[0], sink[1], st)
            if done is not None:
                return done
        return self.source.read_into(name, view, st)

    def _read(self, src: str, view: torch.Tensor, e: Entry, sink: tuple[int, int] | None, st: Staging) -> int:
        try:
            return self._write_or_read(src, view, sink, st)
        except MissingTensor:
            self.late_missing.append(e.names[0])
        except ShapeMismatch as exc:
            self.late_misshaped.append(f"{e.names[0]}: source {list(exc.got)}, model {list(exc.want)}")
        view.zero_()
        return 0

    def _call(self, e: Entry, view: torch.Tensor, sink: tuple[int, int] | None, st: Staging) -> int:
        """A function source: try the tensor's names in order (tied weights: any of them)."""
        for name in e.names:
            try:
                return self._write_or_read(name, view, sink, st)
            except MissingTensor:
                continue
            except ShapeMismatch as exc:
                self.late_misshaped.append(f"{name}: source {list(exc.got)}, model {list(exc.want)}")
                view.zero_()
                return 0
        self.late_missing.append(e.names[0])
        view.zero_()
        return 0

    def matches(self, slot: Slot, buf: torch.Tensor, base: int) -> bool:
        """True when the copy at ``base`` of ``buf`` (another rank's) holds exactly this rank's values."""
        ok = True
        for (kind, src), e, view in zip(self.plans[id(slot)], slot.entries, slot.views(buf, base), strict=True):
            names = [src] if src is not None else list(e.names)
            if kind == "zeros":
                if view.numel() and bool(view.contiguous().reshape(-1).view(torch.uint8).any()):
                    ok = False
                continue
            for name in names:
                try:
                    ok = self.source.matches(name, view, self.staging) and ok
                    break
                except MissingTensor:
                    continue
                except ShapeMismatch as exc:
                    self.late_misshaped.append(f"{name}: source {list(exc.got)}, model {list(exc.want)}")
                    return False
            else:
                self.late_missing.append(e.names[0])
                return False
        return ok

    def late_problems(self) -> str | None:
        """Missing or mis-shaped tensors found while reading (a function source), as an error text, or None."""
        parts = []
        if self.late_misshaped:
            parts.append(f"{len(self.late_misshaped)} tensor(s) have another shape: {_show(self.late_misshaped)}")
        if self.late_missing and self.strict:
            parts.append(f"the source has no value for {len(self.late_missing)} tensor(s): {_show(self.late_missing)}")
        if not parts:
            if self.late_missing:
                logger.warning("loading with strict=False: %d tensor(s) are not in %s and are zero-filled: %s",
                               len(self.late_missing), self.source.describe(), _show(self.late_missing))
            return None
        return (f"cannot load {self.source.describe()}: " + "; ".join(parts) + ". Return a tensor of the model's "
                "shape for every name (or pass strict=False to zero-fill missing ones). The model was left unchanged.")

    # -- afterwards ----------------------------------------------------------------------------------------
    def undo(self) -> None:
        """Put back the meta tensors this loader replaced (non-persistent buffers, empty tensors)."""
        self.fix.undo()
        for module, attr, is_param, old in reversed(self.emptied):
            (module._parameters if is_param else module._buffers)[attr] = old  # type: ignore[assignment]
        self.emptied.clear()

    def report(self) -> dict[str, Any]:
        """What was read, from where, how fast; what was missing, skipped, kept or recomputed."""
        return {"source": self.source.describe(), "bytes_read": self.bytes_read, "tensors": self.tensors_read,
                "read_seconds": self.seconds, "GBps": self.bytes_read / max(self.seconds, 1e-9) / 1e9,
                "staging_bytes": self.staging.nbytes, "largest_temporary": self.staging.largest,
                "threads": self.threads,
                "missing": self.missing + self.late_missing, "unexpected": self.unexpected, "kept": self.kept,
                "ignored": self.ignored,
                "buffers": dict(self.fix.how), "strict": self.strict}

    def close(self) -> None:
        """Close the source's files and free the staging buffer."""
        self.source.close()
        self.staging.release()


class NoSource:
    """The loader of a materialisation without a weight source: every slot keeps the model's own values.

    It owns no slot, so its per-slot methods are never called (they raise); the calls made around loading do
    nothing. It stands in for :class:`Loader`, so the materialiser never asks whether it has one.
    """

    from_source = False
    parallel = False
    seconds = 0.0
    threads = 1

    def resolve_buffers(self, model: nn.Module) -> None:
        """Nothing to resolve: the model's buffers are its own."""

    def set_window(self, weight_bytes: int, explicit: int | None) -> None:
        """No staging buffer."""

    def match(self, slots: list[Slot], entries: list[Entry]) -> None:
        """Nothing to match."""

    def problems(self) -> str | None:
        """No source, no problem with it."""
        return None

    def late_problems(self) -> str | None:
        """No source, no problem with it."""
        return None

    def owns(self, slot: Slot) -> bool:
        """False: every slot's values come from the model."""
        return False

    def _never(self, slot: Slot) -> NoReturn:
        raise AssertionError(f"no weight source: slot {slot.signature()} is not read from one")

    def claim(self, slot: Slot) -> Claim:
        """Never called (owns no slot)."""
        self._never(slot)

    def reads_in_place(self, slot: Slot) -> bool:
        """Never called (owns no slot)."""
        self._never(slot)

    def thread_staging(self, threads: int) -> Staging:
        """Never called (not :attr:`parallel`)."""
        raise AssertionError("no weight source: nothing is read in threads")

    def fill(self, slot: Slot, buf: torch.Tensor, base: int, fd: int | None = None,
             staging: Staging | None = None) -> int:
        """Never called (owns no slot)."""
        self._never(slot)

    def matches(self, slot: Slot, buf: torch.Tensor, base: int) -> bool:
        """Never called (owns no slot)."""
        self._never(slot)

    def undo(self) -> None:
        """Nothing was replaced."""

    def report(self) -> dict[str, Any]:
        """Nothing was read."""
        return {}

    def close(self) -> None:
        """Nothing to close."""
