"""Input preparation: non-weight graph inputs to the device, lifted 0-dim host scalars left on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_host_scalar(t: Any) -> bool:
    """True for a 0-dim tensor on the host: Dynamo's lifted float/int scalars (read back with ``.item()``)."""
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"


class InputPreparer:
    """Moves the non-weight tensor inputs that are not on the device yet; device inputs are used as they are."""

    def __init__(self, device: torch.device, n_inputs: int, weight_inputs: Sequence[int]) -> None:
        self.device = device
        skip = set(weight_inputs)
        self.indices = tuple(i for i in range(n_inputs) if i not in skip)
        self.bytes_moved = 0

    def fill(self, args: Sequence[Any], env: list[Any]) -> None:
        """Write every non-weight input into ``env``, moved to the device when needed."""
        device = self.device
        dtype = device.type
        for i in self.indices:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.device.type != dtype and not (a.dim() == 0 and a.device.type == "cpu"):
                self.bytes_moved += a.nbytes
                a = a.to(device, non_blocking=True)
            env[i] = a
