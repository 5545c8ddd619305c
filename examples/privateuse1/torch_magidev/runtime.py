"""The emulated runtime's host-memory registration: a real table of registered ranges and CUDA's error numbers.

``torch.magidev.runtime()`` returns the bindings a backend calls (as ``torch.cuda.cudart()`` does on CUDA):
``magidevHostRegister(ptr, nbytes, flags)`` and ``magidevHostUnregister(ptr)`` return an error code (0
success, 1 invalid value, 712 already registered: the range overlaps one registered, 713 not registered);
``magidevGetErrorString(code)`` and ``magidevGetLastError()`` (returns and clears the last failure) as in
CUDA. Registration changes nothing about how copies run here, but it is checked as CUDA checks it: a copy
whose host bytes run across a registered range's start or end (from one registration into the next, or out
of one into unregistered memory) fails with "invalid argument" (:meth:`Runtime.check_copy`), so leaks,
double registrations and copies that CUDA would refuse show in tests.
"""

from __future__ import annotations

from torch_magidev._state import LOCK

SUCCESS = 0
ERROR_INVALID_VALUE = 1
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERROR_HOST_MEMORY_NOT_REGISTERED = 713
_TEXT = {
    SUCCESS: "no error",
    ERROR_INVALID_VALUE: "invalid argument",
    ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}


class Runtime:
    """Host-register bindings with a real table of registered ranges (ptr -> nbytes)."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}
        self._last = SUCCESS

    def _fail(self, code: int) -> int:
        self._last = code
        return code

    def magidevHostRegister(self, ptr: int, nbytes: int, flags: int = 0) -> int:  # noqa: N802 - binding name
        """Register ``[ptr, ptr + nbytes)``; 712 when it overlaps a registered range."""
        with LOCK:
            if ptr <= 0 or nbytes <= 0:
                return self._fail(ERROR_INVALID_VALUE)
            for start, size in self._ranges.items():
                if ptr < start + size and start < ptr + nbytes:
                    return self._fail(ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            self._ranges[ptr] = nbytes
            return SUCCESS

    def magidevHostUnregister(self, ptr: int) -> int:  # noqa: N802 - binding name
        """Unregister the range starting at ``ptr``; 713 when none does."""
        with LOCK:
            if self._ranges.pop(ptr, None) is None:
                return self._fail(ERROR_HOST_MEMORY_NOT_REGISTERED)
            return SUCCESS

    def magidevGetErrorString(self, code: int) -> str:  # noqa: N802 - binding name
        """The text of an error code."""
        return _TEXT.get(int(code), f"unknown error {int(code)}")

    def magidevGetLastError(self) -> int:  # noqa: N802 - binding name
        """Return the last error code and reset it to success."""
        with LOCK:
            code, self._last = self._last, SUCCESS
            return code

    def check_copy(self, ptr: int, nbytes: int, what: str) -> None:
        """Raise as CUDA's copy does when host bytes [ptr, ptr+nbytes) lie partly in a registered range."""
        if nbytes <= 0:
            return
        with LOCK:
            for start, size in self._ranges.items():
                inside = start <= ptr and ptr + nbytes <= start + size
                if not inside and ptr < start + size and start < ptr + nbytes:
                    self._last = ERROR_INVALID_VALUE
                    raise RuntimeError(
                        f"magidev error: {_TEXT[ERROR_INVALID_VALUE]} ({what}: host bytes [{ptr:#x}, "
                        f"{ptr + nbytes:#x}) run across the registered range [{start:#x}, {start + size:#x}); "
                        "a copy must lie inside one registration or outside all)"
                    )

    def registered_ranges(self) -> dict[int, int]:
        """Emulation only: the ranges registered now (ptr -> nbytes)."""
        with LOCK:
            return dict(self._ranges)


RUNTIME = Runtime()
