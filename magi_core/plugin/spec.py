"""Hook specifications every magi-core backend implements (spec version :data:`HOOKSPEC_VERSION`).

A backend is a module (or object) registered under the entry-point group ``magi.backends``; the
entry point's name is the backend's name. Each backend gets its own pluggy ``PluginManager``, so
every hook below is called on that one backend only; all are ``firstresult``. Implement them with
:data:`magi_core.plugin.hookimpl`. pluggy passes arguments by name: an implementation must use the
parameter names below (it may take fewer). Core code never calls these hooks itself: discovery
(:mod:`.manager`) calls the probe hooks, and the :class:`~magi_core.plugin.facade.Backend` facade binds
the others once when the backend is selected.

Compatibility policy: a new spec version only *adds* optional hooks or optional arguments; a hook
or argument is never removed or re-typed within a major version. Each hook says in
``.. versionadded::`` the spec version it appeared in, and whether it is required or optional (and
the default magi-core uses when an optional hook is absent). Spec 1.1 added :func:`magi_capabilities`
(optional): a backend written against 1.0 keeps working and gets the safe default (eager units, no
direct calls of generated code). Spec 1.2 added :func:`magi_device_memory` and :func:`magi_limit_device_memory`
(optional): without them the device's free memory is read from the device module's ``mem_get_info`` and a cap
on the process's device memory is refused with a clear error.

The device-module contract (what :func:`magi_device_module` returns) is spelled out by
:data:`DEVICE_MODULE_REQUIRED` (selection fails without them) and :data:`DEVICE_MODULE_EXPECTED` (magi-core
calls them; the conformance kit and ``magi backends --check`` report each one missing);
:mod:`magi_core.plugin.cpu.device` is a reference implementation to copy or subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

PROJECT = "magi"
ENTRY_POINT_GROUP = "magi.backends"
"""The entry-point group backends register under; the entry point's name is the backend's name."""
HOOKSPEC_VERSION = "1.2"
"""Version of this hook specification (major.minor). Backends list the majors they support. 1.1 added the
optional :func:`magi_capabilities`; 1.2 the optional :func:`magi_device_memory` and
:func:`magi_limit_device_memory`.
"""
REQUIRED_HOOKS = (
    "magi_probe",
    "magi_hookspec_versions",
    "magi_device_module",
    "magi_host_register",
    "magi_host_unregister",
)
"""Hooks a backend must implement; the rest are optional with documented defaults."""

UNIT_COMPILERS = ("inductor", "eager")
"""The values ``OffloadConfig.unit_compiler`` resolves to (``"auto"`` becomes one of them)."""

DEVICE_MODULE_REQUIRED = ("Stream", "Event", "current_stream", "stream", "synchronize")
"""Device-module attributes selection requires: a module lacking one is refused with a
:class:`~magi_core.errors.BackendError` naming it. ``Stream`` must be a ``torch.Stream`` subclass
(``Tensor.record_stream`` accepts nothing else) and ``Event`` must accept ``enable_timing=True``;
``magi backends --check`` and the conformance kit check both.
"""
DEVICE_MODULE_EXPECTED = {
    "current_device": "Backend.device(): the index of the device offloaded runs use",
    "set_device": "host loading: the thread that pins an arena while it is filled makes the caller's device current "
                  "(without it, on a host with several devices, arenas are pinned after filling)",
    "is_available": "the conformance kit (the device is usable by this process)",
    "device_count": "the conformance kit (at least one device)",
    "is_initialized": "the kit and `magi backends --check`: proves probing and selection did not initialise the device",
    "memory_allocated": "the conformance kit; `magi bench` (device memory in use)",
    "max_memory_allocated": "`magi demo` and `magi bench` (peak device memory of each run)",
    "reset_peak_memory_stats": "`magi demo` and `magi bench` (before each run)",
    "max_memory_reserved": "`magi bench` (peak memory the allocator reserved)",
    "empty_cache": "`magi demo` and `magi bench` (between runs)",
}
"""Further device-module attributes magi-core calls, each with what uses it. A module lacking one still selects
(backends written before this list keep working) but the use named fails; the conformance kit and
``magi backends --check`` report each missing one.
"""

hookspec = pluggy.HookspecMarker(PROJECT)


@dataclass(frozen=True)
class ProbeResult:
    """What a backend's probe reports about its hardware, without initialising the device.

    Returned by :func:`magi_probe`; ``magi backends`` lists it and selection ranks backends by it.

    .. versionadded:: 1.0
    """

    available: bool
    """True when the hardware is present and usable by this process (driver loaded, at least one device
    visible). Only available backends can be selected.
    """
    device_type: str
    """The torch device type string this backend drives (``"cpu"``, ``"musa"``, ...): what
    ``torch.device(device_type)`` accepts and what selection matches against the accelerator torch reports.
    """
    priority: int
    """Selection rank: among available backends the highest priority wins when neither ``use_backend`` nor
    ``MAGI_BACKEND`` names one; two available backends sharing the top priority are an error. The CPU
    backend uses 0, CUDA and MUSA 100.
    """
    version: str
    """Version of the backend's runtime or torch extension (e.g. ``torch_musa.__version__``),
    shown by ``magi backends``; a non-empty string (``"none"`` when there is nothing to report).
    """
    reason: str | None = None
    """When ``available`` is False: why, in words a user can act on ("torch_musa is not installed: pip
    install torch_musa"). None when available.
    """


@dataclass(frozen=True)
class Capabilities:
    """What the backend's device supports, as unit compilation needs to know it, without initialising the device.

    Returned by :func:`magi_capabilities`. The ``Backend`` facade resolves ``OffloadConfig.unit_compiler`` with it
    ("auto" becomes :attr:`default_unit_compiler`; "inductor" where :attr:`inductor` is False is a
    :class:`~magi_core.errors.ConfigError`) and passes the executor direct unit calls only where
    :attr:`direct_unit_calls` allows them. The defaults are the safe answer for a device nothing is known about:
    eager units, no direct calls of generated code. Inconsistent values raise ``ValueError`` when constructed.

    .. versionadded:: 1.1
    """

    inductor: bool = False
    """True when torch's Inductor generates code for this device type that runs on its tensors (a codegen
    backend registered for it in ``torch._inductor.codegen.common``, and its compiler, e.g. Triton, installed).
    False makes ``unit_compiler="inductor"`` a ConfigError naming the backend.
    """
    default_unit_compiler: str = "eager"
    """What ``unit_compiler="auto"`` resolves to: ``"eager"`` (the module's own forward) or ``"inductor"`` (needs
    ``inductor=True``).
    """
    direct_unit_calls: bool = False
    """True when the executor may call a unit's generated Inductor code directly, without the wrapper layers
    (``OffloadConfig.direct_unit_calls``): only where that code was compiled for this device's tensors and its
    call has been checked on the device. Needs ``inductor=True``.
    """
    reason: str | None = None
    """When ``inductor`` is False: why, in words a user can act on ("Triton is not installed: pip install
    triton"); shown by ``magi backends --check`` and in the ConfigError. None when Inductor is available.
    """

    def __post_init__(self) -> None:
        for name in ("inductor", "direct_unit_calls"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Capabilities.{name} must be a bool, got {getattr(self, name)!r}")
        if self.default_unit_compiler not in UNIT_COMPILERS:
            raise ValueError(
                f"Capabilities.default_unit_compiler must be one of {UNIT_COMPILERS}, "
                f"got {self.default_unit_compiler!r}"
            )
        if not self.inductor and self.default_unit_compiler == "inductor":
            raise ValueError("Capabilities(default_unit_compiler='inductor') needs inductor=True")
        if not self.inductor and self.direct_unit_calls:
            raise ValueError("Capabilities(direct_unit_calls=True) needs inductor=True (they call Inductor code)")
        if self.reason is not None and not isinstance(self.reason, str):
            raise TypeError(f"Capabilities.reason must be a str or None, got {self.reason!r}")


@dataclass(frozen=True)
class DeviceMemory:
    """Device memory as this process sees it: what it can still allocate, and the capacity it may use.

    Returned by :func:`magi_device_memory` and ``Backend.device_memory()``; the planner takes a default device budget
    from it. Both fields are whole bytes with ``0 <= free <= total``; anything else raises ``ValueError`` (or
    ``TypeError``) when constructed.

    .. versionadded:: 1.2
    """

    free: int
    """Bytes this process can still allocate on the device: the device's free bytes plus what torch's caching
    allocator holds reserved but unused, limited by any cap set on the process (``cap - allocated``).
    """
    total: int
    """The capacity this process sees: the device's total memory, or the cap when one is set
    (:func:`magi_limit_device_memory`).
    """

    def __post_init__(self) -> None:
        for name in ("free", "total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DeviceMemory.{name} must be an int (bytes), got {value!r}")
        if not 0 <= self.free <= self.total:
            raise ValueError(f"DeviceMemory needs 0 <= free <= total, got free={self.free}, total={self.total}")


@hookspec(firstresult=True)
def magi_probe() -> ProbeResult:
    """Report whether this backend's hardware is present, cheaply and without initialising the device.

    Called once, at discovery (the first :func:`magi_core.get_backend`, :func:`magi_core.list_backends` or
    ``magi backends`` of a process), for every installed backend that loaded, implements every required hook
    and lists a compatible spec major in :func:`magi_hookspec_versions` (which is called first), whether or
    not it will be selected. So it must not initialise the device: no context creation, no allocation,
    no runtime call that initialises the driver (``device_count()`` only where it does not); a process must
    be able to probe, fork, and use the device in the child. Importing the vendor's torch extension is fine
    where that import changes nothing for other backends; one that takes torch's PrivateUse1 slot on import is
    looked for with ``importlib.util.find_spec`` and imported in :func:`magi_device_module` instead.

    Required. When it raises, or returns anything but a :class:`ProbeResult`, the backend is refused: the
    exception is logged and listed by ``magi backends``, never swallowed.

    :returns: a :class:`ProbeResult`: ``available``, ``device_type``, ``priority``, ``version`` and, when
        unavailable, the ``reason``.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_hookspec_versions() -> Sequence[str]:
    """Return the hook-spec major versions this backend implements, e.g. ``("1",)``.

    Called at discovery, before :func:`magi_probe`, for every installed backend that loaded and implements
    every required hook. Only the major part of each entry counts (``"1.0"`` reads as ``"1"``).

    Required. A backend listing no major equal to :data:`HOOKSPEC_VERSION`'s is refused and not probed,
    with a message naming both versions; a bare string or None is refused as a type error.

    :returns: a sequence of version strings (a tuple or list, not a bare ``str``).

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_device_module() -> ModuleType:
    """Return the backend's torch-style device module, as ``torch.get_device_module(device_type)`` gives it.

    Called once, when the backend is selected (the first :func:`magi_core.get_backend` or a
    :func:`magi_core.use_backend`), and by ``magi backends --check``; never at discovery. It may import the vendor's
    torch extension, but neither it nor selection may initialise the device (no context, stream or allocation:
    the executor creates streams and events when a model is compiled). The facade binds the module as
    ``Backend.device_module``, and core code reaches streams, events and memory statistics only through it.

    Required. The contract (the backend author's guide, ``docs/backends/writing.md``, "The device-module contract",
    says what each attribute must do):
    :data:`DEVICE_MODULE_REQUIRED` (``Stream``, ``Event``, ``current_stream``, ``stream``, ``synchronize``), or
    selection fails with a :class:`~magi_core.errors.BackendError` naming the missing ones; and
    :data:`DEVICE_MODULE_EXPECTED` (``current_device``, ``is_available``, ``device_count``, ``is_initialized``,
    memory statistics, ``empty_cache``). ``Stream`` must be a ``torch.Stream`` subclass (``Tensor.record_stream``
    takes nothing else) and ``Event(enable_timing=True)`` must time in milliseconds (``elapsed_time``). The
    conformance kit and ``magi backends --check`` report every departure; ``magi bench`` also reads
    ``get_device_name`` where present.
    ``torch.cpu`` does not conform (no timing events, no memory statistics, its ``Stream`` is no ``torch.Stream``):
    :mod:`magi_core.plugin.cpu.device` is a conforming synchronous module to copy or subclass.

    :returns: the device module (``torch.<device_type>``; for the CPU backend
        :mod:`magi_core.plugin.cpu.device`).

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_host_register(ptr: int, nbytes: int) -> None:
    """Pin the existing host range ``[ptr, ptr + nbytes)`` in place (page-lock it without copying).

    Called through ``Backend.host_register`` by host materialisation when it pins the weight arenas
    (:mod:`magi_core.host.pinning`: a whole arena, a prefix of one under a pin budget, or pieces of one from a
    loading thread while it is filled), and by the host-to-device bandwidth probe for its buffer. It may be
    called from any thread and from several at once (a loading thread; two models materialised concurrently):
    keep it thread-safe, as :class:`~magi_core.plugin.HostRangeTable` is.
    Use this backend's own runtime only (never another vendor's, even when installed).

    Required. A range that is already registered (error 712 on CUDA and MUSA) counts as success; an invalid
    range (``ptr`` or ``nbytes`` not positive) and any other failure raise
    :class:`~magi_core.errors.HostRegisterError` carrying the runtime's own error text and code.
    Materialisation then stops pinning, logs the error with the memlock limit and leaves the rest pageable.
    magi-core never issues one copy whose host bytes run across a registered range's bound (CUDA refuses such a
    copy): the facade records every range registered through it and splits copies there, so a runtime with the same
    rule needs nothing more.

    :param ptr: address of the first byte, a host virtual address as ``Tensor.data_ptr()`` gives it.
    :param nbytes: length of the range in bytes (> 0).
    :returns: None; success is returning, failure raises.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_host_unregister(ptr: int) -> None:
    """Undo :func:`magi_host_register` for the range that starts at ``ptr``.

    Called through ``Backend.host_unregister`` before the memory is freed or unmapped: when host weights
    are released (explicitly, or by a finalizer once the model is garbage-collected, on whichever thread
    drops it) and after the bandwidth probe. Like register, it may be called from several threads.

    Required. A range this backend did not register raises
    :class:`~magi_core.errors.HostRegisterError` (713, "not registered", on CUDA and MUSA); so does a
    failure of the runtime. On release every range is attempted and the errors are logged.

    :param ptr: the address a successful :func:`magi_host_register` call was given.
    :returns: None; success is returning, failure raises.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_range_push(name: str) -> None:
    """Open a named profiling range (NVTX on CUDA, ``record_function`` spans on MUSA).

    Called before every executed unit of every step, in the executor's hot loop (and around the
    bandwidth probe). It is bound once: the facade resolves it when the backend is selected and the
    executor takes it when it is built (``Backend.range_fns()``). A single plain implementation is then
    called directly and positionally, not through pluggy (with ``MAGI_TRACE_HOOKS=1``, or several
    implementations, calls go through pluggy), so keep it cheap. It is never called inside compiled
    regions: the executor runs outside them and ``Backend.range_push`` is a no-op while ``torch.compile``
    traces.

    Optional; default: no-op. Implement it together with :func:`magi_range_pop`: the executor uses
    no-ops unless both are present.

    :param name: the range's label, e.g. ``"magi.unit3:block3"`` (unit index and label) or
        ``"magi.h2d_probe"``.
    :returns: None.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_range_pop() -> None:
    """Close the innermost profiling range opened by :func:`magi_range_push` on this thread.

    Called as :func:`magi_range_push` is (bound once, once per executed unit, never inside compiled
    regions), after the unit returns; pushes and pops balance, and ``Backend.range(name)`` pairs them.

    Optional; default: no-op (implement it together with :func:`magi_range_push`).

    :returns: None.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_to_method_aliases() -> Sequence[str]:
    """Return the method names under which ``Tensor.to`` appears in traced graphs, ``"to"`` included.

    Called once, when the backend is selected (with :func:`magi_device_module`); the facade keeps the
    result as ``Backend.to_method_aliases``, and the device-placement pass reads it once per compiled graph
    to rewrite every ``call_method`` node (and ``Tensor.<alias>`` call) named by an alias. torch_musa wraps
    ``Tensor.to`` and Dynamo then records ``orig_to``: the MUSA backend returns ``("to", "orig_to")``.

    Optional; default: ``("to",)`` (also used when it returns an empty sequence). A result without ``"to"``
    makes selection fail with a :class:`~magi_core.errors.BackendError`; each alias must be a
    ``torch.Tensor`` method (the conformance kit checks it).

    :returns: a sequence of method names.

    .. versionadded:: 1.0
    """


@hookspec(firstresult=True)
def magi_capabilities() -> Capabilities:
    """Say what the device supports for unit compilation: Inductor, the default unit compiler, direct unit calls.

    Called once, when the backend is selected (with :func:`magi_device_module`), and by ``magi backends --check``;
    never at discovery. Like the probe it must not initialise the device: decide from what is installed (the
    vendor extension's Inductor backend, ``importlib.util.find_spec("triton")``), not from the device itself.
    The facade keeps the result as ``Backend.capabilities``: ``unit_compiler="auto"`` resolves to
    ``default_unit_compiler``; an explicit ``"inductor"`` where ``inductor`` is False raises a ConfigError naming
    the backend and the fix (``unit_compiler="eager"``); the executor calls generated unit code directly only
    when ``direct_unit_calls`` is True *and* ``OffloadConfig.direct_unit_calls`` asks for it.

    Optional; default: ``Capabilities()`` (eager units, no direct calls), except that where torch's Inductor
    has a code generator registered for the backend's device type (``torch._inductor.codegen.common``: built in
    for CUDA, registered by extensions such as torch_musa) Inductor counts as available, and "auto" picks it on
    accelerators (never on the ``"cpu"`` device type); direct calls stay off. A result that is not a
    :class:`Capabilities` makes selection fail with a :class:`~magi_core.errors.BackendError`.

    :returns: a :class:`Capabilities`.

    .. versionadded:: 1.1
    """


@hookspec(firstresult=True)
def magi_device_memory(device_index: int) -> DeviceMemory | None:
    """Report how much device memory this process can still allocate on device ``device_index``, and its capacity.

    Called through ``Backend.device_memory(device)``: by the planner for a default device budget when a model's
    plan is made, by ``magi_core.limit_device_memory`` for a size given as a percentage, and by ``magi bench`` when
    it records a run's device. It may initialise the device (it asks the runtime), so it is never called at
    discovery or selection.

    Optional; default: computed from the device module: ``free, total = mem_get_info(device_index)``, plus
    ``memory_reserved(device_index) - memory_allocated(device_index)`` (cached by torch's allocator, reusable by
    this process) where the module has both, free capped at total; None where the module has no ``mem_get_info``
    or its call raises, and on the host (device type ``"cpu"``). A backend that caps the process
    (:func:`magi_limit_device_memory`) implements this hook too, so that the cap shows: free is at most
    ``cap - allocated`` and total is the cap. A result that is neither a :class:`DeviceMemory` nor None raises
    :class:`~magi_core.errors.BackendError`.

    :param device_index: the device's index (``torch.device(device_type, device_index)``).
    :returns: a :class:`DeviceMemory` (``free``, ``total``), or None when the backend cannot tell (the CPU backend:
        host memory is no device budget).

    .. versionadded:: 1.2
    """


@hookspec(firstresult=True)
def magi_limit_device_memory(device_index: int, nbytes: int) -> None:
    """Cap this process's allocations on device ``device_index`` at ``nbytes``, to emulate a smaller card.

    Called through ``Backend.limit_device_memory(nbytes, device)`` by :func:`magi_core.limit_device_memory`,
    ``magi bench --device-memory`` and ``MAGI_DEVICE_MEMORY``, before the process allocates on the device. Past the
    cap an allocation must fail with the device's own out-of-memory error (``torch.OutOfMemoryError`` where the
    allocator raises it), as on a card of that size; :func:`magi_device_memory` then reports ``total == nbytes``.
    A cap at the device's total lifts it; a cap above it raises :class:`~magi_core.errors.BackendError`. CUDA and MUSA
    set their allocator's ``set_per_process_memory_fraction(nbytes / total, device_index)``
    (:class:`magi_core.plugin.FractionCap`).

    Optional; default: none, refused: ``Backend.limit_device_memory`` raises
    :class:`~magi_core.errors.BackendError` saying the backend cannot cap device memory.

    :param device_index: the device's index.
    :param nbytes: the cap in bytes (> 0).
    :returns: None; success is returning, failure raises.

    .. versionadded:: 1.2
    """


__all__ = [
    "DEVICE_MODULE_EXPECTED",
    "DEVICE_MODULE_REQUIRED",
    "ENTRY_POINT_GROUP",
    "HOOKSPEC_VERSION",
    "PROJECT",
    "REQUIRED_HOOKS",
    "UNIT_COMPILERS",
    "Capabilities",
    "DeviceMemory",
    "ProbeResult",
    "hookspec",
]
