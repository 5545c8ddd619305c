"""The CUDA backend: probe refusals and host-register checks that run anywhere, plus accelerator tests."""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import textwrap
import types

import magi_backend_cuda
import pytest
import torch
from magi_backend_cuda import ranges, runtime

from magi_core.errors import HostRegisterError
from magi_core.plugin import Capabilities, host_ranges
from magi_core.plugin.manager import REGISTRY


def _cuda_usable() -> bool:
    rec = REGISTRY.records().get("cuda")
    return rec is not None and rec.available


needs_cuda = pytest.mark.skipif(not _cuda_usable(), reason="no usable CUDA device (magi backend 'cuda' unavailable)")


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hookspec_versions_and_aliases() -> None:
    """Spec major 1; Tensor.to appears only as "to"."""
    assert tuple(magi_backend_cuda.magi_hookspec_versions()) == ("1",)
    assert tuple(magi_backend_cuda.magi_to_method_aliases()) == ("to",)


def test_import_and_probe_do_not_initialise_cuda() -> None:
    """Importing the module and probing leave CUDA uninitialised (fresh interpreter)."""
    out = _run("""
        import json, torch
        import magi_backend_cuda
        probe = magi_backend_cuda.magi_probe()
        print(json.dumps({"init": torch.cuda.is_initialized(), "type": probe.device_type, "prio": probe.priority}))
    """)
    assert out == {"init": False, "type": "cuda", "prio": 100}


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the refusal on a torch build without CUDA")
def test_probe_refuses_torch_without_cuda() -> None:
    """A CPU build of torch: unavailable, saying the build has no CUDA."""
    probe = magi_backend_cuda.magi_probe()
    assert not probe.available
    assert probe.reason is not None and probe.reason.startswith("torch build has no CUDA")


def test_probe_refuses_a_remapped_torch_cuda() -> None:
    """torch.cuda replaced by an adapter's module (torchada-style): refused, naming the remap."""
    out = _run("""
        import json, sys, types, torch
        shim = types.ModuleType("torchada.cuda")
        shim.device_count = lambda: 1
        torch.cuda = shim
        torch.version.cuda = torch.version.cuda or "12.8"
        accel = torch.accelerator.current_accelerator()
        if accel is not None and accel.type != "cuda":
            raise SystemExit("unexpected accelerator")
        import magi_backend_cuda
        p = magi_backend_cuda.magi_probe()
        print(json.dumps({"available": p.available, "reason": p.reason}))
    """)
    assert out["available"] is False
    assert "remapped onto 'torchada.cuda'" in out["reason"]


def test_probe_refuses_when_torch_accelerator_is_another_device() -> None:
    """torch's accelerator is another device type (PrivateUse1 renamed): refused, naming it."""
    out = _run("""
        import json, types, torch
        torch.utils.rename_privateuse1_backend("otherdev")
        m = types.ModuleType("otherdev_mod"); m.is_available = lambda: True; m.device_count = lambda: 1
        torch._register_device_module("otherdev", m)
        torch.version.cuda = torch.version.cuda or "12.8"
        import magi_backend_cuda
        p = magi_backend_cuda.magi_probe()
        print(json.dumps({"available": p.available, "reason": p.reason}))
    """)
    if torch.version.cuda is not None and out["available"]:
        pytest.skip("a CUDA build keeps cuda as its compile-time accelerator")
    assert out["available"] is False
    assert "'otherdev'" in out["reason"]


def _fake_triton() -> types.ModuleType:
    mod = types.ModuleType("triton")
    mod.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    return mod


