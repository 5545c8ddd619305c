"""Profiler: unit timing events, the host-to-device bandwidth probe, and rank-0 broadcast under torch.distributed."""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from magi_core.errors import ConfigError, HostRegisterError, MagiError
from magi_core.execute.profiler import UnitTimer, broadcast_profiles, broadcast_value, measure_h2d_bandwidth
from magi_core.plugin.cpu import device as cpu_device
from magi_core.plugin.manager import get_backend


def _cpu_ranges() -> dict[int, int]:
    from magi_core.plugin.cpu import registered_ranges

    return registered_ranges()


def cpu_only() -> None:
    if get_backend().device_type != "cpu":
        pytest.skip("checks the CPU reference backend's range table")


# -- UnitTimer ----------------------------------------------------------------------------------------------
def test_unit_timer_measures_each_unit() -> None:
    backend = get_backend()
    timer = UnitTimer(backend, 3)
    sleeps = (0.02, 0.0, 0.002)
    for i, s in enumerate(sleeps):
        timer.start(i)
        if s:
            time.sleep(s)
        timer.stop(i)
    ms = timer.result()
    assert len(ms) == 3
    if backend.is_accelerator:  # host sleeps are no device work: the events bracket nothing, only the sign is known
        assert all(x >= 0.0 for x in ms)
    else:  # the CPU reference times host work: each unit at least its own sleep (sleep lasts at least as long as
        # asked), and only its own (a time measured from an earlier unit's start would make unit 2 the longest)
        assert ms[0] >= 20.0 and ms[2] >= 2.0
        assert max(ms[1], ms[2]) < ms[0]
    assert timer.elapsed_ms() == ms  # synchronized once, then cached


def test_unit_timer_call_forms() -> None:
    backend = get_backend()
    for timer in (UnitTimer(backend, 2), UnitTimer(2, backend=backend), UnitTimer(2)):
        assert timer.n_units == 2 and timer.backend.device_type == backend.device_type
    assert UnitTimer(0).result() == []


def test_unit_timer_misuse_raises() -> None:
    timer = UnitTimer(2)
    with pytest.raises(MagiError, match="without a matching start"):
        timer.stop(0)
    timer.start(0)
    with pytest.raises(MagiError, match="already started"):
        timer.start(0)
    timer.stop(0)
    with pytest.raises(MagiError, match=r"units \[1\] were not timed"):
        timer.result()
    with pytest.raises(MagiError, match="n_units"):
        UnitTimer(-1)


# -- bandwidth probe ----------------------------------------------------------------------------------------
def test_bandwidth_probe_cpu_memcpy_leaves_nothing_registered() -> None:
    cpu_only()
    bw = measure_h2d_bandwidth(get_backend(), 4 << 20, iters=2)
    assert 0 < bw < float("inf")
    assert _cpu_ranges() == {}


def test_bandwidth_probe_registers_given_buffer_in_place() -> None:
    cpu_only()
    backend = get_backend()
    buf = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB, viewed as bytes
    seen: list[dict[int, int]] = []
    real_register = backend._register

    def spying_register(ptr: int, nbytes: int) -> None:
        real_register(ptr, nbytes)
        seen.append(_cpu_ranges())

    spy = dataclasses.replace(backend, _register=spying_register)
    assert measure_h2d_bandwidth(spy, host_buffer=buf, warmup=0, iters=1) > 0
    assert seen == [{buf.data_ptr(): buf.numel() * 4}]  # the buffer itself, not a copy, was registered
    assert _cpu_ranges() == {}
    assert torch.equal(buf, torch.arange(1 << 18, dtype=torch.int32))  # source untouched


def test_bandwidth_probe_unregisters_on_error() -> None:
    cpu_only()

    class BrokenStream(cpu_device.Stream):
        def wait_stream(self, stream: object) -> None:
            raise RuntimeError("device lost")

    broken_module = types.ModuleType("broken_device")
    broken_module.__dict__.update({k: v for k, v in vars(cpu_device).items() if not k.startswith("__")})
    broken_module.Stream = BrokenStream  # type: ignore[attr-defined]
    backend = dataclasses.replace(get_backend(), device_module=broken_module)
    with pytest.raises(RuntimeError, match="device lost"):
        measure_h2d_bandwidth(backend, 1 << 16)
    assert _cpu_ranges() == {}


