"""The plugin system, and the one import a backend author needs.

Register a backend in your ``pyproject.toml``::

    [project.entry-points."magi.backends"]
    mydev = "my_backend_package"

and implement the hooks of :mod:`magi_core.plugin.spec` with ``@hookimpl`` in that module (the spec documents
each hook's parameters, return value, when magi-core calls it, whether it is required, and ``versionadded``).
Everything a backend uses is importable from here: the ``hookimpl`` marker, :class:`ProbeResult`,
:class:`Capabilities` (spec 1.1), :class:`DeviceMemory` and :class:`FractionCap` (spec 1.2: a process's device
memory, and a cap on it through a torch-style ``set_per_process_memory_fraction``), :class:`HostRangeTable` and the
errors it raises. A conforming synchronous
device module to copy or subclass is :mod:`magi_core.plugin.cpu.device`. Core code reaches the selected backend through
:func:`magi_core.get_backend` (a typed :class:`~magi_core.plugin.facade.Backend` facade, :mod:`.facade`);
discovery and selection live in :mod:`.manager`.
"""

from __future__ import annotations

import pluggy

from magi_core.errors import BackendError, HostRegisterError, MagiError
from magi_core.plugin.device_memory import FractionCap, memory_from_module
from magi_core.plugin.host_ranges import (
    ALREADY_REGISTERED,
    NOT_REGISTERED,
    SUCCESS,
    HostRangeTable,
    loaded_libraries,
)
from magi_core.plugin.spec import (
    DEVICE_MODULE_EXPECTED,
    DEVICE_MODULE_REQUIRED,
    ENTRY_POINT_GROUP,
    HOOKSPEC_VERSION,
    PROJECT,
    REQUIRED_HOOKS,
    Capabilities,
    DeviceMemory,
    ProbeResult,
)

#: Marks a backend's hook implementations (``@hookimpl def magi_probe() -> ProbeResult: ...``).
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = [
    "ALREADY_REGISTERED",
    "DEVICE_MODULE_EXPECTED",
    "DEVICE_MODULE_REQUIRED",
    "ENTRY_POINT_GROUP",
    "HOOKSPEC_VERSION",
    "NOT_REGISTERED",
    "REQUIRED_HOOKS",
    "SUCCESS",
    "BackendError",
    "Capabilities",
    "DeviceMemory",
    "FractionCap",
    "HostRangeTable",
    "HostRegisterError",
    "MagiError",
    "ProbeResult",
    "hookimpl",
    "loaded_libraries",
    "memory_from_module",
]
