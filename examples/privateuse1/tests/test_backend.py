"""The magi backend for magidev: probing imports nothing, selection, host ranges, and offloaded models on the device."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import magi_backend_magidev
import pytest
import torch
import torch_magidev
from torch_magidev import checker

from magi_core.errors import HostRegisterError
from magi_core.plugin.manager import REGISTRY, use_backend


def _fresh(code: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def backend():
    b = use_backend("magidev")
    checker.clear()
    try:
        yield b
    finally:
        use_backend(None)


def test_probe_imports_nothing_and_never_renames():
    out = _fresh("""
        import json, sys, torch
        from magi_core.plugin.manager import REGISTRY
        rec = REGISTRY.records()["magidev"]
        print(json.dumps({"available": rec.available, "priority": rec.probe.priority,
                          "imported": "torch_magidev" in sys.modules,
                          "name": torch._C._get_privateuse1_backend_name()}))
    """)
    assert out == {"available": True, "priority": -5, "imported": False, "name": "privateuseone"}


def test_probe_reports_no_device_and_cpu_stays_the_automatic_choice():
    out = _fresh("""
        import json
        from magi_core.plugin.manager import REGISTRY, get_backend
        rec = REGISTRY.records()["magidev"]
        print(json.dumps({"available": rec.available, "reason": rec.why_unavailable, "auto": get_backend().name}))
    """, MAGIDEV_DEVICE_COUNT="0", MAGI_BACKEND="")
    assert out["available"] is False and "MAGIDEV_DEVICE_COUNT=0" in out["reason"] and out["auto"] == "cpu"


def test_selection_binds_torch_magidev(backend):
    assert backend.name == "magidev" and backend.device_type == "magidev" and backend.is_accelerator
    assert backend.device_module is torch_magidev is torch.magidev
    assert backend.device() == torch.device("magidev", 0)
    assert backend.to_method_aliases == ("to",)
    missing = REGISTRY.records()["magidev"].missing_optional
    assert not {"magi_range_push", "magi_range_pop", "magi_to_method_aliases"} & set(missing)


def test_device_memory_hooks_cap_the_device(backend):
    """magi_device_memory reads torch.magidev.mem_get_info; magi_limit_device_memory caps it (a smaller card)."""
    from magi_core.errors import BackendError
    from magi_core.plugin import DeviceMemory

    torch_magidev.synchronize()
    total = torch_magidev.total_memory()
    held = torch_magidev.memory_allocated()
    assert magi_backend_magidev.magi_device_memory(device_index=0) == DeviceMemory(free=total - held, total=total)
    magi_backend_magidev.magi_limit_device_memory(device_index=0, nbytes=held + (4 << 20))
    try:
        assert backend.device_memory() == DeviceMemory(free=4 << 20, total=held + (4 << 20))
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(5 << 20, dtype=torch.uint8, device="magidev")
        with pytest.raises(BackendError, match="cannot cap magidev:0 at .* MAGIDEV_TOTAL_MEMORY"):
            backend.limit_device_memory(total + 1)
    finally:
        backend.limit_device_memory(total)
    assert backend.device_memory().total == total


def test_fraction_cap_over_torch_magidev_changes_and_lifts_caps(backend):
    """magi_core.plugin.FractionCap, as a backend author would bind it to torch.magidev (whose mem_get_info reports
    the cap as the total): caps are fractions of the whole device, a second cap replaces the first, the device's size
    lifts it."""
    from magi_core.plugin import FractionCap

    cap = FractionCap("magidev", lambda: torch_magidev)
    total = torch_magidev.get_device_properties(0).total_memory
    assert total == torch_magidev.total_memory()
    try:
        cap.limit(0, total // 2)
        cap.limit(0, total // 4)
        assert torch_magidev.get_per_process_memory_fraction() == pytest.approx(0.25)
        assert torch_magidev.mem_get_info()[1] == total // 4 and cap.device_memory(0).total == total // 4
        cap.limit(0, total)
        assert torch_magidev.get_per_process_memory_fraction() == 1.0 and cap.caps() == {}
    finally:
        torch_magidev.set_per_process_memory_fraction(1.0)
    assert cap.device_memory(0).total == total


def test_host_register_round_trip_uses_the_runtime_table(backend):
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    ptr = buf.data_ptr()
    before = magi_backend_magidev.registered_ranges()
    backend.host_register(ptr, buf.numel())
    backend.host_register(ptr, buf.numel())  # already registered: success
    assert torch_magidev.runtime().registered_ranges()[ptr] == buf.numel()
    assert magi_backend_magidev.registered_ranges()[ptr] == buf.numel()
    backend.host_unregister(ptr)
    assert magi_backend_magidev.registered_ranges() == before
    with pytest.raises(HostRegisterError) as info:
        backend.host_unregister(ptr)
    assert info.value.code == 713
    with pytest.raises(HostRegisterError):
        backend.host_register(0, 16)


def test_ranges_are_profiler_spans(backend):
    with torch.profiler.profile() as prof:
        with backend.range("magidev-outer"):
            backend.range_push("magidev-inner")
            backend.range_pop()
    names = {e.name for e in prof.events()}
    assert {"magidev-outer", "magidev-inner"} <= names


def test_offloaded_model_runs_on_the_device_sees_weight_edits_and_frees(backend, tmp_path, monkeypatch):
    import magi_core
    from magi_core.bench.models import TransformerSpec, build_transformer, example_input

    monkeypatch.setenv("MAGI_SHM_DIR", str(tmp_path))
    torch._dynamo.reset()
    gc.collect()
    base = torch_magidev.memory_allocated()
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec).eval()
    x = example_input(spec, tokens=6)
    with torch.no_grad():
        ref = model(x)
    cfg = magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5, unit_compiler="eager",
                                  bandwidth_probe_bytes=1 << 20)
    magi_core.offload(model, cfg)
    try:
        with torch.no_grad():
            for _ in range(4):
                out = model(x)
                assert out.device == torch.device("magidev", 0)
                torch.testing.assert_close(out.cpu(), ref)
            assert torch_magidev.memory_allocated() > base, "resident weights live on the device"
            for p in model.parameters():  # an in-place edit on the host: every device copy must follow
                p.mul_(0.5)
        model_ref = build_transformer(spec).eval()
        model_ref.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            ref2 = model_ref(x)
            assert not torch.allclose(ref2, ref)
            for _ in range(2):
                torch.testing.assert_close(model(x).cpu(), ref2)
    finally:
        magi_core.release(model, restore=True)
        torch._dynamo.reset()
    del out
    gc.collect()
    assert torch_magidev.memory_allocated() == base, "release frees every device copy"
    checker.assert_clean()


def test_selected_once_torch_reports_the_device() -> None:
    """After ``import torch_magidev`` torch reports a magidev accelerator: selection picks its backend, although
    it ranks below the CPU backend (which only keeps it from being chosen while the device is absent)."""
    import subprocess
    import sys

    code = (
        "import torch_magidev, magi_core\n"
        "b = magi_core.get_backend()\n"
        "print(b.name, b.selected_by)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "MAGI_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "magidev"


def test_default_config_offload_runs_eager_units_on_the_device(backend, tmp_path, monkeypatch):
    """``magi_core.offload(model)`` with no config on a device Inductor cannot compile for: "auto" picks eager
    units and no direct calls from the backend's (default) capabilities, and the answer is right."""
    import magi_core
    from magi_core.bench.models import TransformerSpec, build_transformer, example_input

    monkeypatch.setenv("MAGI_SHM_DIR", str(tmp_path))
    monkeypatch.delenv("MAGI_OFFLOAD_UNIT_COMPILER", raising=False)
    monkeypatch.setenv("MAGI_OFFLOAD_BANDWIDTH_PROBE_BYTES", "1MiB")
    torch._dynamo.reset()
    assert backend.resolve_unit_compiler("auto") == "eager" and not backend.allows_direct_unit_calls(True)
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec).eval()
    x = example_input(spec, tokens=6)
    with torch.no_grad():
        ref = model(x)
    magi_core.offload(model)
    try:
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(model(x).cpu(), ref)
        ex = magi_core.handle(model).runtime.executor
        assert not any(ex.direct_units), "generated code is never called directly on this device"
    finally:
        magi_core.release(model, restore=True)
        torch._dynamo.reset()
    checker.assert_clean()
