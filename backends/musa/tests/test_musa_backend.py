"""The MUSA backend against the torch_musa emulation (``tests/fakes``): every run says "emulated"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import magi_backend_musa  # noqa: E402
from _emulation import run_emulated, run_emulated_argv  # noqa: E402
from magi_backend_musa import ranges  # noqa: E402

from magi_core.errors import BackendError  # noqa: E402


def _json_out(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_does_not_import_torch_musa_or_touch_device() -> None:
    """Importing the backend module leaves torch_musa unimported (only the probe imports it)."""
    proc = run_emulated("""
        import json, sys
        import magi_backend_musa
        print(json.dumps({"torch_musa": "torch_musa" in sys.modules}))
    """)
    assert _json_out(proc) == {"torch_musa": False}


def test_probe_without_torch_musa_reports_why() -> None:
    """Without torch_musa the backend is unavailable with an install hint, and cpu is chosen."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import json
            from magi_core.plugin.manager import REGISTRY, get_backend
            rec = REGISTRY.records()["musa"]
            print(json.dumps({"available": rec.available, "why": rec.why_unavailable, "selected": get_backend().name}))
        """)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = _json_out(proc)
    assert out["available"] is False
    assert out["why"] == "torch_musa is not installed: pip install torch_musa"
    assert out["selected"] == "cpu"


def test_selection_picks_musa_when_a_device_is_visible() -> None:
    """Emulated: with a MUSA device visible, automatic selection picks musa; its device module is torch.musa."""
    proc = run_emulated("""
        import json, torch
        from magi_core.plugin.manager import get_backend
        b = get_backend()
        print(json.dumps({"name": b.name, "by": b.selected_by, "type": b.device_type, "prio": b.priority,
                          "module": b.device_module is torch.musa, "init": torch.musa.is_initialized(),
                          "version": b.version}))
    """)
    out = _json_out(proc)
    assert out == {"name": "musa", "by": "probe", "type": "musa", "prio": 100, "module": True, "init": False,
                   "version": "2.7.0+emulated"}


def test_no_device_visible_falls_back_to_cpu_with_reason() -> None:
    """Emulated with zero devices: musa reports "no MUSA device visible" and cpu is selected."""
    proc = run_emulated("""
        import json
        from magi_core.plugin.manager import REGISTRY, get_backend
        rec = REGISTRY.records()["musa"]
        print(json.dumps({"available": rec.available, "why": rec.why_unavailable, "selected": get_backend().name}))
    """, env={"FAKE_MUSA_DEVICE_COUNT": "0"})
    out = _json_out(proc)
    assert out["available"] is False and out["why"].startswith("no MUSA device visible")
    assert out["selected"] == "cpu"


def test_host_register_uses_musart_with_a_real_table_and_712_713() -> None:
    """Emulated: ranges land in musart's table; 712 is success (error drained); 713 and the runtime text raise."""
    proc = run_emulated("""
        import json, torch
        from magi_core import HostRegisterError, get_backend
        from magi_backend_musa import runtime
        b = get_backend()
        rt = torch.musa.musart()
        x, y = torch.ones(1024), torch.ones(2048)
        out = {}
        b.host_register(x.data_ptr(), 4096)
        b.host_register(x.data_ptr(), 4096)
        out["table_after_register"] = rt.registered_ranges() == {x.data_ptr(): 4096}
        # 712 from the runtime: y registered behind the backend's back (by someone else)
        int(rt.musaHostRegister(y.data_ptr(), 8192, 0))
        b.host_register(y.data_ptr(), 8192)
        out["last_error_drained"] = int(rt.musaGetLastError())
        out["calls"] = [c[0] for c in rt.calls]
        out["origins"] = sorted(runtime.range_origins().values())
        b.host_unregister(y.data_ptr())
        b.host_unregister(x.data_ptr())
        out["table_after_unregister"] = {hex(k): v for k, v in rt.registered_ranges().items()}
        out["y"] = hex(y.data_ptr())
        out["theirs_removed_by_them"] = int(rt.musaHostUnregister(y.data_ptr()))
        try:
            b.host_unregister(x.data_ptr())
        except HostRegisterError as e:
            out["unknown"] = e.code
        # 713 from the runtime: the range vanished behind the backend's back
        b.host_register(x.data_ptr(), 4096)
        int(rt.musaHostUnregister(x.data_ptr()))
        try:
            b.host_unregister(x.data_ptr())
        except HostRegisterError as e:
            out["runtime_713"] = [e.code, str(e)]
        print(json.dumps(out))
    """)
    out = _json_out(proc)
    assert out["table_after_register"] is True
    assert out["last_error_drained"] == 0
    assert out["calls"] == ["musaHostRegister", "musaHostRegister", "musaHostRegister"]
    assert out["origins"] == ["found", "registered"]
    assert out["table_after_unregister"] == {out["y"]: 8192}, "our unregister removed someone else's registration"
    assert out["theirs_removed_by_them"] == 0
    assert out["unknown"] == 713
    assert out["runtime_713"][0] == 713
    assert "pointer does not correspond to a registered memory region" in out["runtime_713"][1]


