"""OffloadConfig: defaults, validation, environment and torch.compile options, policy registration."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from magi_core import _env
from magi_core._env import parse_bytes
from magi_core.config import OffloadConfig, Policy, resolve_config
from magi_core.errors import ConfigError
from magi_core.plan import build_plan, check_policy, known_policies, register_policy, unregister_policy
from magi_core.plan.contract import Plan, make_profiles
from magi_core.plan.lookahead import lookahead_plan
from magi_core.plan.registry import get_scheduler, reload_policies


def test_defaults() -> None:
    c = OffloadConfig()
    assert c.policy is Policy.HEURISTIC
    assert (c.gpu_resident_weight_ratio, c.device_memory_budget_bytes) == (None, None)
    assert c.fits_card and c.resident_ratio == 0.0
    assert (c.bandwidth_safety_factor, c.prefetch_margin_ms, c.lookahead, c.warmup_calls) == (0.9, 0.1, 1, 2)
    assert c.unit_compiler == "auto" and c.max_unit_bytes is None
    assert c.probe_bytes(is_accelerator=True) == 1 << 30
    assert c.probe_bytes(is_accelerator=False) < 1 << 30
    assert OffloadConfig(unit_compiler=" Eager ").unit_compiler == "eager"  # normalised; "auto" is the backend's


@pytest.mark.parametrize("text", ["base", "BASE", " Base ", "cost_effective", "Cost-Effective", "heuristic"])
def test_policy_any_case(text: str) -> None:
    policy = OffloadConfig(policy=text).policy
    assert isinstance(policy, Policy)
    assert policy.value == text.strip().upper().replace("-", "_")


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("gpu_resident_weight_ratio", -0.1, "[0, 1]"),
        ("gpu_resident_weight_ratio", 1.5, "[0, 1]"),
        ("gpu_resident_weight_ratio", float("nan"), "number"),
        ("bandwidth_safety_factor", 0.0, "(0, 1]"),
        ("bandwidth_safety_factor", 1.01, "(0, 1]"),
        ("prefetch_margin_ms", -1.0, ">= 0"),
        ("lookahead", 0, ">= 1"),
        ("lookahead", 1.5, "integer"),
        ("lookahead", True, "integer"),
        ("unit_compiler", "tvm", "'auto'"),
        ("warmup_calls", -1, ">= 0"),
        ("max_unit_bytes", 0, "> 0"),
        ("bandwidth_probe_bytes", -5, "> 0"),
        ("device_memory_budget_bytes", 0, "> 0"),
        ("gpu_resident_weight_ratio", "half", "number"),
    ],
)
def test_invalid_values_name_field_value_and_range(field: str, value: object, valid: str) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**{field: value})  # type: ignore[arg-type]
    msg = str(info.value)
    assert field in msg and valid in msg
    assert repr(value) in msg or str(value) in msg


def test_unknown_policy_lists_known_ones() -> None:
    known = r"unknown offload policy '(fastest|FASTEST)'.*BASE, COST_EFFECTIVE, HEURISTIC"
    with pytest.raises(ConfigError, match=known) as info:
        check_policy("fastest")
    assert "register_policy" in str(info.value) and "magi.policies" in str(info.value)
    assert check_policy("Cost-Effective") == "COST_EFFECTIVE"


@pytest.mark.parametrize(("policy", "near"), [("FASTEST", None), ("heuristc", "HEURISTIC"), ("cost_efective",
                                                                                           "COST_EFFECTIVE")])
def test_unknown_policy_is_refused_on_construction(policy: str, near: str | None) -> None:
    with pytest.raises(ConfigError, match=r"unknown offload policy .*\(OffloadConfig.policy\)") as info:
        OffloadConfig(policy=policy)
    msg = str(info.value)
    assert "BASE, COST_EFFECTIVE, HEURISTIC" in msg and "register_policy" in msg
    assert (f"did you mean {near!r}?" in msg) if near else "did you mean" not in msg
    with pytest.raises(ConfigError, match=r"unknown offload policy .*\(OffloadConfig.policy\)"):
        OffloadConfig().replace(policy=policy)
    with pytest.raises(ConfigError, match=r"unknown offload policy .*from the environment: MAGI_OFFLOAD_POLICY"):
        resolve_config(None, environ={"MAGI_OFFLOAD_POLICY": policy})


def test_a_policy_unregistered_after_construction_is_refused_when_planning() -> None:
    register_policy("short_lived", EveryUnitAtStart)
    try:
        c = OffloadConfig(policy="short_lived")
    finally:
        unregister_policy("short_lived")
    with pytest.raises(ConfigError, match="unknown offload policy 'SHORT_LIVED'"):
        build_plan(make_profiles([100], [1.0]), 1e5, c)


def test_built_in_policies_do_not_consult_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config naming a built-in policy runs no entry-point discovery; a plugin name is looked up once built."""
    import magi_core.plan.registry as registry

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("OffloadConfig consulted the policy registry")

    monkeypatch.setattr(registry, "_discover", fail)
    monkeypatch.setattr(registry, "known_policies", fail)
    c = resolve_config(OffloadConfig(policy="base"), {"lookahead": 2}, environ={})
    assert (c.policy, c.lookahead) == (Policy.BASE, 2)
    assert OffloadConfig().policy is Policy.HEURISTIC


