"""magi-core: run torch.compile'd models whose weights live in host memory, on any accelerator."""

from __future__ import annotations

import torch.distributed as _dist

from magi_core.api import handle, load, offload, release
from magi_core.config import OffloadConfig, Policy
from magi_core.errors import BackendError, ConfigError, HostRegisterError, MagiError
from magi_core.plugin.device_limit import limit_device_memory as limit_device_memory  # noqa: F401
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend, list_backends, use_backend

if _dist.is_available() and not _dist.is_initialized():
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is imported, and
    # torch imports it lazily (torch._dynamo -> torch._inductor: the first torch.compile, or a torch._refs op under
    # ``with torch.device("meta")``, such as nn.Embedding's init). Imported after init_process_group, those
    # defaults hold the default process group: destroy_process_group() cannot free it, and its worker threads
    # live into interpreter shutdown, where one dropping a finished collective's tensors needs the GIL and is
    # killed by CPython (pthread_exit through a noexcept destructor: "terminate called without an active
    # exception"). Imported here, before any process group exists, the defaults are None.
    import torch.distributed.nn.functional  # noqa: F401

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
