"""The CUDA backend's device-memory hooks: the logic with ``torch.cuda``'s functions replaced (runs anywhere), and
the real cap on a GPU (an allocation past it fails with CUDA's out-of-memory error)."""

from __future__ import annotations

import types

import magi_backend_cuda
import pytest
import torch
from magi_backend_cuda import memory

from magi_core.errors import BackendError
from magi_core.plugin import DeviceMemory
from magi_core.plugin.manager import REGISTRY

GIB = 1 << 30


class FakeAllocator:
    """What torch.cuda's memory functions answer for one 80 GiB device, with a caching allocator's counters."""

    def __init__(self) -> None:
        self.total = 80 * GIB
        self.device_free = 70 * GIB  # other processes and the context hold the rest
        self.allocated = 2 * GIB
        self.reserved = 3 * GIB
        self.fraction = 1.0
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", (device,)))
        return self.device_free, self.total

    def memory_reserved(self, device: int | None = None) -> int:
        return self.reserved

    def memory_allocated(self, device: int | None = None) -> int:
        return self.allocated

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:  # what torch.cuda checks
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.calls.append(("set_per_process_memory_fraction", (fraction, device)))
        self.fraction = fraction

    def get_per_process_memory_fraction(self, device: int | None = None) -> float:
        return self.fraction


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """torch.cuda's memory functions answered by a :class:`FakeAllocator`; the backend's cap record reset."""
    fake = FakeAllocator()
    for name in ("mem_get_info", "memory_reserved", "memory_allocated", "set_per_process_memory_fraction",
                 "get_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(memory, "CAP", type(memory.CAP)("cuda", memory._cuda))
    return fake


def test_device_memory_counts_the_allocators_cached_bytes(fake_cuda: FakeAllocator) -> None:
    """Uncapped: free is the device's free bytes plus what the caching allocator holds unused; total the device's."""
    got = magi_backend_cuda.magi_device_memory(device_index=0)
    assert got == DeviceMemory(free=70 * GIB + 1 * GIB, total=80 * GIB)
    assert ("mem_get_info", (0,)) in fake_cuda.calls


def test_a_cap_sets_the_allocator_fraction_and_shows_as_the_total(fake_cuda: FakeAllocator) -> None:
    """magi_limit_device_memory: fraction nbytes/total on that device; then free = min(real, cap - allocated)."""
    magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=12 * GIB)
    assert ("set_per_process_memory_fraction", (12 / 80, 0)) in fake_cuda.calls
    assert memory.CAP.caps() == {0: 12 * GIB}
    assert magi_backend_cuda.magi_device_memory(device_index=0) == DeviceMemory(free=10 * GIB, total=12 * GIB)
    fake_cuda.allocated = 13 * GIB  # more than the cap (allocated before it was set): nothing free, never negative
    assert magi_backend_cuda.magi_device_memory(device_index=0) == DeviceMemory(free=0, total=12 * GIB)
    fake_cuda.allocated, fake_cuda.device_free = 2 * GIB, 4 * GIB  # the device itself is nearly full
    assert magi_backend_cuda.magi_device_memory(device_index=0) == DeviceMemory(free=5 * GIB, total=12 * GIB)


def test_a_cap_at_the_device_total_lifts_it_and_one_above_is_refused(fake_cuda: FakeAllocator) -> None:
    magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=12 * GIB)
    magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=80 * GIB)
    assert fake_cuda.fraction == 1.0 and memory.CAP.caps() == {}
    assert magi_backend_cuda.magi_device_memory(device_index=0).total == 80 * GIB
    with pytest.raises(BackendError, match=r"cannot cap device 0 at .* the device has 85899345920 B"):
        magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=81 * GIB)
    assert fake_cuda.fraction == 1.0


def test_a_fraction_set_outside_magi_counts_as_the_cap(fake_cuda: FakeAllocator) -> None:
    """torch.cuda.set_per_process_memory_fraction called by the user directly: device_memory still reports it."""
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    assert magi_backend_cuda.magi_device_memory(device_index=0) == DeviceMemory(free=18 * GIB, total=20 * GIB)


def test_the_facade_binds_both_hooks(fake_cuda: FakeAllocator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backend.device_memory / limit_device_memory reach the CUDA hooks with the device's index."""
    rec = REGISTRY.records()["cuda"]
    assert {"magi_device_memory", "magi_limit_device_memory"} <= set(rec.callers)
    monkeypatch.setattr(rec, "probe", types.SimpleNamespace(available=True, device_type="cuda", priority=100,
                                                            version="12.8", reason=None))
    backend = REGISTRY._facade(rec, "explicit")
    assert backend.can_limit_device_memory
    backend.limit_device_memory(16 * GIB, torch.device("cuda", 0))
    assert backend.device_memory(0) == DeviceMemory(free=14 * GIB, total=16 * GIB)
    backend.limit_device_memory(80 * GIB, 0)  # lift it again


def _cuda_usable() -> bool:
    rec = REGISTRY.records().get("cuda")
    return rec is not None and rec.available


@pytest.mark.accelerator
@pytest.mark.skipif(not _cuda_usable(), reason="no usable CUDA device (magi backend 'cuda' unavailable)")
def test_a_real_cap_refuses_an_allocation_past_it() -> None:
    """On a GPU: capped at what the allocator holds now plus 256 MiB, 128 MiB allocate, more than the cap leaves
    fails with CUDA's out-of-memory error; lifting the cap restores the device's total."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = magi_backend_cuda.magi_device_memory(device_index=0).total
    cap = int(torch.cuda.memory_reserved(0)) + (256 << 20)
    magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=cap)
    try:
        seen = magi_backend_cuda.magi_device_memory(device_index=0)
        left = cap - int(torch.cuda.memory_allocated(0))
        assert seen.total == cap and 0 < seen.free <= left
        ok = torch.empty(128 << 20, dtype=torch.uint8, device="cuda:0")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(left + (64 << 20), dtype=torch.uint8, device="cuda:0")
        del ok
    finally:
        magi_backend_cuda.magi_limit_device_memory(device_index=0, nbytes=total)
        torch.cuda.empty_cache()
    assert magi_backend_cuda.magi_device_memory(device_index=0).total == total