# -- torch_musa 2.7.1's binding surface: no musaGetLastError in the bindings ------------------------------------

_SURFACE_2_7_1 = {"FAKE_MUSA_BINDINGS": "2.7.1"}


def test_2_7_1_surface_is_exactly_that_of_torch_musas_bindings() -> None:
    """The emulation's 2.7.1 bindings have exactly torch_musa 2.7.1's ``_musart`` names (no musaGetLastError)."""
    proc = run_emulated("""
        import json, torch, torch_musa
        rt = torch.musa.musart()
        print(json.dumps({"names": sorted(n for n in dir(rt) if not n.startswith("_")),
                          "expected": sorted(torch_musa.MUSART_2_7_1_SURFACE), "version": torch_musa.__version__}))
    """, env=_SURFACE_2_7_1)
    out = _json_out(proc)
    assert out["names"] == out["expected"] == ["musaError", "musaGetErrorString", "musaHostRegister",
                                               "musaHostUnregister", "musaMemGetInfo", "musaStreamCreate",
                                               "musaStreamDestroy"]
    assert out["version"] == "2.7.1+emulated"


def test_tolerated_and_failed_calls_do_not_poison_the_next_kernel_with_2_7_1_bindings() -> None:
    """Emulated 2.7.1: after a tolerated 712, a memlock refusal pinning tolerates, or a 713, the next kernel runs.

    torch_musa raises the runtime's pending per-thread error after every kernel launch
    (``torch.musa.launch_kernel`` stands in for one). The bindings have no ``musaGetLastError``, so the backend
    takes it from the ``libmusart`` the process loaded (the lookup pointed at the emulated library here).
    """
    proc = run_emulated("""
        import json, logging, threading, torch, torch_musa
        from magi_core import HostRegisterError, get_backend
        from magi_core.host.pinning import pin_ranges
        from magi_backend_musa import runtime
        runtime.loaded_libmusart = lambda: (torch_musa.LIBMUSART,)
        b = get_backend()
        rt = torch.musa.musart()
        out = {"has_get_last_error": hasattr(rt, "musaGetLastError")}

        def kernel(label):
            try:
                torch.musa.launch_kernel(label)
            except RuntimeError as exc:
                out[label] = str(exc).splitlines()[0]
            else:
                out[label] = "ok"

        # 1. 712: someone else registered x first; the backend tolerates it
        x = torch.ones(1024)
        int(rt.musaHostRegister(x.data_ptr(), 4096, 0))
        b.host_register(x.data_ptr(), 4096)
        kernel("after_712")
        b.host_unregister(x.data_ptr())
        out["x_still_theirs"] = x.data_ptr() in torch_musa.emulated_registered_ranges()
        int(rt.musaHostUnregister(x.data_ptr()))
        # 2. a sub-range of a held range, then a range straddling it (712 from the runtime)
        y = torch.ones(4096)
        b.host_register(y.data_ptr(), 8192)
        b.host_register(y.data_ptr() + 1024, 1024)
        b.host_register(y.data_ptr() + 4096, 8192)
        kernel("after_overlap")
        for p in (y.data_ptr() + 1024, y.data_ptr() + 4096, y.data_ptr()):
            b.host_unregister(p)
        kernel("after_unregisters")
        # 3. memlock: the runtime refuses ("out of memory"); pinning tolerates it and offload carries on
        big = torch.ones(1 << 18)
        res = pin_ranges(b, [(big.data_ptr(), big.numel() * 4)], budget=None)
        out["pin_error"] = res.error
        kernel("after_memlock_refusal")
        # 4. 713 from the runtime on unregister (the range vanished behind the backend's back)
        z = torch.ones(256)
        b.host_register(z.data_ptr(), 1024)
        int(rt.musaHostUnregister(z.data_ptr()))
        try:
            b.host_unregister(z.data_ptr())
        except HostRegisterError as exc:
            out["unregister_713"] = exc.code
        kernel("after_713")
        # 5. the pending error is per thread: a 712 on a worker thread is drained on that thread
        w = torch.ones(256)
        int(rt.musaHostRegister(w.data_ptr(), 1024, 0))
        def worker():
            b.host_register(w.data_ptr(), 1024)
            kernel("worker_after_712")
            b.host_unregister(w.data_ptr())
        t = threading.Thread(target=worker); t.start(); t.join()
        kernel("main_after_worker")
        int(rt.musaHostUnregister(w.data_ptr()))
        out["drain_sources"] = [d.source for d in getattr(runtime, "error_drains", tuple)()]
        with open("/proc/self/maps") as maps:
            out["cuda_libraries"] = sorted({l.split()[-1] for l in maps if "libcuda" in l})
        print(json.dumps(out))
    """, env={**_SURFACE_2_7_1, "FAKE_MUSA_MEMLOCK_BYTES": str(256 << 10)})
    out = _json_out(proc)
    assert out["has_get_last_error"] is False
    for label in ("after_712", "after_overlap", "after_unregisters", "after_memlock_refusal", "after_713",
                  "worker_after_712", "main_after_worker"):
        assert out[label] == "ok", f"{label}: the next kernel raised {out[label]!r}"
    assert out["x_still_theirs"] is True
    assert out["pin_error"] is not None and "out of memory" in out["pin_error"]
    assert out["unregister_713"] == 713
    assert out["drain_sources"] == ["EmulatedLibmusart"]
    assert out["cuda_libraries"] == []


