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


class WideEnds(nn.Module):
    """Two 64 MiB ends (an embedding and an LM head, as in a language model) around eight 16 MiB blocks: fewer
    resident weights can need a larger copy buffer (two ends in flight at once)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(8))
        self.tail = nn.Linear(DIM, 4 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(torch.tanh(self.head(x)))
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return self.tail(x)


@pytest.mark.parametrize("spare_mib", [180, 220])
def test_the_least_memory_plan_holds_less_than_the_fastest_and_fits(device_cap, spare_mib: int) -> None:
    """The default plan trims residency the step does not need; streaming the trimmed units can need a larger copy
    buffer, so a trimmed plan is taken only when it holds less, never more than the device can spare."""
    cap = device_cap(spare_mib * MIB)
    model = WideEnds().eval()
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager"))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.device_budget_bytes is not None
        assert stats.resident_bytes + stats.transfer_buffer_bytes <= stats.device_budget_bytes
        assert stats.predicted_peak_bytes is not None and stats.predicted_peak_bytes <= cap
        assert stats.measured_peak_bytes is not None and stats.measured_peak_bytes <= cap
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


def test_ratio_one_compiles_whole_where_it_fits_and_degrades_where_it_does_not(device_cap, caplog) -> None:
    """Ratio 1 compiles the graph as one unit only where the device can hold every weight: on a smaller card the
    graph is split so that the ratio degrades to the fastest plan that fits, with a warning, not an error."""
    device_cap(512 * MIB)
    model = Blocks().eval()  # 128 MiB
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=1.0))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.units == 1 and stats.resident_bytes == 128 * MIB
    finally:
        magi_core.release(model, restore=True)
    torch._dynamo.reset()
    device_cap(80 * MIB)
    model = Blocks().eval()
    try:
        with caplog.at_level(logging.WARNING, logger="magi_core"):
            out, ref = _run(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=1.0))
        torch.testing.assert_close(out, ref)
        assert any("gpu_resident_weight_ratio=1 holds" in r.getMessage() and "fastest plan that fits" in r.getMessage()
                   for r in caplog.records)
        (stats,) = magi_core.handle(model).stats()
        assert stats.units == 8  # one unit per block
        assert stats.resident_bytes + stats.transfer_buffer_bytes <= 80 * MIB
    finally:
        magi_core.release(model, restore=True)


class _Gated(nn.Module):
    """A decoder-like block of another class: two half-width projections (16 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM // 2, bias=False)
        self.down = nn.Linear(DIM // 2, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class EncoderDecoder(nn.Module):
    """Two stacks of different block classes, glue between them (128 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Blocks(4)
        self.bridge = nn.LayerNorm(DIM)
        self.decoder = nn.ModuleList(_Gated() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bridge(self.encoder(x))
        for block in self.decoder:
            x = block(x)
        return x


def test_ratio_one_on_a_small_card_splits_every_stack(device_cap) -> None:
    """Ratio 1 on a card that cannot hold an encoder-decoder: both stacks split per block, the plan fits the card,
    the output is the model's."""
    cap = device_cap(80 * MIB)
    model = EncoderDecoder().eval()
    try:
        out, ref = _run(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=1.0))
        torch.testing.assert_close(out, ref)
        (stats,) = magi_core.handle(model).stats()
        assert stats.units >= 8  # every block of both stacks its own unit
        assert stats.resident_bytes + stats.transfer_buffer_bytes <= 80 * MIB
        assert stats.measured_peak_bytes is not None and stats.measured_peak_bytes <= cap
    finally:
        magi_core.release(model, restore=True)


def test_ratio_one_second_input_shape_on_a_card_that_holds_the_model_once(device_cap) -> None:
    """A second input shape at ratio 1, where the device holds the weights once: the first graph compiled whole; the
    second cannot stream a whole-model unit beside them, so it is split and reads the resident copies: one copy of
    the weights on the device, nothing streamed, both graphs planned."""
    device_cap(200 * MIB)
    model = Blocks().eval()  # 128 MiB: fits once, not twice
    try:
        _run(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=1.0))
        x = torch.randn(8, DIM)
        with torch.no_grad():
            for _ in range(3):
                out = model(x)
        stats = magi_core.handle(model).stats()
        assert [s.units for s in stats] == [1, 8] and [s.phase for s in stats] == ["planned", "planned"]
        assert all(s.resident_bytes == 128 * MIB and s.streamed_bytes_per_step == 0 for s in stats)
        assert get_backend().device_module.memory_allocated() < 2 * 128 * MIB  # the weights once
    finally:
        magi_core.release(model, restore=True)
    with torch.no_grad():
        torch.testing.assert_close(out.cpu(), model(x))


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


