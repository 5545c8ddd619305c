"""Hook specifications every magi-core backend implements (spec version :data:`HOOKSPEC_VERSION`).

A backend is a module (or object) registered under the entry-point group ``magi.backends``; the
entry point's name is the backend's name. Each hook below is called on that one backend only.
Compatibility policy: a new spec version only *adds* optional hooks or optional arguments; a hook
or argument is never removed or re-typed within a major version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import pluggy

PROJECT = "magi"
#: The entry-point group backends register under; the entry point's name is the backend's name.
ENTRY_POINT_GROUP = "magi.backends"
#: Version of this hook specification (major.minor). Backends list the majors they support.
HOOKSPEC_VERSION = "1.0"
#: Hooks a backend must implement; the rest are optional with documented defaults.
REQUIRED_HOOKS = (
    "magi_probe",
    "magi_hookspec_versions",
    "magi_device_module",
    "magi_host_register",
    "magi_host_unregister",
)

hookspec = pluggy.HookspecMarker(PROJECT)


@dataclass(frozen=True)
class ProbeResult:
    """What a backend's probe reports about its hardware, without initialising the device."""

    available: bool
    device_type: str
    priority: int
    version: str
    reason: str | None = None


@hookspec(firstresult=True)
def magi_probe() -> ProbeResult:
    """Report presence, device type, priority and version, cheaply and without initialising the device."""


@hookspec(firstresult=True)
def magi_hookspec_versions() -> Sequence[str]:
    """Return the hook-spec major versions this backend supports, e.g. ``("1",)``."""


@hookspec(firstresult=True)
def magi_device_module() -> ModuleType:
    """Return the torch-style device module (Stream, Event, current_stream, stream, synchronize, memory stats)."""


@hookspec(firstresult=True)
def magi_host_register(ptr: int, nbytes: int) -> None:
    """Pin the existing host range [ptr, ptr+nbytes) in place; "already registered" is success, other errors raise."""


@hookspec(firstresult=True)
def magi_host_unregister(ptr: int) -> None:
    """Undo :func:`magi_host_register` for the range starting at ptr; an unknown range raises."""


@hookspec(firstresult=True)
def magi_range_push(name: str) -> None:
    """Open a named profiling range (optional; default: no-op)."""


@hookspec(firstresult=True)
def magi_range_pop() -> None:
    """Close the innermost profiling range (optional; default: no-op)."""


@hookspec(firstresult=True)
def magi_to_method_aliases() -> Sequence[str]:
    """Return the method names under which ``Tensor.to`` appears in traced graphs (optional; default ``("to",)``)."""


__all__ = ["ENTRY_POINT_GROUP", "HOOKSPEC_VERSION", "PROJECT", "REQUIRED_HOOKS", "ProbeResult", "hookspec"]
