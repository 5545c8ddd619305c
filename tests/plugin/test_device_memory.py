"""Device memory (hook spec 1.2): DeviceMemory, the facade's defaults and bindings, sizes, the env variable, a cap.

Runs on the active backend: on the CPU backend (tox core) capping is refused with a clear error; with
``MAGI_BACKEND=magidev`` (tox privateuse1) a cap really refuses an allocation past it and ``device_memory`` shows it.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.fake_backends import discover_also, load_in_process

import magi_core
from magi_core import _env
from magi_core.errors import BackendError, ConfigError
from magi_core.plugin import DeviceMemory, FractionCap, memory_from_module
from magi_core.plugin.cpu import device as cpu_device
from magi_core.plugin.device_limit import (
    ENV_DEVICE_MEMORY,
    limit_device_memory_from_env,
    parse_device_memory,
    parse_percent,
    resolve_device_memory,
)
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import ENV_BACKEND, Registry, get_backend

GIB = 1 << 30
MIB = 1 << 20


# -- DeviceMemory ------------------------------------------------------------------------------------------------
def test_device_memory_holds_whole_bytes_with_free_within_total() -> None:
    assert DeviceMemory(free=0, total=0) == DeviceMemory(0, 0)
    assert DeviceMemory(free=3, total=5).free == 3
    for bad in ({"free": 6, "total": 5}, {"free": -1, "total": 5}):
        with pytest.raises(ValueError, match="0 <= free <= total"):
            DeviceMemory(**bad)
    for bad in ({"free": 1.0, "total": 5}, {"free": True, "total": 5}, {"free": 1, "total": "5"}):
        with pytest.raises(TypeError, match="must be an int"):
            DeviceMemory(**bad)  # type: ignore[arg-type]


# -- the default: the device module's mem_get_info plus the allocator's cached bytes ----------------------------
class _Module:
    """A torch-style device module's memory functions, answering fixed figures (and the calls it got)."""

    def __init__(self, free: int = 10 * GIB, total: int = 16 * GIB, reserved: int | None = 3 * GIB,
                 allocated: int | None = 2 * GIB) -> None:
        self.__name__ = "torch.fakedev"
        self.free, self.total, self.fraction = free, total, 1.0
        self.calls: list[tuple[str, Any]] = []
        if reserved is not None:
            self.memory_reserved = lambda device=None: reserved
        if allocated is not None:
            self.memory_allocated = lambda device=None: self.allocated
        self.allocated = allocated or 0

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", device))
        return self.free, self.total

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        self.calls.append(("fraction", (fraction, device)))
        self.fraction = fraction

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        """No device work to wait for."""


def test_default_adds_the_allocators_cached_bytes_to_mem_get_info() -> None:
    module = _Module()
    assert memory_from_module(module, 1) == DeviceMemory(free=11 * GIB, total=16 * GIB)
    assert module.calls == [("mem_get_info", 1)]
    # without both counters nothing is added; free never exceeds total
    assert memory_from_module(_Module(reserved=None), 0) == DeviceMemory(free=10 * GIB, total=16 * GIB)
    assert memory_from_module(_Module(free=16 * GIB, reserved=8 * GIB), 0) == DeviceMemory(16 * GIB, 16 * GIB)


def test_default_is_none_without_mem_get_info_or_when_it_raises(caplog: pytest.LogCaptureFixture) -> None:
    assert memory_from_module(types.SimpleNamespace(), 0) is None
    assert memory_from_module(cpu_device, 0) is None  # the host module has no mem_get_info

    def broken(device: int | None = None) -> tuple[int, int]:
        raise RuntimeError("driver says no")

    with caplog.at_level("WARNING"):
        assert memory_from_module(types.SimpleNamespace(mem_get_info=broken, __name__="torch.x"), 0) is None
    assert "driver says no" in caplog.text