@pytest.mark.parametrize(("value", "message"), [("", "expected a policy name"), (3, "expected a policy name")])
def test_policy_must_be_a_name(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(policy=value)  # type: ignore[arg-type]


def test_ratio_and_budget_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="set only one"):
        OffloadConfig(gpu_resident_weight_ratio=0.5, device_memory_budget_bytes=1 << 30)
    assert OffloadConfig(device_memory_budget_bytes=1 << 30).gpu_resident_weight_ratio is None


def test_from_env() -> None:
    env = {
        "MAGI_OFFLOAD_POLICY": "cost_effective",
        "MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO": "0.25",
        "MAGI_OFFLOAD_LOOKAHEAD": "2",
        "MAGI_OFFLOAD_BANDWIDTH_PROBE_BYTES": "256MiB",
        "MAGI_OFFLOAD_MAX_UNIT_BYTES": "none",
        "MAGI_OFFLOAD_UNIT_COMPILER": "EAGER",
        "PATH": "/bin",
    }
    c = OffloadConfig.from_env(OffloadConfig(max_unit_bytes=10, warmup_calls=3), environ=env)
    assert c.policy is Policy.COST_EFFECTIVE
    assert c.gpu_resident_weight_ratio == 0.25 and c.lookahead == 2
    assert c.bandwidth_probe_bytes == 256 << 20
    assert c.unit_compiler == "eager" and c.warmup_calls == 3  # base kept where env says nothing
    assert c.max_unit_bytes == 10, "an explicit field beats MAGI_OFFLOAD_MAX_UNIT_BYTES"
    assert c.explicit_fields == {"max_unit_bytes", "warmup_calls"}, "fields filled from the environment stay defaults"


def test_from_env_reads_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAGI_OFFLOAD_WARMUP_CALLS", "0")
    assert OffloadConfig.from_env().warmup_calls == 0


def test_from_env_invalid_value_names_variable() -> None:
    with pytest.raises(ConfigError, match="MAGI_OFFLOAD_LOOKAHEAD"):
        OffloadConfig.from_env(environ={"MAGI_OFFLOAD_LOOKAHEAD": "two"})
    with pytest.raises(ConfigError, match=r"bandwidth_safety_factor=1\.5"):
        OffloadConfig.from_env(environ={"MAGI_OFFLOAD_BANDWIDTH_SAFETY_FACTOR": "1.5"})


def test_from_options() -> None:
    c = OffloadConfig.from_options({"policy": "base", "gpu_resident_weight_ratio": 0.5, "lookahead": "2"})
    assert (c.policy, c.gpu_resident_weight_ratio, c.lookahead) == (Policy.BASE, 0.5, 2)
    assert OffloadConfig.from_options(None) == OffloadConfig()


def test_from_options_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"'ratio'.*valid options: policy, gpu_resident_weight_ratio"):
        OffloadConfig.from_options({"ratio": 0.5})


