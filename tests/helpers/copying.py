"""A per-weight transfer that really copies on the CPU backend (whose own copies alias the host), for executor tests.

(:class:`~magi_core.execute.transfer.UnitTransfer` needs no such helper: it copies into its own buffer on any
device, the CPU included.)

With them a device copy kept across calls is separate memory and goes stale when its host weight changes,
as on a real accelerator; the CPU backend's aliasing would hide exactly those bugs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from magi_core.execute.transfer import PerTensorTransfer


class CloningTransfer(PerTensorTransfer):
    """Every fetch is a real copy into new memory, as on a device with its own memory."""

    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        outs, ev = super().fetch(hosts, event, batch)
        return [o.clone() if o.data_ptr() == h.data_ptr() else o for o, h in zip(outs, hosts, strict=True)], ev
