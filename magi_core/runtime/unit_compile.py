"""Per-unit compilation: run the unit's GraphModule eagerly, or compile it with Inductor at its first real call."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
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
        """Compile with Inductor (example inputs: these device args), install the result, run it."""
        logger.debug("magi offload: compiling unit %s with inductor", self.name)
        compiled = compile_unit(self.module, args)
        self._on_compiled(compiled)  # called like Dynamo calls a backend's result: positionally
        return compiled(*args)


def compile_unit(module: torch.fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
    """``module`` compiled by Inductor for ``args``; lifted 0-dim host scalars stay runtime values.

    Dynamo lifts Python floats to 0-dim host tensors read back with ``.item()`` (origin.md section 2). Inductor
    fake-copies real example inputs without a shape environment, where ``.item()`` raises
    ``DataDependentOutputException``; here such units are compiled from fakes under a shape environment, so
    ``.item()`` is a symbolic float and the compiled unit reads the value on every call.
    """
    from torch._inductor.compile_fx import compile_fx

    compiled: Callable[..., Any]
    if not any(isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu" for a in args):
        compiled = compile_fx(module, list(args))  # type: ignore[assignment]
        return compiled
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    with tracing(TracingContext(fake_mode)):
        compiled = compile_fx(module, fakes)  # type: ignore[assignment]
    return compiled


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


def like_with_like(compiler: str) -> contextlib.AbstractContextManager[Any]:
    """Inductor settings under which a whole-graph compile and per-unit compiles round alike (no-op for eager).

    With ``emulate_precision_casts`` Inductor rounds low-precision values where the model's code casts them,
    not wherever a fused kernel ends, so results no longer depend on fusion (hence unit) boundaries: use it
    around both the reference and the offloaded run when comparing them. Not applied to normal runs.
    """
    if compiler != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(emulate_precision_casts=True)