def _backend(module: Any, device_type: str = "meta", **hooks: Any) -> Backend:
    """A facade over ``module`` as selection builds it, with the device-memory hooks given (or absent)."""
    return Backend(name="fake", package="magi-backend-fake", version="1", device_type=device_type, priority=1,
                   selected_by="explicit", device_module=module, to_method_aliases=("to",),
                   _register=lambda ptr, nbytes: None, _unregister=lambda ptr: None, _range_push=None,
                   _range_pop=None, **hooks)


def test_facade_without_the_hooks_reads_the_module_and_refuses_a_cap() -> None:
    module = _Module()
    backend = _backend(module)
    assert backend.device_memory() == DeviceMemory(free=11 * GIB, total=16 * GIB)
    assert backend.device_memory(torch.device("meta", 3)) is not None and module.calls[-1] == ("mem_get_info", 3)
    assert not backend.can_limit_device_memory
    with pytest.raises(BackendError, match=r"^backend fake cannot cap device memory; its package magi-backend-fake "
                                           r"does not implement magi_limit_device_memory"):
        backend.limit_device_memory(GIB)
    # the host is no device budget, whatever its module says
    assert _backend(module, device_type="cpu").device_memory() is None


def test_facade_binds_the_hooks_with_the_device_index() -> None:
    seen: list[tuple[Any, ...]] = []

    def device_memory(index: int) -> DeviceMemory:
        seen.append(("memory", index))
        return DeviceMemory(free=1, total=2)

    backend = _backend(_Module(), _device_memory=device_memory,
                       _limit_device_memory=lambda index, nbytes: seen.append(("limit", index, nbytes)))
    assert backend.device_memory(torch.device("meta", 2)) == DeviceMemory(1, 2)
    backend.limit_device_memory(5 * GIB)
    backend.limit_device_memory(GIB, 1)
    assert seen == [("memory", 2), ("limit", 0, 5 * GIB), ("limit", 1, GIB)]
    for bad in (0, -1, 1.5, True, "1GiB"):
        with pytest.raises(ConfigError, match="positive whole number of bytes"):
            backend.limit_device_memory(bad)  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="device cpu is not one of backend 'fake'"):
        backend.device_memory(torch.device("cpu"))


def test_facade_names_the_hook_when_it_misbehaves() -> None:
    def raising(index: int, nbytes: int = 0) -> None:
        raise RuntimeError("vendor runtime exploded")

    backend = _backend(_Module(), _device_memory=lambda index: {"free": 1}, _limit_device_memory=raising)
    with pytest.raises(BackendError, match=r"magi_device_memory returned dict; return magi_core.plugin.DeviceMemory"):
        backend.device_memory()
    with pytest.raises(BackendError, match=r"magi_limit_device_memory\(0, 1024\) raised RuntimeError: vendor runtime"):
        backend.limit_device_memory(1024)
    with pytest.raises(BackendError, match=r"magi_device_memory\(0\) raised RuntimeError"):
        _backend(_Module(), _device_memory=raising).device_memory()


MEMORY_HOOKS = """
from magi_core.plugin import DeviceMemory
CAPS = {}

@hookimpl
def magi_device_memory(device_index):
    total = CAPS.get(device_index, 8 << 30)
    return DeviceMemory(free=total // 2, total=total)

@hookimpl
def magi_limit_device_memory(device_index, nbytes):
    CAPS[device_index] = nbytes
"""


def test_a_backends_hooks_are_bound_at_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend implementing both hooks (through its entry point): the facade calls them, caps and percentages."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    discover_also(monkeypatch, load_in_process(monkeypatch, "memdev", device_type="meta", priority=-50,
                                               extra=MEMORY_HOOKS))
    registry = Registry()
    backend = registry.use("memdev")
    assert backend is not None and backend.can_limit_device_memory
    assert not {"magi_device_memory", "magi_limit_device_memory"} & set(registry.records()["memdev"].missing_optional)
    assert backend.device_memory(0) == DeviceMemory(free=4 * GIB, total=8 * GIB)
    assert resolve_device_memory("25%", backend, 0) == 2 * GIB
    backend.limit_device_memory(2 * GIB, 0)
    assert backend.device_memory(0) == DeviceMemory(free=GIB, total=2 * GIB)
    assert resolve_device_memory("50%", backend, 0) == GIB  # of what the process sees now: the capped card