def test_resolve_precedence_defaults_env_explicit_options() -> None:
    """defaults < MAGI_OFFLOAD_* < explicit config fields < torch.compile options."""
    base = OffloadConfig(policy="base", lookahead=3, warmup_calls=1)
    env = {"MAGI_OFFLOAD_LOOKAHEAD": "4", "MAGI_OFFLOAD_WARMUP_CALLS": "5", "MAGI_OFFLOAD_UNIT_COMPILER": "eager",
           "MAGI_OFFLOAD_PREFETCH_MARGIN_MS": "0.7"}
    c = resolve_config(base, {"lookahead": 2, "prefetch_margin_ms": 0.5}, environ=env)
    assert (c.policy, c.lookahead, c.prefetch_margin_ms, c.warmup_calls) == (Policy.BASE, 2, 0.5, 1)
    assert c.unit_compiler == "eager", "the environment fills a default"
    assert resolve_config(None, {"lookahead": 2}, environ=env).lookahead == 2, "options beat the environment"
    assert resolve_config(None, None, environ=env).lookahead == 4, "the environment beats the defaults"


def test_resolved_config_is_not_resolved_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment is applied once per compile: a resolved config passes through later layers unchanged."""
    from magi_core.compile.backend import config_from_options

    monkeypatch.setenv("MAGI_OFFLOAD_LOOKAHEAD", "4")
    base = OffloadConfig(warmup_calls=1)
    resolved = resolve_config(base)
    assert (resolved.lookahead, resolved.warmup_calls) == (4, 1) and resolved._resolved
    assert not base._resolved and resolved == OffloadConfig(lookahead=4, warmup_calls=1)
    assert resolved.explicit_fields == {"warmup_calls"}
    applied: list[int] = []
    real_from_env = OffloadConfig.from_env.__func__  # type: ignore[attr-defined]

    def counting(cls: type[OffloadConfig], *args: object, **kwargs: object) -> OffloadConfig:
        applied.append(1)
        return real_from_env(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(OffloadConfig, "from_env", classmethod(counting))
    monkeypatch.setenv("MAGI_OFFLOAD_LOOKAHEAD", "3")  # changed after resolution: not seen again
    assert resolve_config(resolved) is resolved
    assert config_from_options({"config": resolved}) is resolved
    assert config_from_options(resolved) is resolved
    assert applied == []
    # options on top of a resolved config: options over config and over the environment (applied once)
    again = config_from_options({"config": resolved, "warmup_calls": 0, "prefetch_margin_ms": 0.5})
    assert (again.lookahead, again.warmup_calls, again.prefetch_margin_ms) == (3, 0, 0.5)
    assert applied == [1] and again._resolved
    assert config_from_options({"config": resolved, "lookahead": 7}).lookahead == 7
    # a replaced copy is a new, unresolved config
    assert not resolved.replace(warmup_calls=0)._resolved
    # an unchanged config is marked on a copy, never on the caller's object
    monkeypatch.delenv("MAGI_OFFLOAD_LOOKAHEAD")
    plain = OffloadConfig()
    assert resolve_config(plain) == plain and resolve_config(plain) is not plain and not plain._resolved


def test_backend_options_check_the_policy() -> None:
    from magi_core.compile.backend import config_from_options

    with pytest.raises(ConfigError, match="unknown offload policy 'NOPE'"):
        config_from_options({"policy": "nope"})


def test_round_trip_to_dict() -> None:
    c = OffloadConfig(policy="cost_effective", gpu_resident_weight_ratio=0.3, max_unit_bytes=1 << 20)
    assert OffloadConfig.from_options(c.to_dict()) == c
    assert c.replace(lookahead=2).lookahead == 2 and c.lookahead == 1


@pytest.mark.parametrize(
    ("text", "value"),
    [("123", 123), ("1GiB", 1 << 30), ("2 MiB", 2 << 20), ("1.5GB", 1_500_000_000), ("1e6", 10**6), ("4kb", 4000)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "1.5", "12 parsecs", "-3", "1e400", "9" * 400, "1e300TiB", "nan", "inf"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


# -- the environment parser (magi_core._env) ----------------------------------------------------------------
def test_env_parsers_name_the_variable_and_the_fix() -> None:
    env = {"B": " Yes ", "N": "off", "I": "3", "LOW": "0", "BAD": "x", "F": "1.5", "NEG": "-1", "BLANK": "  "}
    assert (_env.env_bool("B", env), _env.env_bool("N", env), _env.env_bool("BLANK", env)) == (True, False, None)
    assert _env.env_int("I", 1, env) == 3 and _env.env_int("UNSET", 1, env) is None
    assert _env.env_float("F", 0.0, "GiB", env) == 1.5
    assert _env.env_str("BLANK", env) is None and _env.env_str("B", env) == "Yes"
    for call, var, fix in [
        (lambda: _env.env_bool("BAD", env), "BAD", "1/true/yes/on"),
        (lambda: _env.env_int("BAD", 1, env), "BAD", "whole number >= 1"),
        (lambda: _env.env_int("LOW", 1, env), "LOW", "whole number >= 1"),
        (lambda: _env.env_float("NEG", 0.0, "GiB", env), "NEG", "number of GiB >= 0"),
        (lambda: _env.first_env_int(("UNSET", "BAD", "I"), 1, environ=env), "BAD", "or unset it"),
    ]:
        with pytest.raises(ConfigError) as info:
            call()
        assert var in str(info.value) and fix in str(info.value)
    assert _env.first_env_int(("UNSET", "BAD", "NEG", "I"), 0, skip_invalid=True, environ=env) == 3


# -- explicit fields beat the environment -------------------------------------------------------------------
@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which variables were already warned about (the warnings are once per process)."""
    import magi_core.config as config_module

    monkeypatch.setattr(_env, "_warned_names", set())
    monkeypatch.setattr(config_module, "_ignored_noted", set())


