"""Exceptions raised by magi-core; each message says what to do."""

from __future__ import annotations


class MagiError(RuntimeError):
    """Base class of every magi-core error."""


class BackendError(MagiError):
    """No usable backend could be selected, or a backend misbehaved."""


class HostRegisterError(MagiError):
    """The backend's runtime refused to register or unregister a host range."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ConfigError(MagiError, ValueError):
    """An invalid configuration value."""


class DeviceMemoryError(MagiError):
    """The model cannot run within the device memory it has (a unit larger than what the device can spare)."""
