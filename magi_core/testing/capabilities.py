"""What the backend under test can do here, decided by trying it (used to skip checks cleanly)."""

from __future__ import annotations

import functools

import torch

from magi_core.plugin.facade import Backend


@functools.cache
def _allocation_check(device_type: str, index: int | None) -> str | None:
    try:
        torch.empty(1, device=torch.device(device_type, index) if index is not None else device_type)
    except NotImplementedError as exc:  # no kernels registered for this device type (emulated devices)
        return f"no tensor kernels exist for device type {device_type!r}: {str(exc).split('. ')[0]}"
    return None


def allocation_problem(backend: Backend) -> str | None:
    """Why tensors cannot be allocated on the backend's device (e.g. an emulated device), or None when they can."""
    if not backend.is_accelerator:
        return None
    return _allocation_check(backend.device_type, backend.device().index)
