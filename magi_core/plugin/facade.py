"""The typed facade core code uses to talk to the active backend, resolved once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


@dataclass(frozen=True)
class Backend:
    """The active backend: device type, device module, host register/unregister, ranges, aliases."""

    name: str
    package: str
    version: str
    device_type: str
    priority: int
    selected_by: str
    device_module: ModuleType
    to_method_aliases: tuple[str, ...]
    _register: Callable[[int, int], Any]
    _unregister: Callable[[int], Any]
    _range_push: Callable[[str], Any] | None
    _range_pop: Callable[[], Any] | None

    @property
    def is_accelerator(self) -> bool:
        """True unless this is the CPU reference backend."""
        return self.device_type != "cpu"

    def device(self, index: int | None = None) -> torch.device:
        """The torch device for this backend (current index when none is given)."""
        if index is None and self.is_accelerator:
            index = int(self.device_module.current_device())
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin the host range [ptr, ptr+nbytes) in place (idempotent)."""
        self._register(ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        """Unpin the host range that starts at ptr."""
        self._unregister(ptr)

    def range_push(self, name: str) -> None:
        """Open a profiling range; a no-op without profiler support or while compiling."""
        if self._range_push is not None and not torch.compiler.is_compiling():
            self._range_push(name)

    def range_pop(self) -> None:
        """Close the innermost profiling range; a no-op without profiler support or while compiling."""
        if self._range_pop is not None and not torch.compiler.is_compiling():
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