def test_bandwidth_probe_rejects_bad_sizes() -> None:
    for nbytes in (0, -1, True):
        with pytest.raises(ConfigError, match="nbytes"):
            measure_h2d_bandwidth(get_backend(), nbytes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="iters"):
        measure_h2d_bandwidth(get_backend(), 1024, iters=0)


def test_broadcast_without_process_group_is_identity() -> None:
    assert broadcast_value(3.5) == 3.5
    assert broadcast_profiles([1, 2.5]) == [1.0, 2.5]


# -- two gloo ranks -------------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from magi_core.plugin.manager import use_backend

    use_backend("cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        own = measure_h2d_bandwidth(nbytes=1 << 20, iters=2, broadcast=False)
        shared = measure_h2d_bandwidth(nbytes=1 << 20, iters=2)
        profiles = broadcast_profiles([float(rank * 10 + i) for i in range(3)])
        value = broadcast_value(float(rank + 1))
        mismatch = ""
        try:
            broadcast_profiles([0.0] * (3 + rank))
        except MagiError as exc:
            mismatch = str(exc)
        from magi_core.plugin.cpu import registered_ranges

        record = {"rank": rank, "own": own, "shared": shared, "profiles": profiles, "value": value,
                  "mismatch": mismatch, "ranges": len(registered_ranges())}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_rank0_figures_broadcast_to_every_rank(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    recs = sorted((json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)), key=lambda r: r["rank"])
    assert recs[0]["shared"] == recs[1]["shared"] > 0
    assert recs[0]["own"] != recs[1]["own"]  # each rank measured its own figure before the broadcast
    assert recs[1]["profiles"] == [0.0, 1.0, 2.0] == recs[0]["profiles"]
    assert recs[0]["value"] == recs[1]["value"] == 1.0
    assert "every rank must compile the same graph split" in recs[1]["mismatch"]
    assert all(r["ranges"] == 0 for r in recs)


# -- accelerator ----------------------------------------------------------------------------------------------
def _accelerator() -> None:
    backend = get_backend()
    if not backend.is_accelerator or backend.device_module.device_count() < 1:
        pytest.skip("needs a real accelerator backend")


@pytest.mark.accelerator
def test_accelerator_bandwidth_plausible_and_unregistered() -> None:
    _accelerator()
    backend = get_backend()
    buf = torch.empty(256 << 20, dtype=torch.uint8)
    bw = measure_h2d_bandwidth(backend, host_buffer=buf)
    assert bw > 1e9, f"{bw / 1e9:.2f} GB/s from pinned host memory is implausibly slow"
    assert not buf.is_pinned()  # unregistered again
    with pytest.raises(HostRegisterError):
        backend.host_unregister(buf.data_ptr())  # "not registered"
    assert measure_h2d_bandwidth(backend) > 1e9  # the default 1 GiB probe


@pytest.mark.accelerator
def test_accelerator_unit_timer_times_device_work() -> None:
    _accelerator()
    backend = get_backend()
    device = backend.device()
    a = torch.randn(2048, 2048, device=device)
    timer = UnitTimer(backend, 2)
    timer.start(0)
    for _ in range(20):
        a = a @ a / 2048
    timer.stop(0)
    timer.start(1)
    timer.stop(1)
    ms = timer.result()
    assert ms[0] > ms[1] >= 0.0


def test_a_probe_larger_than_memory_names_the_setting() -> None:
    """A bandwidth probe that cannot be allocated is a ConfigError naming bandwidth_probe_bytes, and leaves nothing
    registered, instead of the allocator's raw error at the first call."""
    from helpers.ranges import registered_ranges

    before = registered_ranges()
    with pytest.raises(ConfigError, match=r"cannot allocate 1125899906842624 bytes.*bandwidth_probe_bytes"):
        measure_h2d_bandwidth(nbytes=1 << 50)
    assert registered_ranges() == before
