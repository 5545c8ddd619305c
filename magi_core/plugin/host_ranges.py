"""Bookkeeping every backend's host register/unregister shares: validation, 712 as success, who owns a range.

Backend authors wrap their runtime's two calls in a :class:`HostRangeTable` and implement the
``magi_host_register`` / ``magi_host_unregister`` hooks with its methods.

Ownership: a range is unregistered through the runtime only if this table registered it. A range the runtime
answers "already registered" (712) for was pinned by someone else (torch's pinned-memory allocator, another
library, or partly by a range this table holds): the table accepts it, and on unregister forgets it without
calling the runtime, so the other registration stays. A sub-range of a range the table holds is covered by
it: accepted and forgotten without any runtime call (the runtime would answer 712, then 713).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from magi_core.errors import HostRegisterError

logger = logging.getLogger(__name__)

SUCCESS = 0
#: "Host memory already registered" on CUDA and MUSA: counts as success.
ALREADY_REGISTERED = 712
#: "Host memory not registered" on CUDA and MUSA.
NOT_REGISTERED = 713

#: How the table came to hold a range: it registered it with the runtime (``"registered"``), the runtime
#: answered 712 (``"found"``: registered by someone else first), or it lies inside a range the table holds
#: (``"covered"``).
Origin = Literal["registered", "found", "covered"]


@dataclass
class _Held:
    nbytes: int
    origin: Origin
    #: For ``"covered"``: the start of the held range that covers it (None once that range is unregistered).
    parent: int | None = None

    def contains(self, start: int, ptr: int, nbytes: int) -> bool:
        return start <= ptr and ptr + nbytes <= start + self.nbytes


class HostRangeTable:
    """The ranges one backend holds, and the register/unregister calls around its runtime.

    ``HostRangeTable(runtime, register, unregister, error_text=None, clear_error=None)``; each callable wraps one
    runtime call and is called only from :meth:`register` / :meth:`unregister`, under the table's lock:

    * ``runtime`` (``str``): the runtime's name for messages (``"CUDA"``, ``"MUSA"``).
    * ``register(ptr, nbytes)``: pin the range; returns the runtime's error code, ``0`` on success, anything
      ``int()`` accepts (an int, or the binding's error enum, e.g. ``cudaError``). ``712`` (already registered)
      counts as success, but the range is then *found*, not owned: see :meth:`unregister`. A value ``int()``
      refuses (None, a string) raises :class:`~magi_core.errors.HostRegisterError` saying the callable must
      return an error code. Not called for a range that lies inside one the table holds.
    * ``unregister(ptr)``: unpin the range that starts at ``ptr``; returns an error code like ``register``.
      Called only for ranges this table registered itself (``register`` returned 0); ranges it does not hold
      are refused with code ``713`` before any call.
    * ``error_text(code)`` (optional): the runtime's text for a non-zero code, given the value ``register`` /
      ``unregister`` returned (not its ``int``); when absent or raising, the message says "<runtime> error N".
    * ``clear_error()`` (optional): called once after every non-zero code, 712 included, to consume the
      runtime's pending per-thread error (``cudaGetLastError``-style), which the next kernel launch would
      otherwise report as its own; its return value is ignored and an exception from it is logged, never raised
      over the real error.

    Ownership rules (:meth:`register`, :meth:`unregister`): only what the table registered is unregistered
    through the runtime; a range found registered (712) is forgotten on unregister, leaving the other party's
    registration in place; a sub-range of a held range is covered by it and never unregistered alone.
    """

    def __init__(
        self,
        runtime: str,
        register: Callable[[int, int], Any],
        unregister: Callable[[int], Any],
        error_text: Callable[[Any], str] | None = None,
        clear_error: Callable[[], object] | None = None,
    ) -> None:
        self.runtime = runtime
        self._register = register
        self._unregister = unregister
        self._error_text = error_text
        self._clear_error = clear_error
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}

    def _code(self, err: Any, call: str) -> int:
        """``int(err)``, or a HostRegisterError saying the ``call`` callable must return an error code."""
        try:
            return int(err)
        except (TypeError, ValueError) as exc:
            raise HostRegisterError(
                f"{self.runtime} host {call}: the table's {call} callable returned {err!r} ({type(err).__name__}), "
                f"not an error code; HostRangeTable's register/unregister callables must return the runtime's "
                "error code (0 on success; an int or an enum int() accepts), e.g. `lambda ptr, nbytes: "
                "rt.HostRegister(ptr, nbytes, 0)` without discarding its result"
            ) from exc

    def _fail_text(self, err: Any) -> str:
        text = f"{self.runtime} error {int(err)}"
        if self._error_text is not None:
            try:
                text = str(self._error_text(err))
            except Exception:  # a binding without error strings: keep the number
                pass
        if self._clear_error is not None:
            try:
                self._clear_error()
            except Exception as exc:  # never hide the real error behind the clean-up's
                logger.warning("%s: clear_error() raised %s: %s (ignored)", self.runtime, type(exc).__name__, exc)
        return text

    def _parent_of(self, ptr: int, nbytes: int) -> int | None:
        """The start of a registered or found range holding all of [ptr, ptr+nbytes), or None."""
        for start, held in self._held.items():
            if held.origin != "covered" and held.contains(start, ptr, nbytes):
                return start
        return None

    def register(self, ptr: int, nbytes: int) -> None:
        """Pin [ptr, ptr+nbytes) in place; a range held, inside a held one, or already registered (712) is success.

        A range starting where a held one starts is that range (no call). A range inside a held one is *covered*:
        recorded without a runtime call. Anything else goes to the runtime: 0 makes it this table's own range;
        712 (registered by someone else, or overlapping a held range) makes it a *found* range; any other code
        raises :class:`~magi_core.errors.HostRegisterError` with the runtime's text.
        """
        if ptr <= 0 or nbytes <= 0:
            raise HostRegisterError(
                f"{self.runtime} host register: invalid range ptr={ptr:#x} nbytes={nbytes}; "
                "pass a tensor's data_ptr() and its size in bytes",
            )
        with self._lock:
            held = self._held.get(ptr)
            if held is not None and not (held.origin == "covered" and held.parent is None):
                return
            parent = self._parent_of(ptr, nbytes)
            if parent is not None:
                logger.debug("%s host register(%#x, %d): inside the held range at %#x; covered by it, no runtime "
                             "call", self.runtime, ptr, nbytes, parent)
                self._held[ptr] = _Held(nbytes, "covered", parent)
                return
            err = self._register(ptr, nbytes)
            code = self._code(err, "register")
            if code == SUCCESS:
                self._held[ptr] = _Held(nbytes, "registered")
                return
            text = self._fail_text(err)
            if code == ALREADY_REGISTERED:
                logger.debug("%s host register(%#x, %d): already registered, at least in part, by someone else "
                             "(712); accepted, and left to them on unregister", self.runtime, ptr, nbytes)
                self._held[ptr] = _Held(nbytes, "found")
                return
        raise HostRegisterError(
            f"{self.runtime} host register(ptr={ptr:#x}, nbytes={nbytes}) failed with error {code}: {text}; check "
            "that the range is ordinary host memory and that `ulimit -l` (memlock) allows pinning it",
            code=code,
        )

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register`; a range this table does not hold raises (713, "not registered").

        Only a range this table registered is unregistered through the runtime. A found range (712) is forgotten,
        leaving whoever registered it registered; a covered sub-range is forgotten (its parent covers it). When a
        registered range goes, the sub-ranges it covered stay held until unregistered themselves, uncovered (not
        pinned any more); registering one of them again then goes through the rules above afresh.
        """
        with self._lock:
            held = self._held.pop(ptr, None)
            if held is None:
                raise HostRegisterError(
                    f"{self.runtime} host unregister(ptr={ptr:#x}): this range was not registered through this "
                    f"backend (error {NOT_REGISTERED}, not registered); unregister only what you registered",
                    code=NOT_REGISTERED,
                )
            if held.origin != "covered":
                self._uncover(ptr)
            if held.origin == "found":
                logger.debug("%s host unregister(%#x): registered by someone else before us (712); forgotten, "
                             "their registration stays", self.runtime, ptr)
                return
            if held.origin == "covered":
                logger.debug("%s host unregister(%#x): a sub-range covered by the range at %s; forgotten, no "
                             "runtime call", self.runtime, ptr,
                             "(already unregistered)" if held.parent is None else f"{held.parent:#x}")
                return
            err = self._unregister(ptr)
            code = self._code(err, "unregister")
            if code == SUCCESS:
                return
            text = self._fail_text(err)
        raise HostRegisterError(
            f"{self.runtime} host unregister(ptr={ptr:#x}) failed with error {code}: {text}", code=code
        )

    def _uncover(self, parent: int) -> None:
        """The held range at ``parent`` is gone: its covered sub-ranges move to another holder, or none."""
        for start, held in self._held.items():
            if held.origin == "covered" and held.parent == parent:
                held.parent = self._parent_of(start, held.nbytes)

    def ranges(self) -> dict[int, int]:
        """A copy of every range held now (ptr -> nbytes), however it is held: each needs one unregister."""
        with self._lock:
            return {ptr: held.nbytes for ptr, held in self._held.items()}

    def origins(self) -> dict[int, Origin]:
        """How each held range is held (ptr -> ``"registered"``, ``"found"`` or ``"covered"``)."""
        with self._lock:
            return {ptr: held.origin for ptr, held in self._held.items()}


def loaded_libraries(prefix: str) -> list[Any]:
    """``ctypes`` handles to every shared library whose file name starts with ``prefix`` and that this process
    has already mapped (read from ``/proc/self/maps``, opened with ``RTLD_NOLOAD``: nothing is loaded anew).

    For a backend's ``clear_error``: the runtime's ``...GetLastError`` must be called on the runtime instance
    torch loaded, never on a second copy (which would have its own pending errors) nor on another vendor's.
    """
    import ctypes
    import os

    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip().removesuffix(" (deleted)")
                if os.path.basename(path).startswith(prefix) and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    handles: list[Any] = []
    seen: set[int] = set()
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        if lib._handle not in seen:
            seen.add(lib._handle)
            handles.append(lib)
    return handles