def test_without_a_reachable_musa_get_last_error_the_backend_warns_once() -> None:
    """Emulated 2.7.1 with no libmusart loaded (nothing to drain with): one warning saying what will happen."""
    proc = run_emulated("""
        import json, logging, torch
        from magi_core import get_backend
        from magi_backend_musa import runtime
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("magi_backend_musa.runtime").addHandler(Keep())
        b = get_backend()
        rt = torch.musa.musart()
        x = torch.ones(1024)
        int(rt.musaHostRegister(x.data_ptr(), 4096, 0))
        b.host_register(x.data_ptr(), 4096)
        b.host_register(x.data_ptr() + 16, 64)
        b.host_unregister(x.data_ptr() + 16)
        b.host_unregister(x.data_ptr())
        try:
            torch.musa.launch_kernel()
        except RuntimeError as exc:
            launch = str(exc).splitlines()[0]
        print(json.dumps({"found": len(runtime.loaded_libmusart()), "warnings": records, "launch": launch}))
    """, env=_SURFACE_2_7_1)
    out = _json_out(proc)
    assert out["found"] == 0
    assert len(out["warnings"]) == 1 and "no musaGetLastError" in out["warnings"][0]
    assert "already mapped" in out["launch"]  # what the warning announces: the next kernel raises it