def test_capabilities_declare_inductor_and_direct_calls_where_triton_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spec 1.1: Inductor units called directly ("auto" compiles them); without Triton, eager with the reason."""
    monkeypatch.setitem(sys.modules, "triton", _fake_triton())
    caps = magi_backend_cuda.magi_capabilities()
    assert isinstance(caps, Capabilities)
    assert (caps.inductor, caps.default_unit_compiler, caps.direct_unit_calls) == (True, "inductor", True)
    monkeypatch.setitem(sys.modules, "triton", None)  # not importable
    caps = magi_backend_cuda.magi_capabilities()
    assert (caps.inductor, caps.default_unit_compiler, caps.direct_unit_calls) == (False, "eager", False)
    assert caps.reason is not None and "pip install triton" in caps.reason


def test_capabilities_do_not_initialise_cuda() -> None:
    """Asking for the capabilities (fresh interpreter) touches no CUDA API."""
    out = _run("""
        import json, torch
        import magi_backend_cuda
        caps = magi_backend_cuda.magi_capabilities()
        print(json.dumps({"init": torch.cuda.is_initialized(), "type": type(caps).__name__}))
    """)
    assert out == {"init": False, "type": "Capabilities"}


def test_invalid_and_unknown_ranges_raise_without_touching_the_runtime() -> None:
    """Bad arguments and never-registered ranges raise HostRegisterError before any runtime call."""
    with pytest.raises(HostRegisterError):
        magi_backend_cuda.magi_host_register(ptr=0, nbytes=16)
    t = torch.ones(4)
    with pytest.raises(HostRegisterError) as info:
        magi_backend_cuda.magi_host_unregister(ptr=t.data_ptr())
    assert info.value.code == host_ranges.NOT_REGISTERED
    assert runtime.registered_ranges() == {}


class FakeCudart:
    """``torch.cuda.cudart()`` stand-in: a real table of pinned ranges, CUDA's answers (0/712/713), calls counted."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - binding name
        self.calls.append("cudaHostRegister")
        if any(ptr < start + size and start < ptr + nbytes for start, size in self.pinned.items()):
            return 712
        self.pinned[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - binding name
        self.calls.append("cudaHostUnregister")
        return 0 if self.pinned.pop(ptr, None) is not None else 713

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802 - binding name
        return {712: "part or all of the requested memory range is already mapped",
                713: "pointer does not correspond to a registered memory region"}.get(int(err), "error")


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """The CUDA backend's table over :class:`FakeCudart` (no GPU needed); ``drains`` counts pending-error drains."""
    rt = FakeCudart()
    rt.drains = 0  # type: ignore[attr-defined]

    def drain() -> bool:
        rt.drains += 1  # type: ignore[attr-defined]
        return True

    monkeypatch.setattr(runtime, "_cudart", lambda: rt)
    monkeypatch.setattr(runtime, "drain_last_error", drain)
    yield rt
    assert runtime.registered_ranges() == {}, "a test left a range held by the CUDA backend's table"


def test_a_range_someone_else_registered_is_left_registered(fake_cudart: FakeCudart) -> None:
    """CUDA answers 712 (torch's pinned allocator or a library pinned it): accepted, drained, never unregistered."""
    t = torch.ones(1024)
    ptr = t.data_ptr()
    assert fake_cudart.cudaHostRegister(ptr, 4096, 0) == 0  # someone else's registration
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=4096)
    magi_backend_cuda.magi_host_unregister(ptr=ptr)
    assert fake_cudart.calls == ["cudaHostRegister", "cudaHostRegister"], "unregister reached cudaHostUnregister"
    assert fake_cudart.pinned == {ptr: 4096}, "our unregister removed the other component's registration"
    assert fake_cudart.drains == 1  # type: ignore[attr-defined]  # the 712's pending error


def test_a_sub_range_never_reaches_cuda(fake_cudart: FakeCudart) -> None:
    """Inside a range the backend holds: no cudaHostRegister (712) and no cudaHostUnregister (713), in either order."""
    t = torch.ones(4096)
    ptr = t.data_ptr()
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=16384)
    magi_backend_cuda.magi_host_register(ptr=ptr + 4096, nbytes=4096)
    magi_backend_cuda.magi_host_register(ptr=ptr + 8192, nbytes=4096)
    assert fake_cudart.calls == ["cudaHostRegister"]
    assert runtime.range_origins() == {ptr: "registered", ptr + 4096: "covered", ptr + 8192: "covered"}
    magi_backend_cuda.magi_host_unregister(ptr=ptr + 4096)
    magi_backend_cuda.magi_host_unregister(ptr=ptr)
    magi_backend_cuda.magi_host_unregister(ptr=ptr + 8192)
    assert fake_cudart.calls == ["cudaHostRegister", "cudaHostUnregister"]
    assert fake_cudart.pinned == {} and fake_cudart.drains == 0  # type: ignore[attr-defined]


