"""magi-core: run torch.compile'd models whose weights live in host memory, on any accelerator."""

from __future__ import annotations

from magi_core.api import handle, load, offload, release
from magi_core.config import OffloadConfig, Policy
from magi_core.errors import BackendError, ConfigError, HostRegisterError, MagiError
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend, list_backends, use_backend

__version__ = "0.1.0"

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
    "handle",
    "list_backends",
    "load",
    "offload",
    "release",
    "use_backend",
]