@pytest.fixture
def two_graphs() -> Iterator[None]:
    """Each input shape its own static graph (no automatic dynamic shapes): two graphs of one model."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def _held(dm: object, before: int) -> int:
    import gc

    gc.collect()
    return int(dm.memory_allocated()) - before  # type: ignore[attr-defined]


def test_graphs_of_one_model_hold_one_budget_together(device_cap, two_graphs) -> None:
    """Two input shapes are two graphs sharing the model's budget: the one still warming up gives its copy buffer up
    while the other plans, warms up again next to the other's resident weights when called, and after both planned
    the model holds no more than the budget at every step (as a prefill and decode graph of ``generate`` do)."""
    device_cap(512 * MIB)
    budget = 144 * MIB  # room for every weight, not for every weight and a copy buffer of two blocks as well
    model = Blocks().eval()
    dm = get_backend().device_module
    before = int(dm.memory_allocated())
    small, large = torch.randn(4, DIM), torch.randn(8, DIM)
    try:
        with torch.no_grad():
            ref_small, ref_large = model(small), model(large)
            # a link planned as slow: every weight resident shortens the step (as on a transfer-bound card)
            magi_core.offload(model, OffloadConfig(unit_compiler="eager", device_memory_budget_bytes=budget,
                                                   bandwidth_safety_factor=0.01))
            model(large)  # the second graph's first call: it warms up, its copy buffer allocated
            for shape, ref in [(small, ref_small)] * 5 + [(large, ref_large)] * 5 + [(small, ref_small)] * 3:
                # the first graph plans while the second is still warming up (idle meanwhile); then the second
                # plans; then the first plans again, reading resident what the second keeps resident
                torch.testing.assert_close(model(shape).cpu(), ref)
                held = _held(dm, before)
                assert held <= budget, [(s.phase, s.resident_bytes // MIB, s.transfer_buffer_bytes // MIB)
                                        for s in magi_core.handle(model).stats()]
        stats = magi_core.handle(model).stats()
        assert len(stats) == 2 and all(s.phase == "planned" for s in stats)
        assert stats[1].resident_bytes >= stats[0].resident_bytes, "the first graph reads the second's residents"
    finally:
        magi_core.release(model, restore=True)


def test_a_graph_planned_first_adopts_weights_another_graph_made_resident(device_cap, two_graphs) -> None:
    """The first graph planned when the card had little to spare; memory freed later lets the second graph keep
    weights resident: the first one plans again and reads them resident too, instead of streaming them each step."""
    device_cap(160 * MIB)
    model = Blocks().eval()
    dm = get_backend().device_module
    small, large = torch.randn(4, DIM), torch.randn(8, DIM)
    other = torch.empty(96 * MIB, dtype=torch.uint8, device=get_backend().device())  # someone else's tensor
    try:
        with torch.no_grad():
            ref_small, ref_large = model(small), model(large)
            # a link planned as slow: every weight resident shortens the step (as on a transfer-bound card)
            magi_core.offload(model, OffloadConfig(unit_compiler="eager", policy="HEURISTIC",
                                                   bandwidth_safety_factor=0.01))
            for _ in range(5):
                model(small)
            (first,) = magi_core.handle(model).stats()
            del other
            for _ in range(5):
                torch.testing.assert_close(model(large).cpu(), ref_large)
            first_again, second = magi_core.handle(model).stats()
            assert second.resident_bytes > first.resident_bytes, "the second graph found more room"
            torch.testing.assert_close(model(small).cpu(), ref_small)  # the first graph plans again here
            first_again, second = magi_core.handle(model).stats()
        assert first_again.resident_bytes >= second.resident_bytes > first.resident_bytes
        assert first_again.streamed_bytes_per_step < first.streamed_bytes_per_step
        assert dm is not None
    finally:
        magi_core.release(model, restore=True)


class TwoStacks(nn.Module):
    """Two stacks of blocks, one per input shape (as a prefill and a decoding step read weights the other does not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = Blocks(6)
        self.second = Blocks(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) if x.shape[0] == 4 else self.second(x)


def test_a_graph_with_no_room_left_on_the_card_takes_it_back_from_the_other(device_cap, two_graphs) -> None:
    """The graph planned first keeps all it can resident on the card (a slow link); the second graph's weights
    cannot even stream in what is left: the first gives its memory back, the second plans next to the room the
    first needs to stream, and the first plans again next to it. Both run right, on the card, never past it."""
    cap = device_cap(112 * MIB)
    model = TwoStacks().eval()
    dm = get_backend().device_module
    small, large = torch.randn(4, DIM), torch.randn(8, DIM)
    try:
        with torch.no_grad():
            ref_small, ref_large = model(small), model(large)
            magi_core.offload(model, OffloadConfig(unit_compiler="eager", bandwidth_safety_factor=0.01))
            for _ in range(4):
                torch.testing.assert_close(model(small).cpu(), ref_small)
            (first,) = magi_core.handle(model).stats()
            assert first.resident_bytes >= 80 * MIB, "the first graph filled the card"
            for _ in range(4):
                torch.testing.assert_close(model(large).cpu(), ref_large)
            for _ in range(3):
                torch.testing.assert_close(model(small).cpu(), ref_small)
                torch.testing.assert_close(model(large).cpu(), ref_large)
                assert int(dm.max_memory_allocated()) <= cap
        runtimes = magi_core.handle(model).runtimes
        assert [r.phase for r in runtimes] == ["planned", "planned"]
        assert sum(r._evictions for r in runtimes) == 1
    finally:
        magi_core.release(model, restore=True)