def test_a_range_straddling_a_held_one_goes_to_cuda_and_is_found(fake_cudart: FakeCudart) -> None:
    """Not inside a held range: CUDA decides (712), the error is drained, and unregister leaves CUDA alone."""
    t = torch.ones(4096)
    ptr = t.data_ptr()
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=8192)
    magi_backend_cuda.magi_host_register(ptr=ptr + 4096, nbytes=8192)
    magi_backend_cuda.magi_host_unregister(ptr=ptr + 4096)
    assert fake_cudart.pinned == {ptr: 8192}
    magi_backend_cuda.magi_host_unregister(ptr=ptr)
    assert fake_cudart.calls == ["cudaHostRegister", "cudaHostRegister", "cudaHostUnregister"]
    assert fake_cudart.drains == 1  # type: ignore[attr-defined]


@pytest.mark.skipif(ranges.available(), reason="checks the no-NVTX path")
def test_ranges_are_noops_without_nvtx() -> None:
    """Without NVTX in the build, push/pop do nothing and do not raise."""
    magi_backend_cuda.magi_range_push(name="x")
    magi_backend_cuda.magi_range_pop()


# -- accelerator tests (marked `accelerator`: run on a host with an NVIDIA GPU) ----------------------


@pytest.mark.accelerator
@needs_cuda
def test_nvtx_available_on_cuda_build() -> None:
    """A CUDA build of torch has NVTX, and push/pop report matching depths."""
    assert ranges.available()
    depth = torch.cuda.nvtx.range_push("magi-nvtx-check")
    assert torch.cuda.nvtx.range_pop() == depth


@pytest.mark.accelerator
@needs_cuda
def test_712_from_runtime_is_success_and_drained() -> None:
    """A range registered behind the backend's back: 712 is success and kernels still launch afterwards."""
    t = torch.ones(1 << 16)
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(ptr, nbytes, 0)) == 0
    try:
        magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=nbytes)
        x = torch.ones(8, device="cuda") * 2  # a launch check would raise a stale 712 if it were not drained
        torch.cuda.synchronize()
        assert float(x.sum()) == 16.0
        dev = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), t)
    finally:
        magi_backend_cuda.magi_host_unregister(ptr=ptr)
        # the registration was someone else's (ours, through cudart): the backend left it, so it is still there
        assert int(rt.cudaHostUnregister(ptr)) == 0, "the backend's unregister removed a registration it did not make"
    assert runtime.registered_ranges() == {}


@pytest.mark.accelerator
@needs_cuda
def test_sub_range_and_pinned_allocator_memory_on_cuda() -> None:
    """On the GPU: a sub-range never reaches CUDA alone; memory torch's pinned allocator pinned stays pinned."""
    t = torch.ones(1 << 16)
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=nbytes)
    magi_backend_cuda.magi_host_register(ptr=ptr + 4096, nbytes=8192)  # CUDA would answer 712
    magi_backend_cuda.magi_host_unregister(ptr=ptr + 4096)  # CUDA would answer 713
    assert t.is_pinned()
    magi_backend_cuda.magi_host_unregister(ptr=ptr)
    assert not t.is_pinned()
    p = torch.ones(1 << 16).pin_memory()  # cudaHostAlloc'd: CUDA may refuse to register it again (error 1)
    try:
        magi_backend_cuda.magi_host_register(ptr=p.data_ptr(), nbytes=p.numel() * 4)
    except HostRegisterError:
        origin = "refused"
    else:
        origin = runtime.range_origins()[p.data_ptr()]
    x = torch.ones(8, device="cuda") * 3  # nothing left pending either way
    torch.cuda.synchronize()
    if origin != "refused":
        magi_backend_cuda.magi_host_unregister(ptr=p.data_ptr())
    assert p.is_pinned(), f"our register/unregister unpinned torch's pinned-allocator memory (held as {origin!r})"
    assert float(x.sum()) == 24.0 and torch.equal(p.to("cuda", non_blocking=True).cpu(), p)
    assert runtime.registered_ranges() == {}


