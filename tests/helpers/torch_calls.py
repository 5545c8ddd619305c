"""A torch function mode that records the torch calls made while it is active, for tests of host-side overhead."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Records the name of every torch call (tensor methods and properties included) made while active, except
    those named in ``ignore`` and those made while :attr:`paused`."""

    def __init__(self, ignore: Iterable[str] = ()) -> None:
        super().__init__()
        self.ignore = frozenset(ignore)
        self.paused = False
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", repr(func))
        if not self.paused and name not in self.ignore:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))
