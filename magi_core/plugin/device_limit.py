"""Capping this process's device memory, to run as on a smaller card: :func:`limit_device_memory`.

Sizes are bytes (an int, or text such as ``"12GiB"``, ``"512 MiB"``, ``"2e10"``) or a percentage of the device's
total memory (``"80%"``). ``MAGI_DEVICE_MEMORY`` holds the same text for ``magi bench`` and for programs that call
:func:`limit_device_memory_from_env` before their first device allocation. The cap goes through the backend's
``magi_limit_device_memory`` hook (spec 1.2); a backend without it is refused with a clear error.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping

import torch

from magi_core._env import env_str, parse_bytes, register_env_names
from magi_core.errors import BackendError, ConfigError
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)

#: Environment variable holding a device memory cap (``12GiB``, ``80%``), applied by ``magi bench`` and
#: :func:`limit_device_memory_from_env`.
ENV_DEVICE_MEMORY = "MAGI_DEVICE_MEMORY"
register_env_names([ENV_DEVICE_MEMORY])

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*%\s*$")
_HINT = "a byte size (12GiB, 512MiB, 16e9) or a percentage of the device's memory (80%)"


def parse_percent(text: str) -> float:
    """``"80%"`` -> 0.8: a finite percentage above 0 and at most 100 (ValueError otherwise)."""
    match = _PERCENT.match(text)
    if match is None:
        raise ValueError("not a percentage (example: 80%)")
    value = float(match.group(1))
    if not math.isfinite(value) or not 0.0 < value <= 100.0:
        raise ValueError("a percentage must be above 0% and at most 100%")
    return value / 100.0


def parse_device_memory(size: int | str) -> tuple[int | None, float | None]:
    """A cap as ``(bytes, None)`` or ``(None, fraction of the device's total)``; ConfigError when it is neither.

    Accepts a positive int, byte text (:func:`magi_core._env.parse_bytes`: ``12GiB``, ``2GB``, ``1e9``) or a
    percentage (``80%``).
    """
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ConfigError(f"device memory size {size!r}: give {_HINT}")
    if isinstance(size, int):
        if size <= 0:
            raise ConfigError(f"device memory size {size}: give a positive number of bytes")
        return size, None
    try:
        if "%" in size:
            return None, parse_percent(size)
        nbytes = parse_bytes(size)
    except ValueError as exc:
        raise ConfigError(f"device memory size {size!r} is {exc}; give {_HINT}") from None
    if nbytes <= 0:
        raise ConfigError(f"device memory size {size!r}: give a positive number of bytes")
    return nbytes, None


def resolve_device_memory(size: int | str, backend: Backend, device: torch.device | int | None = None) -> int:
    """The cap ``size`` stands for, in bytes: a percentage is taken of ``backend.device_memory(device).total``."""
    nbytes, fraction = parse_device_memory(size)
    if nbytes is not None:
        return nbytes
    assert fraction is not None
    seen = backend.device_memory(device)
    if seen is None:
        raise BackendError(f"backend {backend.name} cannot tell the device's memory, so {size!r} has no size; give "
                           "the cap in bytes (12GiB)")
    return max(1, int(seen.total * fraction))


def limit_device_memory(size: int | str, device: torch.device | int | None = None, *,
                        backend: Backend | None = None) -> int:
    """Cap this process's allocations on ``device`` (default: the current one) at ``size``; returns the cap in bytes.

    ``size``: bytes (``12 << 30``, ``"12GiB"``) or a percentage of the memory the process sees on the device now
    (``"80%"``). Call it before the process's first allocation on the device: past the cap allocations fail with
    the device's out-of-memory error, as on a card of that size, and ``get_backend().device_memory()`` reports
    ``total`` equal to the cap (the default device budget of offloaded models follows). Raises
    :class:`~magi_core.errors.BackendError` where the backend cannot cap device memory (the CPU backend) or the
    size exceeds the device, :class:`~magi_core.errors.ConfigError` for a size it cannot read. ``backend``: the
    facade to cap through (default: the active backend).
    """
    backend = backend if backend is not None else get_backend()
    parse_device_memory(size)  # a size that cannot be read is refused first, whatever the backend
    backend.require_device_memory_limit()
    nbytes = resolve_device_memory(size, backend, device)
    backend.limit_device_memory(nbytes, device)
    logger.info("device memory of this process capped at %d B (%.2f GiB) on backend %s", nbytes, nbytes / (1 << 30),
                backend.name)
    return nbytes


def device_memory_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The text of ``MAGI_DEVICE_MEMORY`` (None when unset or blank); ConfigError naming it when unreadable."""
    raw = env_str(ENV_DEVICE_MEMORY, environ)
    if raw is None:
        return None
    try:
        parse_device_memory(raw)
    except ConfigError as exc:
        raise ConfigError(f"{ENV_DEVICE_MEMORY}={raw!r}: {exc}; or unset it") from None
    return raw


def limit_device_memory_from_env(environ: Mapping[str, str] | None = None,
                                 device: torch.device | int | None = None, *,
                                 backend: Backend | None = None) -> int | None:
    """Apply ``MAGI_DEVICE_MEMORY`` (:func:`limit_device_memory`) when it is set; the cap in bytes, or None.

    Call it at the start of a program (or test) before anything is allocated on the device.
    """
    raw = device_memory_from_env(environ)
    return None if raw is None else limit_device_memory(raw, device, backend=backend)


__all__ = [
    "ENV_DEVICE_MEMORY",
    "device_memory_from_env",
    "limit_device_memory",
    "limit_device_memory_from_env",
    "parse_device_memory",
    "parse_percent",
    "resolve_device_memory",
]
