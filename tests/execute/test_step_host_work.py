"""A planned step's own host work does not grow with the number of weights.

Every torch call the executor makes per weight before a unit starts delays the step on large models (a Flux step
compared each of its host weights with ``None`` through torch: its first kernel started 17 ms late on the H200).
Two models with the same blocks and units, one with six times the weights per block, must make the same torch calls
outside their units in a planned step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.torch_calls import TorchCalls
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

import magi_core


class Block(nn.Module):
    """``parts`` weight matrices whose outputs are joined: as many weights per block as asked, the same bytes and
    the same output whatever ``parts`` (plain parameters, not a container the split would take for a stack)."""

    def __init__(self, parts: int, width: int = 24) -> None:
        super().__init__()
        self.parts = parts
        for i in range(parts):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(width, width // parts) / width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(torch.cat([x @ getattr(self, f"w{i}") for i in range(self.parts)], dim=-1))


class Stack(nn.Module):
    def __init__(self, parts: int, blocks: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(24, 24)
        self.blocks = nn.ModuleList(Block(parts) for _ in range(blocks))
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


#: Reads of a tensor's address and version counter: how the host-edit check tells a weight changed, per weight by
#: design (tens of nanoseconds each without a mode), not work on its bytes
METADATA = frozenset({"data_ptr", "__get__"})


def _host_calls(parts: int, ratio: float, unit_bytes: str | None) -> tuple[list[str], int, int]:
    """The torch calls one planned step makes outside its units, its unit count and its weight count."""
    model = Stack(parts)
    x = torch.randn(3, 24)
    cfg = magi_core.OffloadConfig(gpu_resident_weight_ratio=ratio, unit_compiler="eager", transfer="unit",
                                  max_unit_bytes=unit_bytes)
    magi_core.offload(model, cfg)
    try:
        with torch.no_grad():
            for _ in range(4):
                model(x)
            ex = magi_core.handle(model).runtime.executor
            mode = TorchCalls(ignore=METADATA)

            def paused(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
                def call(a: Any) -> Any:
                    mode.paused = True
                    try:
                        return fn(a)
                    finally:
                        mode.paused = False
                return call

            ex.fns[:] = [paused(f) for f in ex.fns]
            run = ex.run

            def counted(args: Any, timer: Any) -> Any:
                with mode:
                    return run(args, timer)

            ex.run = counted  # type: ignore[method-assign]
            model(x)
            return mode.calls, len(ex.fns), sum(1 for _ in model.parameters())
    finally:
        magi_core.release(model)


# every weight resident in one unit (ratio 1 compiles whole), resident in one unit per block (the unit bound set:
# each unit checks its own), and every weight streamed
@pytest.mark.parametrize("ratio,unit_bytes", [(1.0, None), (1.0, "4KiB"), (0.0, "4KiB")])
def test_a_planned_step_makes_no_torch_call_per_weight(shm_dir: str, ratio: float, unit_bytes: str | None) -> None:
    torch._dynamo.reset()
    few, units_few, weights_few = _host_calls(1, ratio, unit_bytes)
    torch._dynamo.reset()
    many, units_many, weights_many = _host_calls(6, ratio, unit_bytes)
    assert units_few == units_many and weights_many >= 4 * weights_few
    assert unit_bytes is None or units_few >= 6, "one unit per block expected"
    assert sorted(few) == sorted(many), "the step's own torch calls grew with the weights per unit"