def test_explicit_field_is_not_overridden_by_the_environment(
    fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"MAGI_OFFLOAD_POLICY": "base", "MAGI_OFFLOAD_LOOKAHEAD": "3"}
    with caplog.at_level("WARNING", logger="magi_core.config"):
        c = resolve_config(OffloadConfig(policy="HEURISTIC"), environ=env)
    assert c.policy is Policy.HEURISTIC, "set explicitly (to the default value): the environment does not win"
    assert c.lookahead == 3, "a field left at its default is filled from the environment"
    assert any("MAGI_OFFLOAD_POLICY" in r.getMessage() and "explicitly" in r.getMessage() for r in caplog.records)
    assert resolve_config(OffloadConfig(), environ=env).policy is Policy.BASE
    assert resolve_config(OffloadConfig(Policy.HEURISTIC), environ=env).policy is Policy.HEURISTIC  # positional


def test_explicit_fields_are_recorded() -> None:
    assert OffloadConfig().explicit_fields == frozenset()
    assert OffloadConfig("base", 0.5).explicit_fields == {"policy", "gpu_resident_weight_ratio"}
    c = OffloadConfig(lookahead=2)
    assert c.replace(warmup_calls=0).explicit_fields == {"lookahead", "warmup_calls"}
    assert OffloadConfig.from_options({"prefetch_margin_ms": "0.5"}, base=c).explicit_fields == {
        "lookahead", "prefetch_margin_ms"}
    assert c == OffloadConfig(lookahead=2) and OffloadConfig(policy="HEURISTIC") == OffloadConfig(), "not compared"
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(c)).explicit_fields == {"lookahead"}
    assert copy.deepcopy(c).explicit_fields == {"lookahead"}


def test_compile_options_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.compile.backend import config_from_options

    monkeypatch.setenv("MAGI_OFFLOAD_LOOKAHEAD", "4")
    monkeypatch.setenv("MAGI_OFFLOAD_WARMUP_CALLS", "0")
    c = config_from_options({"lookahead": 2, "config": OffloadConfig(warmup_calls=3)})
    assert (c.lookahead, c.warmup_calls) == (2, 3)
    assert config_from_options({}).lookahead == 4


def test_explicit_ratio_or_budget_keeps_the_other_out_of_the_environment(fresh_warnings: None) -> None:
    budget = OffloadConfig(device_memory_budget_bytes=1 << 30)
    c = resolve_config(budget, environ={"MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO": "0.5"})
    assert (c.gpu_resident_weight_ratio, c.device_memory_budget_bytes) == (None, 1 << 30)
    ratio = OffloadConfig(gpu_resident_weight_ratio=0.25)
    c = resolve_config(ratio, environ={"MAGI_OFFLOAD_DEVICE_MEMORY_BUDGET_BYTES": "1GiB"})
    assert (c.gpu_resident_weight_ratio, c.device_memory_budget_bytes) == (0.25, None)
    with pytest.raises(ConfigError, match="set only one.*MAGI_OFFLOAD_"):
        resolve_config(None, environ={"MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO": "0.5",
                                      "MAGI_OFFLOAD_DEVICE_MEMORY_BUDGET_BYTES": "1GiB"})


