"""The emulated magidev device: distinct memory, factories, streams and events, memory counters, the runtime."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch_magidev
from torch_magidev import checker

DEV = torch.device("magidev", 0)


@pytest.fixture(autouse=True)
def _clean_checker():
    checker.clear()
    yield
    checker.clear()


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object on its last line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_installs_the_device_without_initialising_it():
    out = _fresh("""
        import json, torch, torch_magidev
        r = {"init": torch_magidev.is_initialized(), "module": torch.get_device_module("magidev") is torch_magidev,
             "accel": str(torch.accelerator.current_accelerator()), "name": torch._C._get_privateuse1_backend_name()}
        torch.ones(2, device="magidev")
        r["init_after_alloc"] = torch_magidev.is_initialized()
        print(json.dumps(r))
    """)
    assert out == {"init": False, "module": True, "accel": "magidev", "name": "magidev", "init_after_alloc": True}


def test_import_refuses_a_privateuse1_backend_already_named():
    out = _fresh("""
        import json, torch
        torch.utils.rename_privateuse1_backend("musa")
        try:
            import torch_magidev
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc)}))
        else:
            print(json.dumps({"error": None}))
    """)
    assert out["error"] and "already named 'musa'" in out["error"]
    assert "one PrivateUse1 backend per process" in out["error"]


def test_copies_are_distinct_memory():
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    dev = host.to("magidev")
    assert dev.device == DEV and type(dev).__name__ == "MagidevTensor"
    host.add_(100)  # the host changes after the copy: the device copy must not
    assert torch.equal(dev.cpu(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    dev.mul_(2)  # and the other way round
    assert torch.equal(host, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100)
    back = dev.cpu()
    back.zero_()
    assert torch.equal(dev.cpu(), torch.arange(6, dtype=torch.float32).reshape(2, 3) * 2)
    target = torch.zeros(2, 3, device="magidev")
    target.copy_(host, non_blocking=True)
    host.zero_()
    assert target.cpu().sum().item() == float(sum(range(6)) + 600)
    stats = torch_magidev.stats()
    assert stats["h2d_copies"] >= 2 and stats["d2h_copies"] >= 3


def test_views_alias_on_the_device_and_ops_compute():
    a = torch.arange(12.0).reshape(3, 4).to("magidev")
    row = a[1]
    row.fill_(-1)
    assert torch.equal(a.cpu()[1], torch.full((4,), -1.0))
    b = (a.t() @ a).relu().sum(0)
    ref = a.cpu().t() @ a.cpu()
    torch.testing.assert_close(b.cpu(), ref.relu().sum(0))
    assert b.device == DEV and a.to(torch.float16).device == DEV
    assert a[0, 0].item() == 0.0


def test_factories_allocate_on_the_device():
    made = {
        "empty": torch.empty(2, 3, device="magidev"),
        "zeros": torch.zeros(2, 3, device="magidev"),
        "ones": torch.ones(2, 3, device="magidev"),
        "full": torch.full((2, 3), 1.5, device="magidev"),
        "arange": torch.arange(5, device="magidev"),
        "eye": torch.eye(3, device="magidev"),
        "tensor": torch.tensor([1.0, 2.0], device="magidev"),
        "randn": torch.randn(4, device="magidev"),
        "linspace": torch.linspace(0, 1, 5, device="magidev"),
        "tril_indices": torch.tril_indices(3, 3, device="magidev"),
    }
    for name, t in made.items():
        assert t.device == DEV, name
    assert made["arange"].shape == (5,) and torch.equal(made["arange"].cpu(), torch.arange(5))
    assert made["eye"].shape == (3, 3) and torch.equal(made["eye"].cpu(), torch.eye(3))
    assert torch.equal(made["tensor"].cpu(), torch.tensor([1.0, 2.0]))
    assert torch.equal(made["full"].cpu(), torch.full((2, 3), 1.5))


def test_mixing_with_host_tensors_raises_like_an_accelerator():
    d = torch.ones(3, device="magidev")
    with pytest.raises(RuntimeError, match="two devices, magidev:0 and cpu"):
        d + torch.ones(3)
    assert torch.equal((d * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))  # a 0-dim host scalar is fine


def test_streams_events_and_record_stream():
    default = torch_magidev.current_stream()
    assert default.stream_id == 0 and default == torch_magidev.default_stream()
    side = torch_magidev.Stream()
    assert isinstance(side, torch.Stream) and side.device == DEV and side != default
    with torch_magidev.stream(side):
        assert torch_magidev.current_stream() == side
    assert torch_magidev.current_stream() == default
    t = torch.ones(4, device="magidev")
    t.record_stream(side)  # accepted: a torch.Stream of device type magidev
    start, end = torch_magidev.Event(enable_timing=True), torch_magidev.Event(enable_timing=True)
    start.record()
    (t @ t).item()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0 and end.query()
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch_magidev.Event().elapsed_time(end)


def _used_on(side: torch_magidev.Stream, record: bool) -> None:
    """Allocate on the current stream, use the tensor on ``side`` (ordered after the allocation), drop it."""
    t = torch.ones(1024, device="magidev")
    side.wait_stream(torch_magidev.current_stream())
    with torch_magidev.stream(side):
        t.mul_(2)
    if record:
        t.record_stream(side)
    del t


def test_checker_flags_a_free_without_record_stream_and_accepts_one_with_it():
    side = torch_magidev.Stream()
    _used_on(side, record=True)
    assert checker.violations() == []
    _used_on(side, record=False)
    (v,) = checker.violations()
    assert v.kind == "free" and "record_stream" in v.message and v.other == side.key
    checker.clear()
    t = torch.ones(1024, device="magidev")  # ordered instead: the allocation stream waits for side's work
    side.wait_stream(torch_magidev.current_stream())
    with torch_magidev.stream(side):
        t.mul_(2)
    torch_magidev.current_stream().wait_stream(side)
    del t
    assert checker.violations() == []


def test_checker_flags_a_read_before_the_copy_is_waited_for():
    side = torch_magidev.Stream()
    host = torch.randn(256)
    with torch_magidev.stream(side):
        dev = host.to("magidev", non_blocking=True)
        done = torch_magidev.Event()
        done.record(side)
    (dev * 2).sum()  # the default stream did not wait for the copy
    assert [v.kind for v in checker.violations()] == ["read"] and "wait" in checker.violations()[0].message
    checker.clear()
    torch_magidev.current_stream().wait_event(done)
    (dev * 2).sum()
    dev.record_stream(torch_magidev.current_stream())
    del dev
    assert checker.violations() == []


def test_checker_flags_an_overwrite_while_another_stream_may_read():
    side = torch_magidev.Stream()
    buf = torch.zeros(64, device="magidev")
    side.wait_stream(torch_magidev.current_stream())
    with torch_magidev.stream(side):
        buf.sum()  # read on side
    buf.fill_(1.0)  # overwritten on the default stream, which never waited for side
    assert [v.kind for v in checker.violations()] == ["overwrite"]
    checker.clear()
    torch_magidev.current_stream().wait_stream(side)
    buf.fill_(2.0)
    torch_magidev.synchronize()
    del buf
    assert checker.violations() == []


def test_host_synchronize_orders_everything():
    side = torch_magidev.Stream()
    t = torch.ones(16, device="magidev")
    side.wait_stream(torch_magidev.current_stream())
    with torch_magidev.stream(side):
        t.add_(1)
    side.synchronize()  # the host waited for side: freeing on the default stream is safe
    del t
    assert checker.violations() == []


def test_strict_mode_raises():
    side = torch_magidev.Stream()
    with checker.strict():
        with torch_magidev.stream(side):
            dev = torch.ones(8)
            dev = dev.to("magidev")
        with pytest.raises(torch_magidev.StreamOrderError, match="reads"):
            dev.sum()
        side.wait_stream(torch_magidev.current_stream())
        torch_magidev.current_stream().wait_stream(side)
        t = torch.ones(8, device="magidev")
        side.wait_stream(torch_magidev.current_stream())
        with torch_magidev.stream(side):
            t.add_(1)
        del t  # freed without record_stream: found in the finalizer, raised at the next magidev call
        with pytest.raises(torch_magidev.StreamOrderError, match="freed"):
            torch_magidev.synchronize()


def test_memory_counters_track_live_bytes():
    torch_magidev.synchronize()
    base = torch_magidev.memory_allocated()
    torch_magidev.reset_peak_memory_stats()
    a = torch.empty(1000, dtype=torch.float32, device="magidev")
    assert torch_magidev.memory_allocated() == base + 4000
    view = a[10:20]  # a view shares its base's block: no new bytes
    assert torch_magidev.memory_allocated() == base + 4000
    b = torch.empty(250, dtype=torch.float64, device="magidev")
    assert torch_magidev.memory_allocated() == base + 6000
    del a
    assert torch_magidev.memory_allocated() == base + 6000, "the view keeps the block alive"
    del view
    assert torch_magidev.memory_allocated() == base + 2000
    assert torch_magidev.max_memory_allocated() == base + 6000
    free, total = torch_magidev.mem_get_info()
    assert total == free + torch_magidev.memory_allocated() and total > 0
    del b
    assert torch_magidev.memory_allocated() == base
    torch_magidev.reset_peak_memory_stats()
    assert torch_magidev.max_memory_allocated() == base


def test_a_memory_fraction_caps_the_process_like_a_smaller_card():
    """set_per_process_memory_fraction: past the cap an allocation (a factory, a copy, an op's output) raises
    torch.OutOfMemoryError and nothing is counted; mem_get_info reports the cap; 1.0 lifts it."""
    torch_magidev.synchronize()
    total = torch_magidev.total_memory()
    held = torch_magidev.memory_allocated()
    cap = held + (8 << 20)
    torch_magidev.set_per_process_memory_fraction(cap / total)
    try:
        assert torch_magidev.mem_get_info() == (8 << 20, cap)
        assert torch_magidev.get_per_process_memory_fraction() == pytest.approx(cap / total)
        a = torch.empty(6 << 20, dtype=torch.uint8, device="magidev")
        for make in (lambda: torch.empty(4 << 20, dtype=torch.uint8, device="magidev"),
                     lambda: torch.ones(4 << 20, dtype=torch.uint8).to("magidev"),
                     lambda x=a: torch.cat([x, x])):
            with pytest.raises(torch.OutOfMemoryError, match="magidev out of memory.*capped at"):
                make()
            assert torch_magidev.memory_allocated() == held + (6 << 20)
        b = a[: 1 << 20] + 1  # 1 MiB more still fits
        assert torch_magidev.mem_get_info() == ((8 << 20) - (7 << 20), cap)
        del a, b
    finally:
        torch_magidev.set_per_process_memory_fraction(1.0)
    assert torch_magidev.mem_get_info()[1] == total and torch_magidev.get_per_process_memory_fraction() == 1.0
    with pytest.raises(ValueError, match="Allowed range"):
        torch_magidev.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError, match="must be `float`"):
        torch_magidev.set_per_process_memory_fraction(1)


def test_runtime_host_register_error_codes():
    rt = torch_magidev.runtime()
    buf = torch.empty(4096, dtype=torch.uint8)
    ptr = buf.data_ptr()
    assert rt.magidevHostRegister(ptr, 4096, 0) == 0
    assert rt.magidevHostRegister(ptr + 16, 64, 0) == 712  # overlaps: already registered
    assert rt.magidevGetLastError() == 712 and rt.magidevGetLastError() == 0
    assert rt.registered_ranges()[ptr] == 4096
    assert rt.magidevHostUnregister(ptr) == 0
    assert rt.magidevHostUnregister(ptr) == 713
    assert rt.magidevHostRegister(0, 16, 0) == 1
    assert "not correspond" in rt.magidevGetErrorString(713)


def test_a_copy_across_a_registrations_bound_fails_as_on_cuda():
    rt = torch_magidev.runtime()
    buf = torch.arange(2048, dtype=torch.float32)  # 8 KiB: two registrations of 4 KiB, back to back
    ptr = buf.data_ptr()
    assert rt.magidevHostRegister(ptr, 4096, 0) == 0
    assert rt.magidevHostRegister(ptr + 4096, 4096, 0) == 0
    try:
        dev = torch.empty(2048, device="magidev")
        dev[:1024].copy_(buf[:1024])  # inside one registration
        dev[1024:].copy_(buf[1024:], non_blocking=True)
        assert torch.equal(dev.cpu(), buf)
        with pytest.raises(RuntimeError, match="invalid argument"):
            dev.copy_(buf)  # from one registration into the next
        assert rt.magidevGetLastError() == 1
        with pytest.raises(RuntimeError, match="invalid argument"):
            buf.copy_(dev)  # device to host is checked the same way
        rt.magidevHostUnregister(ptr + 4096)
        with pytest.raises(RuntimeError, match="invalid argument"):
            dev.copy_(buf)  # out of a registration into pageable memory
        rt.magidevGetLastError()
    finally:
        for p in (ptr, ptr + 4096):
            rt.magidevHostUnregister(p)
    dev.copy_(buf)  # nothing registered: a pageable copy
    assert torch.equal(dev.cpu(), buf)


def test_compiled_function_on_device_tensors():
    def fn(x):
        return torch.relu(x * 2 - 1).sum(0)

    x = torch.randn(4, 3, device="magidev")
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend="eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert out.device == DEV
    torch.testing.assert_close(out.cpu(), fn(x.cpu()))