def test_fraction_cap_refuses_a_module_without_the_setter_naming_it() -> None:
    module = types.SimpleNamespace(__name__="torch.fakedev", mem_get_info=lambda device=None: (GIB, 2 * GIB))
    with pytest.raises(BackendError, match=r"backend fakedev cannot cap device memory: torch.fakedev has no "
                                           r"set_per_process_memory_fraction"):
        FractionCap("fakedev", lambda: module).limit(0, GIB)
    cap = FractionCap("fakedev", lambda: _Module())
    assert cap.device_memory(0) == DeviceMemory(free=11 * GIB, total=16 * GIB) and cap.caps() == {}


class _CapReportingModule(_Module):
    """A device module whose ``mem_get_info`` reports the process's fraction as the card (torch_magidev does), with
    ``get_device_properties`` giving the whole card."""

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        cap = int(self.fraction * self.total)
        return max(0, cap - self.allocated), cap

    def get_device_properties(self, device: int | None = None) -> Any:
        return types.SimpleNamespace(name="fakedev", total_memory=self.total)


def test_fraction_cap_changes_and_lifts_a_cap_where_mem_get_info_reports_the_cap() -> None:
    """The fraction is of the whole card, so a second cap and a lift (a cap at the card's size) are what they say,
    also where ``mem_get_info``'s total is the current cap."""
    module = _CapReportingModule(total=16 * GIB, allocated=GIB)
    cap = FractionCap("fakedev", lambda: module)
    cap.limit(0, 8 * GIB)
    assert module.fraction == 0.5 and cap.device_memory(0) == DeviceMemory(free=7 * GIB, total=8 * GIB)
    cap.limit(0, 4 * GIB)
    assert module.fraction == 0.25 and cap.device_memory(0) == DeviceMemory(free=3 * GIB, total=4 * GIB)
    cap.limit(0, 16 * GIB)
    assert module.fraction == 1.0 and cap.caps() == {} and cap.device_memory(0).total == 16 * GIB
    with pytest.raises(BackendError, match=r"the device has 17179869184 B \(16.00 GiB\)"):
        cap.limit(0, 17 * GIB)
    # a fraction set on the module directly counts as a cap of that share of the whole card
    module.get_per_process_memory_fraction = lambda device=None: module.fraction
    module.set_per_process_memory_fraction(0.125, 0)
    assert cap.device_memory(0) == DeviceMemory(free=GIB, total=2 * GIB)


def test_fraction_cap_takes_the_larger_total_where_a_module_has_both() -> None:
    """A CUDA-like module whose properties say less than ``mem_get_info``: the device's total stays the latter."""
    module = _Module(total=16 * GIB)
    module.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=15 * GIB)
    cap = FractionCap("fakedev", lambda: module)
    cap.limit(0, 16 * GIB)
    assert module.fraction == 1.0 and cap.caps() == {}


# -- sizes: bytes and percentages ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "parsed"), [
    (1000, (1000, None)), ("12GiB", (12 * GIB, None)), ("512 MiB", (512 * MIB, None)), ("16e9", (16 * 10**9, None)),
    ("80%", (None, 0.8)), (" 12.5 % ", (None, 0.125)), ("100%", (None, 1.0)),
])
def test_sizes_are_bytes_or_a_percentage(size: int | str, parsed: tuple[int | None, float | None]) -> None:
    assert parse_device_memory(size) == parsed


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "0", "lots", "12 parsecs", "0%", "150%", "nan%", "%", "-5%"])
def test_unreadable_sizes_are_config_errors(size: Any) -> None:
    with pytest.raises(ConfigError):
        parse_device_memory(size)


def test_parse_percent() -> None:
    assert parse_percent("50%") == 0.5
    with pytest.raises(ValueError, match="at most 100%"):
        parse_percent("101%")


