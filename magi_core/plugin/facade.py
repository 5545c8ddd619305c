"""The typed facade core code uses to talk to the active backend, resolved once."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from magi_core.errors import BackendError, ConfigError, MagiError
from magi_core.plugin.device_memory import memory_from_module
from magi_core.plugin.registered import REGISTERED, RegisteredRanges
from magi_core.plugin.spec import UNIT_COMPILERS, Capabilities, DeviceMemory

logger = logging.getLogger(__name__)


def inductor_registered(device_type: str) -> bool:
    """True when torch's Inductor has a code generator registered for ``device_type``.

    Reads Inductor's registry (``torch._inductor.codegen.common``) after its own ``init_backend_registration``,
    which registers the built-in device types and a PrivateUse1 device module's ``Scheduling`` /
    ``PythonWrapperCodegen`` where it has them; extensions such as torch_musa register theirs. It imports Inductor's
    code generators (a few seconds the first time) and initialises no device.
    """
    try:
        from torch._inductor.codegen import common
    except Exception as exc:  # a torch build without Inductor
        logger.debug("torch's Inductor is not importable: %s", exc)
        return False
    try:
        common.init_backend_registration()
    except Exception as exc:  # a vendor's registration hook failing: what is registered still counts
        logger.debug("Inductor backend registration raised %s: %s", type(exc).__name__, exc)
    return common.get_scheduling_for_device(device_type) is not None


def default_capabilities(device_type: str) -> Capabilities:
    """The capabilities of a backend without ``magi_capabilities`` (written against spec 1.0).

    Eager units and no direct calls, except that where Inductor has a code generator registered for the device
    type (:func:`inductor_registered`) Inductor counts as available and "auto" picks it on an accelerator (the
    ``"cpu"`` device type keeps eager, as before spec 1.1). Direct calls of generated code stay off: a backend
    opts into them by declaring them.
    """
    if not inductor_registered(device_type):
        return Capabilities(
            reason=f"torch's Inductor has no code generator registered for device type {device_type!r} and the "
            "backend does not declare one (magi_capabilities, spec 1.1)"
        )
    return Capabilities(inductor=True, default_unit_compiler="eager" if device_type == "cpu" else "inductor")


def _no_binding() -> None:
    """Nothing to make current (the host backend, or a single device)."""


@dataclass(frozen=True)
class Backend:
    """The active backend: device type, device module, host register/unregister, ranges, aliases, capabilities,
    device memory (what the process can still allocate, and a cap on it)."""

    name: str
    """The backend's name: its entry point's name in the ``magi.backends`` group (``"musa"``, ``"cpu"``, ...)."""
    package: str
    """The distribution that provides the backend (``magi-backend-musa``, ...)."""
    version: str
    """What the backend's probe reports as its runtime's version (``ProbeResult.version``)."""
    device_type: str
    """The torch device type the backend drives (``"musa"``, ``"cpu"``, ...)."""
    priority: int
    """The probe's selection rank (``ProbeResult.priority``)."""
    selected_by: str
    """How the backend was chosen: ``"explicit"`` (:func:`magi_core.use_backend`), ``"env"`` (``MAGI_BACKEND``)
    or ``"probe"`` (the highest priority among the available backends)."""
    device_module: ModuleType = field(repr=False)
    """The backend's torch-style device module (``magi_device_module``): streams, events, memory statistics."""
    to_method_aliases: tuple[str, ...]
    """The method names under which ``Tensor.to`` appears in traced graphs, ``"to"`` included
    (``magi_to_method_aliases``)."""
    _register: Callable[[int, int], Any] = field(repr=False)
    _unregister: Callable[[int], Any] = field(repr=False)
    _range_push: Callable[[str], Any] | None = field(repr=False)
    _range_pop: Callable[[], Any] | None = field(repr=False)
    package_version: str = "?"
    """The backend package's version (``package`` is its distribution name)."""
    hookspec_versions: tuple[str, ...] = ()
    """The hook-spec versions the backend declared (``magi_hookspec_versions``)."""
    declared_capabilities: Capabilities | None = field(default=None, repr=False)
    """What ``magi_capabilities`` returned, or None when the backend does not implement it (spec 1.0)."""
    _device_memory: Callable[[int], Any] | None = field(default=None, repr=False)
    """``magi_device_memory`` bound to this backend (device index -> DeviceMemory | None); None when not
    implemented."""
    _limit_device_memory: Callable[[int, int], Any] | None = field(default=None, repr=False)
    """``magi_limit_device_memory`` bound to this backend (device index, bytes); None when not implemented."""

    def __repr__(self) -> str:
        return (
            f"Backend(name={self.name!r}, device_type={self.device_type!r}, package='{self.package} "
            f"{self.package_version}', version={self.version!r}, hookspec={','.join(self.hookspec_versions) or '?'}, "
            f"priority={self.priority}, selected_by={self.selected_by!r})"
        )

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """What the device supports for unit compilation: declared by the backend, else :func:`default_capabilities`."""
        if self.declared_capabilities is not None:
            return self.declared_capabilities
        return default_capabilities(self.device_type)

    def resolve_unit_compiler(self, requested: str) -> str:
        """``OffloadConfig.unit_compiler`` for this backend: ``"inductor"`` or ``"eager"`` (raises ConfigError).

        ``"auto"`` becomes the backend's default; ``"inductor"`` where the backend says Inductor cannot compile
        for its device is refused, naming the backend and the fix, instead of generating code for another device.
        """
        caps = self.capabilities
        if requested == "auto":
            return caps.default_unit_compiler
        if requested not in UNIT_COMPILERS:
            raise ConfigError(f"unit_compiler must be 'auto', 'inductor' or 'eager', got {requested!r}")
        if requested == "inductor" and not caps.inductor:
            why = caps.reason or f"it says torch's Inductor cannot compile for device type {self.device_type!r}"
            raise ConfigError(
                f"unit_compiler='inductor' cannot run on backend {self.name!r} ({self.package}): {why}. Use "
                f"unit_compiler='eager' (or 'auto', which picks {caps.default_unit_compiler!r} here)"
            )
        return requested

    def allows_direct_unit_calls(self, requested: bool) -> bool:
        """Whether the executor may call generated unit code directly: ``requested`` and the backend allows it."""
        return bool(requested) and self.capabilities.direct_unit_calls

    @property
    def is_accelerator(self) -> bool:
        """True unless this is the CPU reference backend."""
        return self.device_type != "cpu"

    def device(self, index: int | None = None) -> torch.device:
        """The torch device for this backend (current index when none is given)."""
        if index is None and self.is_accelerator:
            index = int(self.device_module.current_device())
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)

    def device_binder(self) -> Callable[[], None] | None:
        """A callable that makes this thread's current device current in the thread that calls it (a worker
        registering host memory must do so on the caller's device: CUDA registers for the current context, and a
        worker left on device 0 would open a context there); None when that cannot be done: the device module
        has no ``set_device`` and more than one device is visible."""
        if not self.is_accelerator:
            return _no_binding
        dm = self.device_module
        initialized = getattr(dm, "is_initialized", None)
        if callable(initialized) and not initialized():
            # nothing has chosen a device yet (choosing a device initialises it): every thread starts on the
            # default one; asking for the current device would initialise the runtime here, before filling
            return _no_binding
        set_device = getattr(dm, "set_device", None)
        if set_device is None:
            return _no_binding if int(dm.device_count()) <= 1 else None
        index = int(dm.current_device())

        def bind() -> None:
            set_device(index)

        return bind

    def device_index(self, device: torch.device | int | None = None) -> int:
        """The index of ``device`` on this backend (None: the current device; the host is index 0)."""
        if isinstance(device, bool):
            raise TypeError(f"a device index must be an int or a torch.device, got {device!r}")
        if isinstance(device, int):
            index: int | None = device
        elif device is None:
            index = None
        else:
            dev = torch.device(device)
            if dev.type != self.device_type:
                raise BackendError(f"device {dev} is not one of backend {self.name!r}'s ({self.device_type}); pass "
                                   f"a {self.device_type} device or its index")
            index = dev.index
        if index is None:
            index = self.device().index if self.is_accelerator else None
        return int(index or 0)

    def device_memory(self, device: torch.device | int | None = None) -> DeviceMemory | None:
        """What this process can still allocate on ``device`` (default: the current one) and the capacity it sees.

        ``free`` counts the device's free bytes and what torch's caching allocator holds unused, within any cap
        (:meth:`limit_device_memory`); ``total`` is the cap when one is set. From the backend's
        ``magi_device_memory`` (spec 1.2), else from the device module's ``mem_get_info``; None when the backend
        cannot tell, and on the host (host memory is no device budget). May initialise the device.
        """
        index = self.device_index(device)
        if self._device_memory is not None:
            try:
                result = self._device_memory(index)
            except MagiError:
                raise
            except Exception as exc:
                raise BackendError(f"backend {self.name!r} ({self.package}): magi_device_memory({index}) raised "
                                   f"{type(exc).__name__}: {exc}") from exc
            if result is not None and not isinstance(result, DeviceMemory):
                raise BackendError(f"backend {self.name!r} ({self.package}): magi_device_memory returned "
                                   f"{type(result).__name__}; return magi_core.plugin.DeviceMemory(free=..., "
                                   "total=...) or None")
            return result
        if not self.is_accelerator:
            return None
        return memory_from_module(self.device_module, index)

    @property
    def can_limit_device_memory(self) -> bool:
        """True when the backend can cap this process's device memory (it implements ``magi_limit_device_memory``)."""
        return self._limit_device_memory is not None

    def require_device_memory_limit(self) -> None:
        """Raise :class:`BackendError` naming the backend when it cannot cap device memory."""
        if self._limit_device_memory is None:
            where = ("it runs on the host, whose memory is no device budget" if not self.is_accelerator else
                     f"its package {self.package} does not implement magi_limit_device_memory (hook spec 1.2)")
            raise BackendError(
                f"backend {self.name} cannot cap device memory; {where}. Run on a backend that can (cuda, musa, "
                "magidev), or leave the cap unset (--device-memory / MAGI_DEVICE_MEMORY)"
            )

    def limit_device_memory(self, nbytes: int, device: torch.device | int | None = None) -> None:
        """Cap this process's allocations on ``device`` (default: the current one) at ``nbytes``: a smaller card.

        Past the cap the device's out-of-memory error is raised, as on a card of that size, and
        :meth:`device_memory` reports ``total == nbytes``. Set it before the process allocates on the device.
        Raises :class:`BackendError` when the backend cannot cap (no ``magi_limit_device_memory``) or refuses the
        size (above the device's total), :class:`ConfigError` for a size that is not a positive whole number.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"a device memory cap must be a positive whole number of bytes, got {nbytes!r}")
        self.require_device_memory_limit()
        assert self._limit_device_memory is not None
        index = self.device_index(device)
        try:
            self._limit_device_memory(index, nbytes)
        except MagiError:
            raise
        except Exception as exc:
            raise BackendError(f"backend {self.name!r} ({self.package}): magi_limit_device_memory({index}, {nbytes}) "
                               f"raised {type(exc).__name__}: {exc}") from exc

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin the host range [ptr, ptr+nbytes) in place (idempotent)."""
        self._register(ptr, nbytes)
        REGISTERED.add(ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        """Unpin the host range that starts at ptr."""
        self._unregister(ptr)
        REGISTERED.remove(ptr)

    @property
    def registered(self) -> RegisteredRanges:
        """The host ranges registered through magi-core in this process (a copy must not cross their bounds)."""
        return REGISTERED

    # is_dynamo_compiling, not is_compiling: the latter is one flag for the process, set while any thread
    # compiles, so another thread's compile could fall between a push and its pop here and unbalance them; the
    # former is False outside Dynamo's tracing, whatever other threads do, and True (constant) inside it
    def range_push(self, name: str) -> None:
        """Open a profiling range; a no-op without profiler support or inside code Dynamo traces."""
        if self._range_push is not None and not torch.compiler.is_dynamo_compiling():
            self._range_push(name)

    def range_pop(self) -> None:
        """Close the innermost profiling range; a no-op without profiler support or inside code Dynamo traces."""
        if self._range_pop is not None and not torch.compiler.is_dynamo_compiling():
            self._range_pop()

    def range_fns(self) -> tuple[Callable[[str], Any], Callable[[], Any]]:
        """The backend's push / pop callables themselves (no-ops without them), for hot loops outside compiled code."""
        push, pop = self._range_push, self._range_pop
        if push is None or pop is None:
            return _no_push, _no_pop
        return push, pop

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        """Context manager around :meth:`range_push` / :meth:`range_pop`."""
        self.range_push(name)
        try:
            yield
        finally:
            self.range_pop()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor`` (no-op for host tensors)."""
        if tensor.device.type == self.device_type and self.is_accelerator:
            tensor.record_stream(stream)


def _no_push(name: str) -> None:
    """Range push of a backend without profiler ranges."""


def _no_pop() -> None:
    """Range pop of a backend without profiler ranges."""
