"""Transfers that really copy on the CPU backend (whose own copies alias the host), for executor tests.

With them a device copy kept across calls is separate memory and goes stale when its host weight changes,
as on a real accelerator; the CPU backend's aliasing would hide exactly those bugs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from magi_core.execute.transfer import PerTensorTransfer, SpanTransfer


class CloningTransfer(PerTensorTransfer):
    """Every fetch is a real copy into new memory, as on a device with its own memory."""

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        outs, ev = super().fetch(hosts, event)
        return [o.clone() if o.data_ptr() == h.data_ptr() else o for o, h in zip(outs, hosts, strict=True)], ev


class CopyingSpanTransfer(SpanTransfer):
    """A span transfer whose copies are real (new memory) even on the CPU backend."""

    def fetch(self, hosts: Sequence[torch.Tensor], event: Any = None) -> tuple[list[torch.Tensor], Any]:
        outs, ev = super().fetch(hosts, event)
        if outs and outs[0].data_ptr() == hosts[0].data_ptr():  # the CPU backend aliased the span: copy it
            plan = self._plans[tuple((id(h), h.data_ptr()) for h in hosts)]
            if plan is None:
                return [o.clone() for o in outs], ev
            dev = plan.host.clone()
            outs = [dev.view(d).as_strided(s, st, o) if dev.numel() % d.itemsize == 0 else
                    dev[: dev.numel() // d.itemsize * d.itemsize].view(d).as_strided(s, st, o)
                    for d, s, st, o in plan.layout]
        return outs, ev
