"""Bookkeeping every backend's host register/unregister shares: validation, 712 as success, 713 for unknown ranges.

Backend authors wrap their runtime's two calls in a :class:`HostRangeTable` and implement the
``magi_host_register`` / ``magi_host_unregister`` hooks with its methods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from magi_core.errors import HostRegisterError

logger = logging.getLogger(__name__)

SUCCESS = 0
#: "Host memory already registered" on CUDA and MUSA: counts as success.
ALREADY_REGISTERED = 712
#: "Host memory not registered" on CUDA and MUSA.
NOT_REGISTERED = 713


class HostRangeTable:
    """The ranges one backend registered, and the register/unregister calls around its runtime.

    ``HostRangeTable(runtime, register, unregister, error_text=None, clear_error=None)``; each callable wraps one
    runtime call and is called only from :meth:`register` / :meth:`unregister`, under the table's lock:

    * ``runtime`` (``str``): the runtime's name for messages (``"CUDA"``, ``"MUSA"``).
    * ``register(ptr, nbytes)``: pin the range; returns the runtime's error code, ``0`` on success, anything
      ``int()`` accepts (an int, or the binding's error enum, e.g. ``cudaError``). ``712`` (already registered)
      counts as success. A value ``int()`` refuses (None, a string) raises
      :class:`~magi_core.errors.HostRegisterError` saying the callable must return an error code.
    * ``unregister(ptr)``: unpin the range that starts at ``ptr``; returns an error code like ``register``.
      Ranges this table did not register are refused with code ``713`` before it is called.
    * ``error_text(code)`` (optional): the runtime's text for a non-zero code, given the value ``register`` /
      ``unregister`` returned (not its ``int``); when absent or raising, the message says "<runtime> error N".
    * ``clear_error()`` (optional): called once after every non-zero code, to consume the runtime's pending
      per-thread error (``cudaGetLastError``-style), which the next unrelated call would otherwise report as its
      own; its return value is ignored and an exception from it is logged, never raised over the real error.
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
        self._ranges: dict[int, int] = {}

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

    def register(self, ptr: int, nbytes: int) -> None:
        """Pin [ptr, ptr+nbytes) in place; a range already registered (here or by the runtime, 712) is success."""
        if ptr <= 0 or nbytes <= 0:
            raise HostRegisterError(
                f"{self.runtime} host register: invalid range ptr={ptr:#x} nbytes={nbytes}; "
                "pass a tensor's data_ptr() and its size in bytes",
            )
        with self._lock:
            if ptr in self._ranges:
                return
            err = self._register(ptr, nbytes)
            code = self._code(err, "register")
            if code == SUCCESS:
                self._ranges[ptr] = nbytes
                return
            text = self._fail_text(err)
            if code == ALREADY_REGISTERED:
                logger.debug("%s host register(%#x, %d): already registered (712)", self.runtime, ptr, nbytes)
                self._ranges[ptr] = nbytes
                return
        raise HostRegisterError(
            f"{self.runtime} host register(ptr={ptr:#x}, nbytes={nbytes}) failed with error {code}: {text}; check "
            "that the range is ordinary host memory and that `ulimit -l` (memlock) allows pinning it",
            code=code,
        )

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register`; a range this table did not register raises (713, "not registered")."""
        with self._lock:
            if self._ranges.pop(ptr, None) is None:
                raise HostRegisterError(
                    f"{self.runtime} host unregister(ptr={ptr:#x}): this range was not registered through this "
                    f"backend (error {NOT_REGISTERED}, not registered); unregister only what you registered",
                    code=NOT_REGISTERED,
                )
            err = self._unregister(ptr)
            code = self._code(err, "unregister")
            if code == SUCCESS:
                return
            text = self._fail_text(err)
        raise HostRegisterError(
            f"{self.runtime} host unregister(ptr={ptr:#x}) failed with error {code}: {text}", code=code
        )

    def ranges(self) -> dict[int, int]:
        """A copy of the ranges registered now (ptr -> nbytes), for leak checks."""
        with self._lock:
            return dict(self._ranges)
