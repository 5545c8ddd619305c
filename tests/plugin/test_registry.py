"""Backend discovery and selection, through real entry points (fake backends are real dist-info folders)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers.fake_backends import add_backend, run_python, select_and_list, write_dist
from hypothesis import given
from hypothesis import strategies as st

import magi_core
from magi_core.errors import BackendError
from magi_core.plugin import cpu as cpu_backend
from magi_core.plugin.manager import (
    ENV_BACKEND,
    ENV_TRACE,
    OPTIONAL_HOOKS,
    REGISTRY,
    BackendRecord,
    Registry,
    available_accelerator,
    spec_major,
)
from magi_core.plugin.spec import HOOKSPEC_VERSION, REQUIRED_HOOKS, Capabilities, ProbeResult

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A fresh registry over the installed backends, with no MAGI_* variables set."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_TRACE, raising=False)
    return Registry()


@pytest.fixture
def fresh_global_registry(monkeypatch: pytest.MonkeyPatch):
    """Reset the process-wide registry before and after (use_backend / get_backend act on it)."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    REGISTRY.reset()
    yield REGISTRY
    REGISTRY.reset()


# -- the real, installed CPU backend -------------------------------------------------------------

def test_cpu_backend_is_discovered_through_its_entry_point(registry: Registry) -> None:
    rec = registry.records()["cpu"]
    assert rec.entry_point == "magi_core.plugin.cpu"
    assert rec.plugin is cpu_backend
    assert rec.package == "magi-core"
    assert rec.package_version == magi_core.__version__
    assert rec.spec_versions == ("1",)
    assert rec.missing_required == ()
    # no profiler ranges on the host, and no device memory to cap (magi_device_memory answers None)
    assert set(rec.missing_optional) == {"magi_range_push", "magi_range_pop", "magi_limit_device_memory"}
    assert rec.available and rec.why_unavailable is None
    assert rec.probe is not None and rec.probe.device_type == "cpu" and rec.probe.priority == 0


def test_discovery_runs_once_per_registry(registry: Registry) -> None:
    assert registry.records() is registry.records()
    registry.reset()
    assert registry.records()["cpu"].available


@pytest.mark.skipif(available_accelerator() is not None, reason="an accelerator is present: cpu is not the default")
def test_cpu_is_chosen_by_probe_without_accelerator_and_logged_once(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="magi_core.plugin.manager"):
        backend = registry.active()
        assert registry.active() is backend
        registry.use(None)
        registry.active()
    assert (backend.name, backend.selected_by, backend.device_type) == ("cpu", "probe", "cpu")
    assert not backend.is_accelerator
    cpu_logs = [r for r in caplog.records if "CPU backend" in r.getMessage()]
    assert len(cpu_logs) == 1 and cpu_logs[0].levelno == logging.INFO  # expected here: said, not warned


