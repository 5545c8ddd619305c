"""Fitting the card: the default plan stays within what the device can spare, on a device with memory of its own.

Runs where the backend reports its device memory and can cap it (tox's privateuse1 env: the emulated magidev
device; CUDA); skipped on the host backend, whose "device" is the host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import magi_core
from magi_core.config import DEVICE_RESERVE_BYTES, DEVICE_RESERVE_SHARE, OffloadConfig
from magi_core.errors import DeviceMemoryError
from magi_core.plugin.manager import get_backend

MIB = 1 << 20
#: Each block holds 16 MiB of float32 weights (a CUDA process allocates tens of MiB of its own: workspaces).
DIM = 2048


class Blocks(nn.Module):
    """A stack of square linear blocks of 16 MiB each (128 MiB)."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return x


@pytest.fixture
def device_cap() -> Iterator[object]:
    """A function capping the device so that a given number of bytes is spare; the cap is lifted afterwards."""
    backend = get_backend()
    if not backend.is_accelerator or backend.device_memory() is None:
        pytest.skip("needs a device that reports its own memory (magidev, CUDA): on the CPU backend the host is the "
                    "device")
    info = backend.device_memory()
    assert info is not None
    total = info.total
    dm = backend.device_module

    def cap(spare: int) -> int:
        """Cap the card so that, with the reserve kept free, ``spare`` bytes are left beside what is allocated."""
        nbytes = math.ceil((int(dm.memory_allocated()) + DEVICE_RESERVE_BYTES + spare) / (1 - DEVICE_RESERVE_SHARE))
        magi_core.limit_device_memory(nbytes)
        return nbytes

    torch._dynamo.reset()
    yield cap
    torch._dynamo.reset()
    magi_core.limit_device_memory(total)


def _run(model: nn.Module, config: OffloadConfig, calls: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, DIM)
    with torch.no_grad():
        ref = model(x)
        magi_core.offload(model, config)
        for _ in range(calls):
            out = model(x)
    return out.cpu(), ref


def test_default_plan_fits_a_card_smaller_than_the_model(device_cap) -> None:
    """128 MiB of weights on a card with 80 MiB to spare: the default plan fits it, keeps what it can resident and
    streams the rest; what it says it holds is within the budget, and the measured step holds no more."""
    cap = device_cap(80 * MIB)
    model = Blocks().eval()
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager"))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.device_budget_bytes is not None and 0 < stats.device_budget_bytes <= 80 * MIB
        assert stats.streamed_bytes_per_step > 0, "the model is larger than the card: some of it streams"
        held = stats.resident_bytes + stats.transfer_buffer_bytes
        assert held <= stats.device_budget_bytes
        assert stats.predicted_peak_bytes is not None and stats.predicted_peak_bytes <= cap
        assert stats.measured_peak_bytes is not None
        assert stats.measured_peak_bytes <= stats.predicted_peak_bytes + DIM * DIM * 4  # a unit of slack: workspaces
    finally:
        magi_core.release(model, restore=True)


def test_default_plan_keeps_no_more_than_the_step_needs(device_cap) -> None:
    """With room for everything, the default keeps resident only what shortens the step: never more than the
    whole model, and no plan holding less is predicted as fast (within the tolerance)."""
    device_cap(512 * MIB)
    model = Blocks().eval()
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager"))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.resident_bytes + stats.streamed_bytes_per_step == 8 * DIM * DIM * 4
        assert stats.predicted_peak_bytes <= stats.device_budget_bytes + stats.activation_bytes
    finally:
        magi_core.release(model, restore=True)


def test_a_ratio_that_does_not_fit_degrades_with_a_warning(device_cap, caplog) -> None:
    device_cap(80 * MIB)
    model = Blocks().eval()
    try:
        with caplog.at_level(logging.WARNING, logger="magi_core"):
            out, ref = _run(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=1.0,
                                                 max_unit_bytes=16 * MIB))
        torch.testing.assert_close(out, ref)
        assert any("gpu_resident_weight_ratio=1 holds" in r.getMessage() and "fastest plan that fits" in r.getMessage()
                   for r in caplog.records)
        (stats,) = magi_core.handle(model).stats()
        assert stats.resident_bytes + stats.transfer_buffer_bytes <= 80 * MIB
    finally:
        magi_core.release(model, restore=True)


def test_a_share_of_the_device_is_a_budget_in_bytes(device_cap) -> None:
    device_cap(160 * MIB)
    info = get_backend().device_memory()
    assert info is not None
    model = Blocks().eval()
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager", device_memory_budget_bytes="10%"))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.device_budget_bytes == info.total * 10 // 100
        assert stats.resident_bytes + stats.transfer_buffer_bytes <= info.total * 10 // 100
    finally:
        magi_core.release(model, restore=True)


def test_a_unit_larger_than_the_card_is_a_clear_error_before_any_allocation(device_cap) -> None:
    """Streaming needs two 16 MiB units in flight; a card with 24 MiB to spare cannot hold them: the error names the
    largest unit, its size and the free memory, and comes before the device runs out."""
    device_cap(24 * MIB)
    model = Blocks().eval()
    dm = get_backend().device_module
    before = int(dm.memory_allocated())
    try:
        with pytest.raises(DeviceMemoryError, match=r"largest unit 'blocks\.\d' alone holds 16\.00 MiB.*free for it.*"
                                                    r"max_unit_bytes"):
            _run(model, OffloadConfig(unit_compiler="eager"))
        assert int(dm.memory_allocated()) <= before
    finally:
        magi_core.release(model, restore=True)