_STUB_LOADED_LIBMUSART = r"""
static __thread int pending = 0;
int musaGetLastError(void) { int e = pending; pending = 0; return e; }
int musaPeekAtLastError(void) { return pending; }
void stub_set_pending(int e) { pending = e; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stub libmusart.so")
def test_drain_reaches_the_libmusart_the_process_already_loaded(tmp_path: Path) -> None:
    """The real lookup: a libmusart mapped into the process (as torch_musa maps it) is found and drained, never loaded.

    Before it is mapped, the lookup finds nothing (RTLD_NOLOAD never loads a library).
    """
    lib = tmp_path / "musa" / "lib" / "libmusart.so.4"
    lib.parent.mkdir(parents=True)
    (tmp_path / "stub.c").write_text(_STUB_LOADED_LIBMUSART)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "stub.c")], check=True)
    proc = run_emulated("""
        import ctypes, json, sys, torch
        from magi_core import get_backend
        from magi_backend_musa import runtime
        out = {"before": len(runtime.loaded_libmusart())}
        stub = ctypes.CDLL(sys.argv[1])  # torch_musa's own load of the runtime
        b = get_backend()
        x = torch.ones(1024)
        int(torch.musa.musart().musaHostRegister(x.data_ptr(), 4096, 0))
        stub.stub_set_pending(712)  # what the real runtime leaves pending on the 712 below
        b.host_register(x.data_ptr(), 4096)
        out["pending_after"] = stub.musaPeekAtLastError()
        out["sources"] = [d.source for d in runtime.error_drains()]
        b.host_unregister(x.data_ptr())
        with open("/proc/self/maps") as maps:
            out["mapped"] = sorted({l.split()[-1] for l in maps if "libmusart" in l or "libcuda" in l})
        print(json.dumps(out))
    """, env=_SURFACE_2_7_1, args=[str(lib)])
    out = _json_out(proc)
    assert out["before"] == 0
    assert out["pending_after"] == 0
    assert out["sources"] == [str(lib)]
    assert out["mapped"] == [str(lib)]


def test_never_the_cuda_runtime_even_with_torchada() -> None:
    """Emulated + torchada-like remap of torch.cuda: musa is selected, cuda refused, only musart is called."""
    proc = run_emulated("""
        import json, torch, torch_musa, torchada
        from magi_core.plugin.manager import REGISTRY, get_backend
        b = get_backend()
        x = torch.ones(256)
        b.host_register(x.data_ptr(), 1024)
        b.host_unregister(x.data_ptr())
        recs = REGISTRY.records()
        cuda = recs.get("cuda")
        print(json.dumps({
            "selected": b.name,
            "cuda_available": None if cuda is None else cuda.available,
            "cuda_why": None if cuda is None else cuda.why_unavailable,
            "cuda_runtime_calls": len(torchada.CUDA_RUNTIME_CALLS),
            "musart_calls": [c[0] for c in torch.musa.musart().calls],
        }))
    """)
    out = _json_out(proc)
    assert out["selected"] == "musa"
    assert out["cuda_available"] in (False, None)
    assert out["cuda_runtime_calls"] == 0
    assert out["musart_calls"] == ["musaHostRegister", "musaHostUnregister"]


def test_missing_bindings_and_no_libmusart_says_what_to_do(tmp_path: Path) -> None:
    """Emulated bindings without musaHostRegister and no libmusart.so under MUSA_HOME: a clear BackendError."""
    proc = run_emulated("""
        import torch
        from magi_core import get_backend
        from magi_core.errors import BackendError
        b = get_backend()
        x = torch.ones(16)
        try:
            b.host_register(x.data_ptr(), 64)
        except BackendError as e:
            print(str(e))
        else:
            raise SystemExit("expected BackendError")
    """, env={"FAKE_MUSA_NO_HOST_REGISTER": "1", "MUSA_HOME": str(tmp_path)})
    assert "MUSA_HOME" in proc.stdout and str(tmp_path / "lib" / "libmusart.so") in proc.stdout


_STUB_LIBMUSART = r"""
#include <stddef.h>
#include <stdint.h>
static uintptr_t starts[64]; static size_t sizes[64]; static int last = 0; int calls = 0;
int musaHostRegister(void *p, size_t n, unsigned int flags) {
  calls++;
  for (int i = 0; i < 64; i++) if (starts[i] == (uintptr_t)p) { last = 712; return 712; }
  for (int i = 0; i < 64; i++) if (!starts[i]) { starts[i] = (uintptr_t)p; sizes[i] = n; return 0; }
  last = 2; return 2;
}
int musaHostUnregister(void *p) {
  calls++;
  for (int i = 0; i < 64; i++) if (starts[i] == (uintptr_t)p) { starts[i] = 0; return 0; }
  last = 713; return 713;
}
const char *musaGetErrorString(int e) { return e == 713 ? "stub: not registered" : "stub error"; }
int musaGetLastError(void) { int e = last; last = 0; return e; }
int stub_calls(void) { return calls; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stub libmusart.so")
def test_libmusart_fallback_under_musa_home(tmp_path: Path) -> None:
    """Emulated bindings without host registration: the backend loads $MUSA_HOME/lib/libmusart.so (a stub)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "stub.c").write_text(_STUB_LIBMUSART)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libmusart.so"), str(tmp_path / "stub.c")], check=True)
    proc = run_emulated("""
        import ctypes, json, os, torch
        from magi_core import HostRegisterError, get_backend
        from magi_backend_musa import runtime
        b = get_backend()
        x = torch.ones(64)
        b.host_register(x.data_ptr(), 256)
        b.host_unregister(x.data_ptr())
        stub = ctypes.CDLL(os.path.join(os.environ["MUSA_HOME"], "lib", "libmusart.so"))
        out = {"source": runtime.musa_runtime().source, "stub_calls": stub.stub_calls(),
               "fake_bindings_calls": len(torch.musa.musart().calls)}
        print(json.dumps(out))
    """, env={"FAKE_MUSA_NO_HOST_REGISTER": "1", "MUSA_HOME": str(tmp_path)})
    out = _json_out(proc)
    assert out == {"source": str(lib / "libmusart.so"), "stub_calls": 2, "fake_bindings_calls": 0}


def test_aliases_include_orig_to_which_torch_musa_installs() -> None:
    """Emulated: aliases are ("to", "orig_to") and orig_to is the original Tensor.to."""
    proc = run_emulated("""
        import json, torch
        from magi_core import get_backend
        b = get_backend()
        print(json.dumps({"aliases": list(b.to_method_aliases),
                          "orig": torch.Tensor.orig_to is torch._C.TensorBase.to}))
    """)
    assert _json_out(proc) == {"aliases": ["to", "orig_to"], "orig": True}


def test_hookspec_versions_and_aliases_in_process() -> None:
    """Spec major 1 and the alias pair, straight from the hooks."""
    assert tuple(magi_backend_musa.magi_hookspec_versions()) == ("1",)
    assert tuple(magi_backend_musa.magi_to_method_aliases()) == ("to", "orig_to")


def test_ranges_show_up_in_the_profiler_and_balance() -> None:
    """Ranges are record_function spans visible to torch.profiler; an unmatched pop raises."""
    assert ranges.depth() == 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        magi_backend_musa.magi_range_push(name="magi-musa-outer")
        magi_backend_musa.magi_range_push(name="magi-musa-inner")
        torch.ones(4).sum()
        magi_backend_musa.magi_range_pop()
        magi_backend_musa.magi_range_pop()
    names = {e.name for e in prof.events()}
    assert {"magi-musa-outer", "magi-musa-inner"} <= names
    assert ranges.depth() == 0
    with pytest.raises(BackendError):
        magi_backend_musa.magi_range_pop()


@pytest.mark.parametrize("bindings", ["2.7.0", "2.7.1"])
def test_conformance_kit_passes_emulated(bindings: str) -> None:
    """Emulated: the conformance kit passes for musa in a subprocess (tensor-on-device parts skipped), both surfaces."""
    proc = run_emulated_argv(
        ["-m", "pytest", "-p", "magi", "--pyargs", "magi_core.testing.conformance", "--magi-backend=musa",
         "-q", "-rs", "-p", "no:cacheprovider"], env={"FAKE_MUSA_BINDINGS": bindings},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# -- capabilities (spec 1.1): Inductor only where torch_musa ships its Inductor backend and Triton is installed ------

def _module(name: str, **attrs: object) -> object:
    import importlib.machinery
    import types

    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def test_capabilities_follow_torch_musas_inductor_backend_and_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor units only with torch_musa's Inductor backend and Triton; never direct calls (unverified on MUSA)."""
    from magi_core.plugin import Capabilities

    with_inductor = _module("torch_musa", __version__="2.7.1", _init_inductor_backend_registration=lambda: None)
    monkeypatch.setitem(sys.modules, "torch_musa", with_inductor)
    monkeypatch.setitem(sys.modules, "triton", _module("triton"))
    caps = magi_backend_musa.magi_capabilities()
    assert caps == Capabilities(inductor=True, default_unit_compiler="inductor", direct_unit_calls=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # Triton for MUSA not installed
    caps = magi_backend_musa.magi_capabilities()
    assert not caps.inductor and caps.default_unit_compiler == "eager" and "Triton for MUSA" in (caps.reason or "")
    monkeypatch.setitem(sys.modules, "torch_musa", _module("torch_musa", __version__="2.0.0"))  # no _inductor
    caps = magi_backend_musa.magi_capabilities()
    assert not caps.inductor and "has no Inductor backend" in (caps.reason or "")
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    assert "torch_musa is not installed" in (magi_backend_musa.magi_capabilities().reason or "")


def test_emulated_torch_musa_gets_eager_units_without_initialising_the_device() -> None:
    """Emulated (no Inductor backend in the emulation): "auto" is eager, "inductor" a clear error; no device init."""
    proc = run_emulated("""
        import json, torch
        from magi_core.errors import ConfigError
        from magi_core.plugin.manager import get_backend
        b = get_backend()
        out = {"name": b.name, "auto": b.resolve_unit_compiler("auto"), "direct": b.allows_direct_unit_calls(True),
               "init": torch.musa.is_initialized()}
        try:
            b.resolve_unit_compiler("inductor")
        except ConfigError as exc:
            out["error"] = str(exc)
        print(json.dumps(out))
    """)
    out = _json_out(proc)
    assert (out["name"], out["auto"], out["direct"], out["init"]) == ("musa", "eager", False, False)
    assert "backend 'musa'" in out["error"] and "unit_compiler='eager'" in out["error"]


# -- device memory (spec 1.2): torch_musa mirrors torch.cuda's allocator API ------------------------------------------
def test_device_memory_and_a_cap_through_torch_musas_memory_fraction() -> None:
    """Emulated: magi_device_memory reads torch.musa.mem_get_info; magi_limit_device_memory sets the fraction and the
    cap shows as the total."""
    proc = run_emulated("""
        import json, torch, torch_musa
        import magi_core
        from magi_core.plugin.manager import get_backend
        b = get_backend()
        before = b.device_memory()
        cap = magi_core.limit_device_memory("12GiB")
        after = b.device_memory(0)
        half = magi_core.limit_device_memory("50%")
        print(json.dumps({"before": [before.free, before.total], "cap": cap, "after": [after.free, after.total],
                          "fractions": torch_musa.MEMORY_FRACTIONS, "half": half}))
    """)
    out = _json_out(proc)
    gib = 1 << 30
    assert out["before"] == [80 * gib, 80 * gib]
    assert out["cap"] == 12 * gib and out["after"] == [12 * gib, 12 * gib]
    assert out["half"] == 6 * gib  # half of what the process sees now: the 12 GiB card
    assert out["fractions"] == {"0": 6 / 80}


def test_a_torch_musa_without_the_memory_fraction_refuses_the_cap_clearly() -> None:
    """Emulated older torch_musa (no set_per_process_memory_fraction): magi_limit_device_memory names what is
    missing."""
    proc = run_emulated("""
        import json
        import magi_core
        from magi_core.errors import BackendError
        try:
            magi_core.limit_device_memory(1 << 30)
        except BackendError as exc:
            print(json.dumps({"error": str(exc)}))
    """, env={"FAKE_MUSA_NO_MEMORY_FRACTION": "1"})
    error = _json_out(proc)["error"]
    assert error.startswith("backend musa cannot cap device memory: torch_musa has no set_per_process_memory_fraction")
    assert "upgrade it" in error