def test_env_selects_and_explicit_beats_env(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    assert registry.active().selected_by == "env"
    monkeypatch.setenv(ENV_BACKEND, "nosuch")
    backend = registry.use("cpu")
    assert backend is not None and backend.selected_by == "explicit"
    assert registry.selection().name == "cpu" and registry.selection().selected_by == "explicit"


def test_env_nosuch_lists_installed_backends(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BACKEND, "nosuch")
    with pytest.raises(BackendError) as err:
        registry.active()
    msg = str(err.value)
    assert "'nosuch'" in msg and "MAGI_BACKEND=nosuch" in msg
    for name in registry.records():
        assert name in msg
    assert f"unset {ENV_BACKEND}" in msg and "magi-backend-nosuch" in msg
    sel = registry.selection()
    assert sel.name is None and sel.error == msg


def test_failed_use_backend_keeps_previous_selection(fresh_global_registry: Registry) -> None:
    first = magi_core.use_backend("cpu")
    with pytest.raises(BackendError, match="'nosuch'.*not installed"):
        magi_core.use_backend("nosuch")
    assert magi_core.get_backend() is first
    assert magi_core.use_backend(None) is None
    assert fresh_global_registry.selection().selected_by != "explicit"


def test_facade_routes_to_the_selected_backend(registry: Registry) -> None:
    backend = registry.use("cpu")
    assert backend is not None
    assert backend.to_method_aliases == ("to",)
    assert backend.device_module.current_stream() is backend.device_module.current_stream()
    ptr, nbytes = 0x7F00_0000, 4096
    backend.host_register(ptr, nbytes)
    backend.host_register(ptr, nbytes)  # "already registered" is success
    assert cpu_backend.registered_ranges()[ptr] == nbytes
    backend.host_unregister(ptr)
    assert ptr not in cpu_backend.registered_ranges()
    with pytest.raises(magi_core.HostRegisterError):
        backend.host_unregister(ptr)
    with backend.range("noop"):  # cpu has no ranges: a clean no-op
        pass


def test_facade_keeps_the_backends_to_method_aliases_and_placement_rewrites_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend listing ``orig_to`` (as the MUSA backend does): the facade keeps it, and device placement with the
    facade's aliases moves a graph's ``.orig_to(cpu)`` to the device (with ``("to",)`` it would stay on the host)."""
    from helpers.fake_backends import discover_also, load_in_process
    from strategies import FxSpec, build_fx_graph, orig_to_installed

    from magi_core.passes.device_placement import is_cpu_device, place_on_device

    monkeypatch.delenv(ENV_BACKEND, raising=False)
    discover_also(monkeypatch, load_in_process(monkeypatch, "aliased", device_type="meta", priority=-50,
                                               aliases=("to", "orig_to")))
    backend = Registry().use("aliased")
    assert backend is not None and backend.to_method_aliases == ("to", "orig_to")
    spec = FxSpec(dim=3, batch=2, ops=("index_select", "gather"), blocks=(None, None), to_alias=("orig_to", "to"),
                  to_spelling=(0, 0))
    with orig_to_installed():
        gm, inputs = build_fx_graph(spec)
        report = place_on_device(gm, backend.device_type, backend.to_method_aliases, example_inputs=inputs)
    assert report.to_calls == 2
    moved = [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("to", "orig_to")]
    assert sorted(n.target for n in moved) == ["orig_to", "to"]
    assert not any(is_cpu_device(n.args[1]) for n in moved), [n.format_node() for n in moved]


def test_record_call_of_missing_hook_says_so(registry: Registry) -> None:
    with pytest.raises(BackendError, match="does not implement hook 'magi_range_push'"):
        registry.records()["cpu"].call("magi_range_push", name="x")


def test_list_backends_is_sorted_and_public(fresh_global_registry: Registry) -> None:
    names = [r.name for r in magi_core.list_backends()]
    assert names == sorted(names) and "cpu" in names


# -- MAGI_TRACE_HOOKS --------------------------------------------------------------------------

def _trace_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("hook trace")]


def test_trace_hooks_logs_every_hook_call(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV_TRACE, "1")
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    with caplog.at_level(logging.INFO, logger="magi_core.plugin.manager"):
        backend = Registry().active()
        backend.host_register(0x1000, 64)
        backend.host_unregister(0x1000)
    lines = _trace_lines(caplog)
    called = ["magi_hookspec_versions", "magi_probe", "magi_to_method_aliases", "magi_device_module",
              "magi_host_register", "magi_host_unregister"]
    for hook in called:
        assert any("[cpu]" in line and f" {hook} [hook]" in line for line in lines), hook
        assert any(f"finish {hook} -->" in line for line in lines), hook
    assert any("ptr: 4096" in line for line in lines)


def test_no_trace_without_env(registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="magi_core.plugin.manager"):
        registry.use("cpu")
    assert _trace_lines(caplog) == []


# -- selection rule as a property --------------------------------------------------------------

def _record(name: str, priority: int) -> BackendRecord:
    rec = BackendRecord(name=name, entry_point=f"pkg_{name}", package=f"magi-backend-{name}", package_version="1")
    rec.spec_versions = ("1",)
    rec.probe = ProbeResult(available=True, device_type=name, priority=priority, version="1")
    return rec


@given(st.lists(st.integers(min_value=-5, max_value=5), min_size=1, max_size=6))
def test_top_priority_wins_and_ties_name_every_tied_package(priorities: list[int]) -> None:
    records = [_record(f"b{i}", p) for i, p in enumerate(priorities)]
    best = max(priorities)
    tied = [r for r in records if r.probe is not None and r.probe.priority == best]
    if len(tied) == 1:
        assert Registry._top(records) is tied[0]
    else:
        with pytest.raises(BackendError) as err:
            Registry._top(records)
        for r in tied:
            assert f"'{r.name}' ({r.package}" in str(err.value)
        for r in records:
            if r not in tied:
                assert f"'{r.name}'" not in str(err.value)


@given(st.sampled_from(["1", "1.0", "1.7", " 1.2"]), st.sampled_from(["0", "2", "2.0", "10"]))
def test_spec_compatibility_compares_majors(good: str, bad: str) -> None:
    rec = _record("x", 1)
    rec.spec_versions = (good,)
    assert rec.spec_compatible and rec.problem is None
    rec.spec_versions = (bad,)
    assert not rec.spec_compatible
    assert bad in (rec.problem or "") and HOOKSPEC_VERSION in (rec.problem or "")
    assert spec_major(HOOKSPEC_VERSION) == "1"


# -- bad input and third-party backends, in fresh processes over real dist-info entry points -----

def test_higher_priority_backend_is_chosen_by_probe(tmp_path: Path) -> None:
    add_backend(tmp_path, "fast", device_type="fast", priority=50)
    out, _ = select_and_list([tmp_path])
    assert (out["selected"], out["selected_by"]) == ("fast", "probe")
    fast = out["backends"]["fast"]
    assert fast["package"] == "magi-backend-fast" and fast["package_version"] == "0.0.1"
    assert fast["priority"] == 50 and fast["device_type"] == "fast" and fast["available"]
    # the fake implements every spec 1.0 hook: a 1.0 backend lacks only the 1.1 and 1.2 additions, and still loads
    assert fast["missing_optional_hooks"] == ["magi_capabilities", "magi_device_memory", "magi_limit_device_memory"]
    assert fast["hookspec_versions"] == ["1"]
    assert "cpu" in out["backends"]


def test_env_nosuch_in_fresh_process_lists_third_party_backends(tmp_path: Path) -> None:
    add_backend(tmp_path, "fast", device_type="fast", priority=50)
    out, _ = select_and_list([tmp_path], env={"MAGI_BACKEND": "nosuch"})
    assert "error" in out and "'nosuch'" in out["error"]
    assert "cpu" in out["error"] and "fast" in out["error"]


def test_probe_that_raises_is_reported_not_swallowed(tmp_path: Path) -> None:
    add_backend(tmp_path, "flaky", device_type="flaky", priority=50, probe_raises="driver exploded (code 17)")
    out, run = select_and_list([tmp_path])
    flaky = out["backends"]["flaky"]
    assert not flaky["available"]
    assert flaky["probe_error"] == "RuntimeError: driver exploded (code 17)"
    assert "driver exploded (code 17)" in flaky["why_unavailable"]
    assert "probe raised RuntimeError: driver exploded (code 17)" in run.stderr  # logged
    assert out["selected"] == "cpu"  # no accelerator here: the host is the fallback, and it was said
    out, _ = select_and_list([tmp_path], select="magi_core.use_backend('flaky')")
    assert "flaky" in out["error"] and "driver exploded (code 17)" in out["error"]


def test_import_error_is_reported(tmp_path: Path) -> None:
    write_dist(tmp_path, "magi-backend-broken", {"fake_broken": "import no_such_module_xyz\n"},
               {"broken": "fake_broken"})
    out, run = select_and_list([tmp_path])
    broken = out["backends"]["broken"]
    assert not broken["available"]
    assert "ModuleNotFoundError" in broken["load_error"] and "no_such_module_xyz" in broken["load_error"]
    assert "no_such_module_xyz" in run.stderr


def test_two_backends_with_equal_priority_name_both_packages(tmp_path: Path) -> None:
    add_backend(tmp_path, "alpha", package="magi-backend-alpha", device_type="alpha", priority=70)
    add_backend(tmp_path, "beta", package="vendor-beta-plugin", device_type="beta", priority=70)
    out, _ = select_and_list([tmp_path])
    assert "equal priority 70" in out["error"]
    assert "'alpha' (magi-backend-alpha" in out["error"] and "'beta' (vendor-beta-plugin" in out["error"]
    assert "MAGI_BACKEND=NAME" in out["error"]
    assert out["selection"]["error"] == out["error"]
    out, _ = select_and_list([tmp_path], env={"MAGI_BACKEND": "beta"})
    assert (out["selected"], out["selected_by"]) == ("beta", "env")


@pytest.mark.parametrize("hook", REQUIRED_HOOKS)
def test_missing_required_hook_is_refused_naming_it(tmp_path: Path, hook: str) -> None:
    add_backend(tmp_path, "partial", device_type="partial", priority=50, omit=[hook])
    out, run = select_and_list([tmp_path], select="magi_core.use_backend('partial')")
    assert "'partial'" in out["error"] and f"missing required hook(s) {hook}" in out["error"]
    assert "docs/reference/hooks.md" in out["error"]
    assert out["backends"]["partial"]["missing_required_hooks"] == [hook]
    assert hook in run.stderr
    out, _ = select_and_list([tmp_path])
    assert out["selected"] == "cpu"


def test_missing_optional_hooks_are_listed_and_defaulted(tmp_path: Path) -> None:
    add_backend(tmp_path, "lean", device_type="lean", priority=50, omit=OPTIONAL_HOOKS)
    out, _ = select_and_list(
        [tmp_path], select="(lambda b: (b.range_push('x'), b.range_pop(), b)[-1])(magi_core.get_backend())"
    )
    assert out["selected"] == "lean"
    assert sorted(out["backends"]["lean"]["missing_optional_hooks"]) == sorted(OPTIONAL_HOOKS)


def test_incompatible_hookspec_version_names_both_versions(tmp_path: Path) -> None:
    add_backend(tmp_path, "future", device_type="future", priority=50, spec_versions=("2",))
    out, _ = select_and_list([tmp_path], select="magi_core.use_backend('future')")
    assert "incompatible hook-spec version" in out["error"]
    assert "supports 2" in out["error"] and f"publishes {HOOKSPEC_VERSION}" in out["error"]
    assert out["backends"]["future"]["hookspec_versions"] == ["2"]
    assert out["backends"]["future"]["priority"] is None  # not probed once found incompatible


def test_hookimpl_failing_pluggy_validation_is_a_load_error(tmp_path: Path) -> None:
    bad = "\n@hookimpl\ndef magi_host_register(ptr, size):\n    pass\n"
    add_backend(tmp_path, "typo", device_type="typo", priority=50, omit=["magi_host_register"], extra=bad)
    out, run = select_and_list([tmp_path], select="magi_core.use_backend('typo')")
    err = out["backends"]["typo"]["load_error"]
    assert "does not match magi-core's hook spec" in err and "magi_host_register" in err and "size" in err
    assert "docs/reference/hooks.md" in err and "\n" not in err  # one line: the listing shows all of it
    assert "Argument(s) {'size'} are declared in the hookimpl" in err
    assert "typo" in out["error"] and "failed to load" in out["error"]
    assert "rejected by hook validation" in run.stderr


def test_unknown_hook_name_is_listed(tmp_path: Path) -> None:
    extra = "\n@hookimpl\ndef magi_range_psuh(name):\n    pass\n"
    add_backend(tmp_path, "speller", device_type="speller", priority=50, extra=extra)
    out, run = select_and_list([tmp_path])
    assert out["backends"]["speller"]["unknown_hooks"] == ["magi_range_psuh"]
    assert "magi_range_psuh" in run.stderr


def test_same_name_from_two_packages_is_refused(tmp_path: Path) -> None:
    add_backend(tmp_path / "a", "twin", package="magi-backend-twin", device_type="twin", priority=50)
    write_dist(tmp_path / "b", "other-twin", {"other_twin": "x = 1\n"}, {"twin": "other_twin"})
    out, _ = select_and_list([tmp_path / "a", tmp_path / "b"], select="magi_core.use_backend('twin')")
    assert "two packages register the backend name 'twin'" in out["error"]
    assert "magi-backend-twin" in out["error"] and "other-twin" in out["error"]


needs_cpu_build = pytest.mark.skipif(
    torch.accelerator.current_accelerator() is not None,
    reason="emulating an accelerator via PrivateUse1 needs a torch build without a built-in accelerator",
)


@needs_cpu_build
def test_accelerator_without_backend_says_which_package_to_install(tmp_path: Path) -> None:
    out, _ = select_and_list([tmp_path], accelerator="fakeacc")
    assert "torch reports a 'fakeacc' accelerator" in out["error"]
    assert "pip install magi-backend-fakeacc" in out["error"] and "MAGI_BACKEND=cpu" in out["error"]
    out, _ = select_and_list([tmp_path], accelerator="fakeacc", env={"MAGI_BACKEND": "cpu"})
    assert (out["selected"], out["selected_by"]) == ("cpu", "env")


@needs_cpu_build
def test_accelerator_with_unusable_backend_says_why(tmp_path: Path) -> None:
    add_backend(tmp_path, "fakeacc", device_type="fakeacc", priority=100, available=False,
                reason="driver 5.1 too old, need 6.0")
    out, _ = select_and_list([tmp_path], accelerator="fakeacc")
    assert "'fakeacc' (magi-backend-fakeacc): driver 5.1 too old, need 6.0" in out["error"]


@needs_cpu_build
def test_accelerator_with_its_backend_is_selected(tmp_path: Path) -> None:
    add_backend(tmp_path, "fakeacc", device_type="fakeacc", priority=100)
    out, _ = select_and_list([tmp_path], accelerator="fakeacc")
    assert (out["selected"], out["selected_by"]) == ("fakeacc", "probe")
    assert out["backends"]["fakeacc"]["selected"] is False  # to_dict(selected=...) is the caller's flag



# -- per-step hooks bound once ------------------------------------------------------------------

class _RangePlugin:
    """A plugin with one range implementation taking the spec's argument, and one taking none."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @magi_core.plugin.hookimpl
    def magi_range_push(self, name: str) -> None:
        self.names.append(name)

    @magi_core.plugin.hookimpl
    def magi_range_pop(self) -> None:
        self.names.append("pop")


def test_per_step_hooks_call_the_single_implementation_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.plugin.manager import _direct, _make_manager

    monkeypatch.delenv(ENV_TRACE, raising=False)
    pm = _make_manager("t")
    plugin = _RangePlugin()
    pm.register(plugin)
    through_pluggy = lambda name: pm.hook.magi_range_push(name=name)  # noqa: E731
    push = _direct(pm.hook.magi_range_push, ("name",), through_pluggy)
    assert push == plugin.magi_range_push  # no pluggy dispatch per unit and step
    push("unit0")
    assert plugin.names == ["unit0"]
    # arguments that differ from the spec's order keep pluggy's matching
    assert _direct(pm.hook.magi_range_push, ("other",), through_pluggy) is through_pluggy
    # a traced registry keeps dispatching, so MAGI_TRACE_HOOKS sees every call
    monkeypatch.setenv(ENV_TRACE, "1")
    assert _direct(pm.hook.magi_range_push, ("name",), through_pluggy) is through_pluggy
    assert _direct(None, ("name",), through_pluggy) is None


# -- capabilities (spec 1.1): what "auto" compiles units with, and whether generated code is called directly --------

CAPS_SCRIPT = """
import json
import magi_core
from magi_core.errors import ConfigError
b = magi_core.use_backend({name!r})
out = {{"caps": repr(b.capabilities), "auto": b.resolve_unit_compiler("auto"),
        "direct": b.allows_direct_unit_calls(True), "eager": b.resolve_unit_compiler("eager")}}
try:
    out["inductor"] = b.resolve_unit_compiler("inductor")
except ConfigError as exc:
    out["inductor_error"] = str(exc)
print(json.dumps(out))
"""


def test_backend_without_capabilities_gets_eager_units_and_no_direct_calls(tmp_path: Path) -> None:
    # a spec 1.0 backend for a device Inductor knows nothing about: never generated code, never direct calls
    add_backend(tmp_path, "oldacc", device_type="oldacc", priority=50)
    out = run_python(CAPS_SCRIPT.format(name="oldacc"), [tmp_path]).json()
    assert out["auto"] == "eager" and out["eager"] == "eager" and out["direct"] is False
    assert "inductor=False" in out["caps"] and "direct_unit_calls=False" in out["caps"]
    err = out["inductor_error"]
    assert "'oldacc'" in err and "unit_compiler='eager'" in err and "no code generator registered" in err


def test_declared_capabilities_decide_auto_and_direct_calls(tmp_path: Path) -> None:
    extra = """
        from magi_core.plugin import Capabilities

        @hookimpl
        def magi_capabilities():
            return Capabilities(inductor=True, default_unit_compiler="inductor", direct_unit_calls=True)
    """
    add_backend(tmp_path, "newacc", device_type="newacc", priority=50, extra=extra)
    out = run_python(CAPS_SCRIPT.format(name="newacc"), [tmp_path]).json()
    assert (out["auto"], out["inductor"], out["direct"]) == ("inductor", "inductor", True)


def test_capabilities_of_the_wrong_type_refuse_selection(tmp_path: Path) -> None:
    extra = "\n@hookimpl\ndef magi_capabilities():\n    return {'inductor': True}\n"
    add_backend(tmp_path, "dictcaps", device_type="dictcaps", priority=50, extra=extra)
    out, _ = select_and_list([tmp_path], select="magi_core.use_backend('dictcaps')")
    assert "magi_capabilities returned dict" in out["error"] and "Capabilities(" in out["error"]


def test_capabilities_reject_inconsistent_values() -> None:
    from magi_core.plugin import Capabilities

    assert Capabilities() == Capabilities(inductor=False, default_unit_compiler="eager", direct_unit_calls=False)
    with pytest.raises(ValueError, match="needs inductor=True"):
        Capabilities(default_unit_compiler="inductor")
    with pytest.raises(ValueError, match="needs inductor=True"):
        Capabilities(direct_unit_calls=True)
    with pytest.raises(ValueError, match="default_unit_compiler"):
        Capabilities(inductor=True, default_unit_compiler="tvm")
    with pytest.raises(TypeError):
        Capabilities(inductor=1)  # type: ignore[arg-type]


def test_default_capabilities_follow_inductors_codegen_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.codegen import common

    from magi_core.plugin.facade import default_capabilities, inductor_registered

    assert not inductor_registered("nosuchdev")
    assert default_capabilities("nosuchdev").inductor is False
    host = default_capabilities("cpu")  # Inductor compiles for the host, but "auto" stays eager there (as in 1.0)
    assert host.inductor and host.default_unit_compiler == "eager" and not host.direct_unit_calls
    # a device type whose extension registered an Inductor backend (torch_musa does; CUDA's is built in)
    monkeypatch.setitem(common.device_codegens, "regdev", common.device_codegens["cpu"])
    reg = default_capabilities("regdev")
    assert reg.inductor and reg.default_unit_compiler == "inductor" and not reg.direct_unit_calls


def test_cpu_backend_declares_inductor_and_direct_calls_but_stays_eager_for_auto(registry: Registry) -> None:
    backend = registry.use("cpu")
    assert backend is not None
    assert "magi_capabilities" in registry.records()["cpu"].callers
    expected = Capabilities(inductor=True, default_unit_compiler="eager", direct_unit_calls=True)
    assert backend.capabilities == expected and backend.declared_capabilities == expected
    assert backend.resolve_unit_compiler("auto") == "eager"
    assert backend.resolve_unit_compiler("inductor") == "inductor"
    assert backend.allows_direct_unit_calls(True) and not backend.allows_direct_unit_calls(False)
    with pytest.raises(magi_core.ConfigError, match="'tvm'"):
        backend.resolve_unit_compiler("tvm")


def _offload_units(monkeypatch: pytest.MonkeyPatch, caps: object, options: dict) -> tuple[list, bool]:
    """Compile a small model through a CPU backend declaring ``caps``: the executor's ``direct_units`` (None: an
    eager unit, never compiled; False: Inductor code called through its wrappers; True: called directly) and
    whether the output is right."""
    import dataclasses

    from helpers.tracking import compile_tracked, newest

    from magi_core.bench.models import TransformerSpec, build_transformer, example_input
    from magi_core.compile import backend as compile_backend

    monkeypatch.delenv(ENV_BACKEND, raising=False)
    cpu = Registry().use("cpu")
    assert cpu is not None
    limited = dataclasses.replace(cpu, declared_capabilities=caps)
    monkeypatch.setattr(compile_backend, "get_backend", lambda: limited)
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    torch._dynamo.reset()
    try:
        f = compile_tracked(model, options={"policy": "BASE", **options})
        with torch.no_grad():
            outs = [f(x, 1e-5) for _ in range(3)]
            ok = bool(torch.allclose(outs[-1], model(x, 1e-5), rtol=1e-5, atol=1e-5))
        return list(newest().executor.direct_units), ok
    finally:
        torch._dynamo.reset()


def test_offload_compiles_units_as_the_backend_capabilities_say(monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.plugin import Capabilities

    # "auto" on a backend whose default is Inductor, direct calls asked for by the config but not allowed
    caps = Capabilities(inductor=True, default_unit_compiler="inductor", direct_unit_calls=False)
    units, ok = _offload_units(monkeypatch, caps, {})
    assert ok and units and all(u is False for u in units), units  # Inductor units, wrapped calls only
    # the safe default: eager units, generated code never called
    units, ok = _offload_units(monkeypatch, Capabilities(), {})
    assert ok and all(u is None for u in units), units


def test_explicit_inductor_on_a_backend_without_inductor_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.plugin import Capabilities

    # torch.compile(backend=...) directly (not magi_core.offload): Dynamo wraps the backend's ConfigError
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        _offload_units(monkeypatch, Capabilities(reason="no code generator for this device"),
                       {"unit_compiler": "inductor"})
    assert isinstance(info.value.inner_exception, magi_core.ConfigError)
    text = str(info.value.inner_exception)
    assert "unit_compiler='inductor' cannot run on backend 'cpu'" in text and "unit_compiler='eager'" in text
    assert "no code generator for this device" in text


def test_repr_names_the_backend_not_its_bound_callables(registry: Registry) -> None:
    backend = registry.use("cpu")
    text = repr(backend)
    assert text.startswith("Backend(name='cpu', device_type='cpu'")
    assert f"package='magi-core {magi_core.__version__}'" in text and f"version='{torch.__version__}'" in text
    assert "hookspec=1" in text and "selected_by='explicit'" in text
    assert "lambda" not in text and "function" not in text and "module" not in text


# -- the CPU fallback warning names every other installed backend and why it is not used ---------------------------

def test_cpu_warning_lists_each_installed_backend_and_why_not(tmp_path: Path) -> None:
    add_backend(tmp_path, "absent", device_type="absent", priority=60, available=False,
                reason="no absent device visible")
    add_backend(tmp_path, "broken", device_type="broken", priority=60, probe_raises="driver exploded")
    add_backend(tmp_path, "shy", device_type="shy", priority=-3)
    out, run = select_and_list([tmp_path])
    assert out["selected"] == "cpu"
    warning = run.stderr[run.stderr.index("magi-core runs on the CPU backend"):]
    assert "such as magi-backend-<device>" not in warning
    lines = warning.splitlines()
    absent = next(line for line in lines if line.strip().startswith("absent "))
    assert "(magi-backend-absent 0.0.1): unavailable: no absent device visible" in absent
    broken = next(line for line in lines if line.strip().startswith("broken "))
    assert "refused: probe raised RuntimeError: driver exploded" in broken
    shy = next(line for line in lines if line.strip().startswith("shy "))
    assert "lower priority (-3) than 'cpu' (0)" in shy and "MAGI_BACKEND=shy" in shy
    assert "magi backends" in warning


# -- HostRangeTable: what its callables return -------------------------------------------------------------------

def test_host_range_table_refuses_a_callable_that_returns_no_error_code(caplog: pytest.LogCaptureFixture) -> None:
    from magi_core.plugin import HostRangeTable, HostRegisterError

    table = HostRangeTable("TOY", register=lambda ptr, nbytes: None, unregister=lambda ptr: "ok")
    with pytest.raises(HostRegisterError, match=r"register callable returned None .*must return the runtime's error"):
        table.register(0x1000, 64)
    assert table.ranges() == {}
    ok = HostRangeTable("TOY", register=lambda ptr, nbytes: 0, unregister=lambda ptr: "ok")
    ok.register(0x1000, 64)
    with pytest.raises(HostRegisterError, match="unregister callable returned 'ok'"):
        ok.unregister(0x1000)

    def boom() -> None:
        raise RuntimeError("clear failed")

    failing = HostRangeTable("TOY", register=lambda ptr, nbytes: 2, unregister=lambda ptr: 0,
                             error_text=lambda err: "out of memory", clear_error=boom)
    with caplog.at_level(logging.WARNING), pytest.raises(HostRegisterError, match="out of memory") as info:
        failing.register(0x2000, 64)  # the real error, not clear_error's
    assert info.value.code == 2
    assert any("clear_error() raised RuntimeError" in r.getMessage() for r in caplog.records)


def _installed(name: str) -> bool:
    import importlib_metadata

    return any(ep.name == name for ep in importlib_metadata.entry_points(group="magi.backends"))


@pytest.mark.skipif(not _installed("magidev"), reason="needs the example PrivateUse1 backend (examples/privateuse1)")
def test_default_config_runs_on_a_third_party_privateuse1_device() -> None:
    # "auto" must pick eager units here: Inductor would generate host code and feed it the device's tensors
    out = run_python("""
        import json, torch, magi_core
        from magi_core.bench.models import TransformerSpec, build_transformer, example_input
        spec = TransformerSpec(layers=2, hidden=32, heads=2)
        model = build_transformer(spec).eval()
        x = example_input(spec, tokens=4)
        with torch.no_grad():
            ref = model(x)
        b = magi_core.get_backend()
        f = magi_core.offload(model)
        with torch.no_grad():
            y = f(x.to(b.device())).cpu()
        ex = magi_core.handle(model).runtime.executor
        print(json.dumps({"backend": b.name, "auto": b.resolve_unit_compiler("auto"), "direct": ex.direct_units,
                          "err": float((y - ref).abs().max())}))
    """, env={"MAGI_BACKEND": "magidev"}, timeout=300).json()
    assert out["backend"] == "magidev" and out["auto"] == "eager"
    assert all(d is None for d in out["direct"])  # eager units: no generated code at all
    assert out["err"] < 1e-5
