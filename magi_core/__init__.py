"""magi-core: run torch.compile'd models whose weights live in host memory, on any accelerator."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from magi_core.backend import Backend
from magi_core.errors import BackendError, ConfigError, HostRegisterError, MagiError
from magi_core.registry import get_backend, list_backends, use_backend

if TYPE_CHECKING:
    from magi_core.runtime.api import offload, release
    from magi_core.runtime.config import OffloadConfig, Policy

__version__ = "0.1.0"

#: Public names imported on first use, so a runtime module that is missing or broken never breaks
#: ``import magi_core`` (the registry, the CLI and backends work without the runtime).
_LAZY: dict[str, str] = {
    "offload": "magi_core.runtime.api",
    "release": "magi_core.runtime.api",
    "OffloadConfig": "magi_core.runtime.config",
    "Policy": "magi_core.runtime.config",
}


def __getattr__(name: str) -> Any:
    """Import :data:`_LAZY` names on first access."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'magi_core' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"magi_core.{name} is not available: importing {module_name} failed ({exc}); "
            "reinstall magi-core or check the traceback above"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Module attributes, the lazy ones included."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backend",
    "BackendError",
    "ConfigError",
    "HostRegisterError",
    "MagiError",
    "OffloadConfig",
    "Policy",
    "__version__",
    "get_backend",
    "list_backends",
    "offload",
    "release",
    "use_backend",
]
