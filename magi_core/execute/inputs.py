"""Input preparation: non-weight graph inputs to the device, lifted 0-dim host scalars left on the host.

Inside an :func:`~magi_core.api.offload` call, graph inputs that are host proxies of device tensors
(:mod:`magi_core.compile.device_inputs`) are replaced by those device tensors: one dict look-up per non-weight
input, no copy. The thread's substitution map lives here, below the forward that sets it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from magi_core.passes.weights import is_host_scalar

_local = threading.local()


def current_substitutions() -> dict[int, torch.Tensor] | None:
    """The substitution map of the offloaded call running on this thread (``None`` outside one)."""
    return getattr(_local, "subs", None)


@contextmanager
def substituting(subs: dict[int, torch.Tensor]) -> Iterator[None]:
    """Make ``subs`` (``id(proxy) -> device tensor``) this thread's substitution map inside the block.

    The forward that replaces device inputs by host proxies (:mod:`magi_core.compile.device_inputs`) sets it;
    :meth:`InputPreparer.fill` reads it, so the map lives here, below both.
    """
    prev = getattr(_local, "subs", None)
    _local.subs = subs
    try:
        yield
    finally:
        _local.subs = prev


class InputPreparer:
    """Moves the non-weight tensor inputs that are not on the device yet; device inputs are used as they are."""

    def __init__(self, device: torch.device, n_inputs: int, weight_inputs: Sequence[int]) -> None:
        self.device = device
        skip = set(weight_inputs)
        self.indices = tuple(i for i in range(n_inputs) if i not in skip)
        #: Bytes of host inputs copied to the device (device inputs and proxies never count).
        self.bytes_moved = 0
        #: Inputs taken from the substitution map (device tensors behind host proxies).
        self.substituted = 0

    def fill(self, args: Sequence[Any], env: list[Any]) -> None:
        """Write every non-weight input into ``env``: proxied device tensors swapped in, host tensors moved."""
        device = self.device
        dtype = device.type
        subs = current_substitutions()
        for i in self.indices:
            a = args[i]
            if subs:
                d = subs.get(id(a))
                if d is not None:
                    env[i] = d
                    self.substituted += 1
                    continue
            if isinstance(a, torch.Tensor) and a.device.type != dtype and not is_host_scalar(a):
                self.bytes_moved += a.nbytes
                a = a.to(device, non_blocking=True)
            env[i] = a