@pytest.mark.accelerator
@needs_cuda
def test_cuda_refuses_one_copy_from_two_registrations() -> None:
    """The runtime rule magi-core's unit transfer splits its copies for: two adjacent registered ranges are two
    registrations, and one copy that runs from the first into the second fails (invalid argument); copies inside
    each succeed. (magi_core.plugin.registered; the magidev emulation enforces the same rule.)"""
    page = 4096
    raw = torch.arange(4 * page + page, dtype=torch.uint8)
    at = -raw.data_ptr() % page
    buf = raw[at:at + 4 * page]
    ptr = buf.data_ptr()
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=2 * page)
    magi_backend_cuda.magi_host_register(ptr=ptr + 2 * page, nbytes=2 * page)
    try:
        dev = torch.empty(4 * page, dtype=torch.uint8, device="cuda")
        dev[:2 * page].copy_(buf[:2 * page], non_blocking=True)
        dev[2 * page:].copy_(buf[2 * page:], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), buf)
        with pytest.raises(Exception, match="invalid argument"):
            dev.copy_(buf, non_blocking=True)
            torch.cuda.synchronize()
        runtime.drain_last_error()  # torch reports the refusal; nothing may stay pending for the next launch
    finally:
        magi_backend_cuda.magi_host_unregister(ptr=ptr + 2 * page)
        magi_backend_cuda.magi_host_unregister(ptr=ptr)
    x = torch.ones(8, device="cuda") * 3  # the refusal left nothing pending
    assert float(x.sum()) == 24.0 and runtime.registered_ranges() == {}


@pytest.mark.accelerator
@needs_cuda
def test_pinned_allocator_using_cuda_host_register_keeps_its_registration() -> None:
    """torch's pinned allocator registering with cudaHostRegister itself: our 712 range is theirs, left to them."""
    out = _run("""
        import os
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:True,pinned_num_register_threads:1"
        import json, torch
        import magi_backend_cuda
        from magi_backend_cuda import runtime
        p = torch.ones(1 << 20).pin_memory()  # malloc + cudaHostRegister (PYTORCH_CUDA_ALLOC_CONF below)
        magi_backend_cuda.magi_host_register(ptr=p.data_ptr(), nbytes=p.numel() * 4)
        origin = runtime.range_origins()[p.data_ptr()]
        x = torch.ones(8, device="cuda") * 2
        torch.cuda.synchronize()
        magi_backend_cuda.magi_host_unregister(ptr=p.data_ptr())
        pinned = p.is_pinned()
        ok = torch.equal(p.to("cuda", non_blocking=True).cpu(), p)
        del p  # torch's allocator unregisters its block on empty_cache: it must still be registered
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
        print(json.dumps({"origin": origin, "pinned": pinned, "ok": ok, "sum": float(x.sum())}))
    """)
    assert out == {"origin": "found", "pinned": True, "ok": True, "sum": 16.0}


@pytest.mark.accelerator
@needs_cuda
def test_713_from_runtime_raises_with_runtime_text_and_is_drained() -> None:
    """A range unregistered behind the backend's back: 713 raises with CUDA's own text; kernels still launch."""
    t = torch.ones(1 << 16)
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    magi_backend_cuda.magi_host_register(ptr=ptr, nbytes=nbytes)
    assert int(torch.cuda.cudart().cudaHostUnregister(ptr)) == 0
    with pytest.raises(HostRegisterError) as info:
        magi_backend_cuda.magi_host_unregister(ptr=ptr)
    assert info.value.code == 713
    assert "713" in str(info.value) and "registered" in str(info.value).lower()
    x = torch.ones(8, device="cuda") + 1
    torch.cuda.synchronize()
    assert float(x.sum()) == 16.0
    assert runtime.registered_ranges() == {}


@pytest.mark.accelerator
@needs_cuda
def test_drain_reaches_the_loaded_runtime() -> None:
    """The CUDA runtime torch loaded is reachable for draining (no library is loaded anew)."""
    torch.cuda.init()
    assert runtime.drain_last_error() is True


@pytest.mark.accelerator
@needs_cuda
def test_auto_compiles_units_with_inductor_and_calls_them_directly_on_cuda() -> None:
    """On a CUDA machine (Triton ships with CUDA builds of torch) "auto" means Inductor units, called directly."""
    from magi_core.plugin.manager import use_backend

    backend = use_backend("cuda")
    try:
        assert backend is not None and backend.capabilities.inductor
        assert backend.resolve_unit_compiler("auto") == "inductor"
        assert backend.allows_direct_unit_calls(True)
    finally:
        use_backend(None)
