"""Per-unit compilation: run the unit's GraphModule eagerly, or compile it with Inductor at its first real call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.fx

from magi_core.backend import Backend
from magi_core.errors import ConfigError

logger = logging.getLogger(__name__)

UNIT_COMPILERS = ("auto", "inductor", "eager")


def resolve_unit_compiler(name: str, backend: Backend) -> str:
    """``auto`` means Inductor on accelerators and eager on the CPU reference backend."""
    if name not in UNIT_COMPILERS:
        raise ConfigError(f"unit_compiler must be one of {', '.join(UNIT_COMPILERS)}, got {name!r}")
    if name == "auto":
        return "inductor" if backend.is_accelerator else "eager"
    return name


class LazyUnit:
    """A unit callable that compiles itself with Inductor on its first call, using that call's device tensors."""

    def __init__(self, module: torch.fx.GraphModule, name: str, on_compiled: Callable[[Callable[..., Any]], None]):
        self.module = module
        self.name = name
        self._on_compiled = on_compiled

    def __call__(self, *args: Any) -> Any:
        """Compile with ``compile_fx`` (device example inputs: these args), install the result, run it."""
        from torch._inductor.compile_fx import compile_fx

        logger.debug("magi offload: compiling unit %s with inductor", self.name)
        compiled = compile_fx(self.module, list(args))
        self._on_compiled(compiled)  # called like Dynamo calls a backend's result: positionally
        return compiled(*args)


def unit_callable(
    module: torch.fx.GraphModule, name: str, compiler: str, install: Callable[[Callable[..., Any]], None]
) -> Callable[..., Any]:
    """The callable the executor launches for one unit (eager: the module's ``forward``)."""
    if compiler == "eager":
        return eager_forward(module)
    if compiler == "inductor":
        return LazyUnit(module, name, install)
    raise ConfigError(f"unit compiler must be 'eager' or 'inductor' here, got {compiler!r}")


def eager_forward(module: torch.fx.GraphModule) -> Callable[..., Any]:
    """The generated ``forward`` of ``module``, bound, skipping lazy-recompile and ``nn.Module.__call__`` layers."""
    real = getattr(module, "real_recompile", None)
    if callable(real):
        real()  # a lazy GraphModule generates its code now instead of on every call's check
    return module.forward