# -- the active backend: the CPU refuses, magidev caps for real ---------------------------------------------------
def test_env_variable_is_known_and_unset_does_nothing() -> None:
    assert ENV_DEVICE_MEMORY == "MAGI_DEVICE_MEMORY" and ENV_DEVICE_MEMORY in _env.KNOWN_VARIABLES
    assert limit_device_memory_from_env({}) is None
    assert limit_device_memory_from_env({ENV_DEVICE_MEMORY: "  "}) is None
    with pytest.raises(ConfigError, match=r"^MAGI_DEVICE_MEMORY='lots'.*or unset it"):
        limit_device_memory_from_env({ENV_DEVICE_MEMORY: "lots"})


@pytest.fixture
def active() -> Iterator[Backend]:
    """The active backend; a cap set by the test is lifted afterwards."""
    backend = get_backend()
    before = backend.device_memory() if backend.can_limit_device_memory else None
    yield backend
    if before is not None:
        backend.limit_device_memory(before.total)


def test_a_backend_that_cannot_cap_says_so(active: Backend) -> None:
    if active.can_limit_device_memory:
        pytest.skip(f"backend {active.name} can cap device memory")
    for size in ("12GiB", "80%", 1 << 30):
        with pytest.raises(BackendError, match=f"^backend {active.name} cannot cap device memory"):
            magi_core.limit_device_memory(size)
    with pytest.raises(BackendError, match=f"^backend {active.name} cannot cap device memory"):
        limit_device_memory_from_env({ENV_DEVICE_MEMORY: "12GiB"})
    with pytest.raises(ConfigError):  # an unreadable size is named first, whatever the backend
        magi_core.limit_device_memory("twelve")


def test_a_cap_refuses_an_allocation_past_it_and_shows_in_device_memory(active: Backend) -> None:
    """On a backend that caps (magidev): 64 MiB over what is allocated, 32 MiB allocate, 96 MiB fail with OOM."""
    if not active.can_limit_device_memory:
        pytest.skip(f"backend {active.name} cannot cap device memory")
    dm = active.device_module
    dm.synchronize()
    held = int(getattr(dm, "memory_reserved", dm.memory_allocated)())
    cap = magi_core.limit_device_memory(held + 64 * MIB)
    assert cap == held + 64 * MIB
    seen = active.device_memory()
    assert seen is not None and seen.total == cap and seen.free <= 64 * MIB
    x = torch.empty(32 * MIB, dtype=torch.uint8, device=active.device())
    after = active.device_memory()
    assert after is not None and after.free <= seen.free - 32 * MIB
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(96 * MIB, dtype=torch.uint8, device=active.device())
    del x
    assert limit_device_memory_from_env({ENV_DEVICE_MEMORY: "100%"}) == cap  # 100% of the capped card: no change


def test_bench_under_a_cap_records_each_run_and_never_crashes(active: Backend) -> None:
    """``magi bench --device-memory``: the process is capped before the first allocation; a system that does not fit
    is a failed row with its error, every row carries the cap (magidev: a 24 MiB card, 17 MB of weights)."""
    if not active.can_limit_device_memory:
        pytest.skip(f"backend {active.name} cannot cap device memory")
    from magi_core.bench import BenchOptions, run_benchmark

    doc = run_benchmark(BenchOptions(models=("mlp",), systems=("resident_eager", "magi"), policies=("HEURISTIC",),
                                     ratios=(0.0,), budgets=(), magi_default=True, dtype="fp32", tokens=(16,), steps=3,
                                     warmup=1, mlp_hidden=256, mlp_layers=8, probe_bytes=1 << 16,
                                     overhead_probe=False, host_timing=False, device_memory="24MiB"), active)
    assert doc["device_memory"]["cap_bytes"] == 24 * MIB and doc["device_memory"]["seen"]["total"] == 24 * MIB
    rows = {r["label"]: r for r in doc["runs"]}
    assert set(rows) == {"resident_eager", "magi default", "magi HEURISTIC r=0"}
    assert all(r["device_cap_bytes"] == 24 * MIB and r["status"] in ("ok", "failed") for r in rows.values())
    assert all(r["reason"] for r in rows.values() if r["status"] == "failed")