# -- unknown variables ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "closest"),
    [("MAGI_OFFLOAD_POLCY", "MAGI_OFFLOAD_POLICY"), ("MAGI_OFFLOAD_LOOKAHED", "MAGI_OFFLOAD_LOOKAHEAD"),
     ("MAGI_OFFLOAD_GPU_RESIDENT_RATIO", "MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO"),
     ("MAGI_BACKNED", "MAGI_BACKEND"), ("MAGI_PIN_BUDGET_GIB", "MAGI_PIN_BUDGET_GB"),
     ("MAGI_SHMDIR", "MAGI_SHM_DIR"), ("MAGI_TRACE_HOOK", "MAGI_TRACE_HOOKS")],
)
def test_unknown_variable_warns_once_naming_the_closest(
    name: str, closest: str, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    env = {name: "1"}
    with caplog.at_level("WARNING", logger="magi_core._env"):
        OffloadConfig.from_env(environ=env)
        OffloadConfig.from_env(environ=env)
    hits = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(hits) == 1, "once per process and name"
    assert f"did you mean {closest}?" in hits[0]


def test_unknown_offload_variable_without_a_close_match_lists_the_valid_ones(
    fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="magi_core._env"):
        env = {"MAGI_OFFLOAD_ZZZZZZZZ": "1", "MAGI_ATTENTION_SOMETHING": "1", "MAGI_BACKEND": "x"}
        msgs = _env.warn_unknown_env(env)
    assert len(msgs) == 1 and "MAGI_OFFLOAD_ZZZZZZZZ" in msgs[0] and "MAGI_OFFLOAD_POLICY" in msgs[0]
    # another package's MAGI_* variable with no close magi-core name is left alone (debug log only)
    assert not any("MAGI_ATTENTION_SOMETHING" in r.getMessage() for r in caplog.records)


def test_registry_knows_every_variable_magi_core_reads() -> None:
    import re

    import magi_core

    root = Path(magi_core.__file__).parent
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"[\"'](MAGI_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    read -= {"MAGI_OFFLOAD"}
    assert read, "the scan finds the variables"
    assert read <= _env.KNOWN_VARIABLES, sorted(read - _env.KNOWN_VARIABLES)
    fields = {f"MAGI_OFFLOAD_{name.upper()}" for name in OffloadConfig.field_names()}
    assert fields <= _env.KNOWN_VARIABLES
    assert {"MAGI_BACKEND", "MAGI_TRACE_HOOKS", "MAGI_SHM_DIR", "MAGI_EP_SIZE", "MAGI_SKIP_SHM",
            "MAGI_PIN_BUDGET_GB", "MAGI_PIN_CONCURRENCY"} <= _env.KNOWN_VARIABLES


def test_trace_hooks_reads_boolean_words(monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.plugin.manager import tracing_enabled

    for value, enabled in [("1", True), ("yes", True), ("0", False), ("false", False), ("off", False), (" ", False)]:
        monkeypatch.setenv("MAGI_TRACE_HOOKS", value)
        assert tracing_enabled() is enabled, value


# -- non-finite numbers -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [("MAGI_OFFLOAD_PREFETCH_MARGIN_MS", "inf"), ("MAGI_OFFLOAD_PREFETCH_MARGIN_MS", "nan"),
     ("MAGI_OFFLOAD_PREFETCH_MARGIN_MS", "1e400"), ("MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO", "nan"),
     ("MAGI_OFFLOAD_BANDWIDTH_SAFETY_FACTOR", "-inf"), ("MAGI_OFFLOAD_DEVICE_MEMORY_BUDGET_BYTES", "1e400"),
     ("MAGI_OFFLOAD_MAX_UNIT_BYTES", "1e400GiB"), ("MAGI_OFFLOAD_BANDWIDTH_PROBE_BYTES", "inf"),
     ("MAGI_OFFLOAD_LOOKAHEAD", "nan"), ("MAGI_OFFLOAD_WARMUP_CALLS", "1e400")],
)
def test_non_finite_offload_variables_are_config_errors(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        resolve_config(None, environ={name: value})


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "1e300"])
def test_non_finite_host_variables_are_config_errors(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from magi_core.host.config import HostOptions

    for name in ("MAGI_PIN_BUDGET_GB", "X"):
        with pytest.raises(ConfigError, match=name):
            _env.env_gib_bytes(name, {name: value})
    assert _env.env_gib_bytes("X", {"X": "1.5"}) == 3 << 29
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", value)
    with pytest.raises(ConfigError, match="MAGI_PIN_BUDGET_GB"):
        HostOptions().resolve()
    if value != "1e300":  # finite as a number of GiB, too large only as bytes
        for minimum in (0.0, None):
            with pytest.raises(ConfigError, match="F='.*finite"):
                _env.env_float("F", minimum, "GiB", {"F": value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("prefetch_margin_ms", float("inf")), ("gpu_resident_weight_ratio", 10**400),
     ("bandwidth_safety_factor", float("-inf"))],
)
def test_non_finite_field_values_are_config_errors(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"OffloadConfig.{field}=.*finite"):
        OffloadConfig(**{field: value})  # type: ignore[arg-type]


# -- policy plugins -----------------------------------------------------------------------------------------
class EveryUnitAtStart:
    """A test policy: copy every streamed unit at step start."""

    def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
        plan = lookahead_plan("AT_START", profiles, frozenset(), 10**9, bandwidth_Bps)
        return Plan("AT_START", plan.resident, plan.prefetch_at, plan.next_step, notes={"custom": 1.0})


@pytest.fixture
def at_start_policy() -> Iterator[None]:
    register_policy("at_start", EveryUnitAtStart)
    try:
        yield
    finally:
        unregister_policy("at_start")


def test_register_policy(at_start_policy: None) -> None:
    assert "AT_START" in known_policies()
    c = OffloadConfig(policy="At_Start")
    assert c.policy == "AT_START"
    profiles = make_profiles([100, 100, 100], [1.0] * 3)
    plan = build_plan(profiles, 1e5, c)
    assert plan.notes == {"custom": 1.0} and plan.prefetch_at[-1] == (0, 1, 2)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("AT_START", EveryUnitAtStart)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("base", EveryUnitAtStart)


def test_unregistered_policy_is_gone() -> None:
    register_policy("temporary", EveryUnitAtStart)
    unregister_policy("temporary")
    with pytest.raises(ConfigError, match="unknown offload policy 'temporary'"):
        get_scheduler("temporary")


def test_plugin_plan_is_validated() -> None:
    class Broken:
        def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
            return Plan("BROKEN", frozenset(), {-1: ()})

    register_policy("broken", Broken)
    try:
        with pytest.raises(ValueError, match="prefetch_at"):
            build_plan(make_profiles([100], [1.0]), 1e5, OffloadConfig(policy="broken"))
    finally:
        unregister_policy("broken")


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (dist-info on sys.path) declaring ``magi.policies`` entry points."""
    (tmp_path / "magi_policy_plugin_test.py").write_text(textwrap.dedent('''
        from magi_core.plan.lookahead import lookahead_plan

        class TwoAhead:
            def plan(self, profiles, bandwidth_Bps, config):
                return lookahead_plan("TWO_AHEAD", profiles, frozenset(), 2, bandwidth_Bps)
    '''))
    info = tmp_path / "magi_policy_plugin_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: magi-policy-plugin-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[magi.policies]\ntwo_ahead = magi_policy_plugin_test:TwoAhead\nbroken_one = no_such_module_xyz:Nope\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reload_policies()
    try:
        yield tmp_path
    finally:
        monkeypatch.undo()
        reload_policies()


def test_entry_point_policy_discovered(plugin_dist: Path) -> None:
    assert "TWO_AHEAD" in known_policies()
    assert "BROKEN_ONE" not in known_policies()
    plan = build_plan(make_profiles([100] * 4, [1.0] * 4), 1e5, OffloadConfig(policy="two_ahead"))
    assert plan.policy == "TWO_AHEAD" and plan.prefetch_at[-1] == (0, 1)
    with pytest.raises(ConfigError, match=r"failed to load: ModuleNotFoundError.*known policies"):
        get_scheduler("broken_one")


def test_entry_point_policy_gone_after_uninstall(plugin_dist: Path) -> None:
    assert "TWO_AHEAD" in known_policies()
    import sys

    sys.path.remove(str(plugin_dist))
    reload_policies()
    assert "TWO_AHEAD" not in known_policies()


@pytest.mark.parametrize(
    ("given", "stored", "device_total", "in_bytes"),
    [
        ("12GiB", 12 << 30, None, 12 << 30),
        (" 512 MiB ", 512 << 20, None, 512 << 20),
        ("80%", "80%", 1000, 800),
        ("12.5%", "12.5%", 1 << 30, (1 << 30) // 8),
        ("auto", None, None, None),
        (4096, 4096, None, 4096),
    ],
)
def test_budget_takes_sizes_shares_and_auto(given: object, stored: object, device_total: int | None,
                                            in_bytes: int | None) -> None:
    """Budgets are bytes, byte sizes, a share of the device or "auto" (the fit-the-card default)."""
    c = OffloadConfig(device_memory_budget_bytes=given)  # type: ignore[arg-type]
    assert c.device_memory_budget_bytes == stored
    assert c.budget_bytes(device_total) == in_bytes
    assert c.fits_card == (stored is None)


@pytest.mark.parametrize("given", ["0%", "101%", "-5%", "half%", "12 apples", "nan%", 0, -1, 1.5])
def test_bad_budgets_name_the_forms_that_work(given: object) -> None:
    with pytest.raises(ConfigError, match="device_memory_budget_bytes"):
        OffloadConfig(device_memory_budget_bytes=given)  # type: ignore[arg-type]


def test_a_share_of_an_unknown_device_asks_for_bytes() -> None:
    with pytest.raises(ConfigError, match="give bytes instead"):
        OffloadConfig(device_memory_budget_bytes="50%").budget_bytes(None)


def test_budget_share_from_the_environment() -> None:
    c = resolve_config(environ={"MAGI_OFFLOAD_DEVICE_MEMORY_BUDGET_BYTES": "50%"})
    assert c.device_memory_budget_bytes == "50%" and not c.fits_card
    c = resolve_config(environ={"MAGI_OFFLOAD_GPU_RESIDENT_WEIGHT_RATIO": "none"})
    assert c.gpu_resident_weight_ratio is None and c.fits_card


@pytest.mark.parametrize(("field", "value", "near"), [
    ("unit_compiler", "inductr", "inductor"), ("unit_compiler", "triton", None),
    ("transfer", "per-tensor", "per_tensor"), ("transfer", "units", "unit"),
    ("exchange", "of", "off"), ("exchange", "always", None),
])
def test_closed_string_fields_are_refused_with_a_did_you_mean(field: str, value: str, near: str | None) -> None:
    with pytest.raises(ConfigError, match=f"OffloadConfig.{field}={value!r} is invalid") as info:
        OffloadConfig(**{field: value})  # type: ignore[arg-type]
    msg = str(info.value)
    assert "valid: " in msg and ((f"did you mean {near!r}?" in msg) if near else "did you mean" not in msg)


def test_budget_typo_of_auto_suggests_it() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'auto'\?"):
        OffloadConfig(device_memory_budget_bytes="atuo")


@pytest.mark.parametrize("text", ["2GB", "2GiB", "512MB", "512 MiB", "1e9", "4096"])
@pytest.mark.parametrize("field", ["max_unit_bytes", "bandwidth_probe_bytes", "device_memory_budget_bytes"])
def test_byte_sizes_work_in_code_as_in_the_environment(field: str, text: str) -> None:
    """One parser: a size the environment accepts for a byte-size field is accepted in code, with the same value."""
    in_code = getattr(OffloadConfig(**{field: text}), field)  # type: ignore[arg-type]
    from_env = getattr(resolve_config(None, environ={f"MAGI_OFFLOAD_{field.upper()}": text}), field)
    assert in_code == from_env == parse_bytes(text) and isinstance(in_code, int)


def test_a_byte_size_that_does_not_parse_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"OffloadConfig.max_unit_bytes='2 gigs' is invalid: not a byte size"):
        OffloadConfig(max_unit_bytes="2 gigs")
