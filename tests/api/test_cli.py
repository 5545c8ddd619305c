"""The ``magi`` command, run as ``python -m magi_core`` in fresh processes over real entry points."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import importlib_metadata
import pytest
import torch
from helpers.fake_backends import Run, add_backend, run_python

import magi_core
from magi_core import cli
from magi_core.plugin.manager import REGISTRY
from magi_core.plugin.spec import HOOKSPEC_VERSION


def magi(*argv: str, paths: tuple[Path, ...] = (), env: dict[str, str] | None = None) -> Run:
    """Run ``python -m magi_core ARGV`` with ``paths`` on PYTHONPATH."""
    return run_python("", paths, env, args=["-m", "magi_core", *argv])


def _json(run: Run) -> dict[str, Any]:
    return json.loads(run.stdout)


def installed_backend_names() -> set[str]:
    return {ep.name for ep in importlib_metadata.entry_points(group="magi.backends")}


def test_backends_json_lists_every_installed_backend_and_one_selection() -> None:
    run = magi("backends", "--json")
    assert run.returncode == 0, run.stderr
    report = _json(run)
    assert report["magi_core_version"] == magi_core.__version__
    assert report["hookspec_version"] == HOOKSPEC_VERSION
    assert report["torch_version"] == torch.__version__
    names = [b["name"] for b in report["backends"]]
    assert set(names) == installed_backend_names() and names == sorted(names)
    cpu = next(b for b in report["backends"] if b["name"] == "cpu")
    assert cpu["package"] == "magi-core" and cpu["package_version"] == magi_core.__version__
    assert cpu["device_type"] == "cpu" and cpu["priority"] == 0 and cpu["available"]
    assert cpu["hookspec_versions"] == ["1"] and "magi_range_push" in cpu["missing_optional_hooks"]
    selected = [b["name"] for b in report["backends"] if b["selected"]]
    assert selected == [report["selected"]] and report["selected_by"] == "probe"
    assert report["selection_error"] is None
    for b in report["backends"]:
        assert b["available"] == (b["why_unavailable"] is None)


def test_selection_reason_explicit_env_probe(tmp_path: Path) -> None:
    add_backend(tmp_path, "fast", device_type="fast", priority=50)
    by_probe = _json(magi("backends", "--json", paths=(tmp_path,)))
    assert (by_probe["selected"], by_probe["selected_by"]) == ("fast", "probe")
    by_env = _json(magi("backends", "--json", paths=(tmp_path,), env={"MAGI_BACKEND": "cpu"}))
    assert (by_env["selected"], by_env["selected_by"]) == ("cpu", "env")
    explicit = _json(magi("--backend", "fast", "backends", "--json", paths=(tmp_path,), env={"MAGI_BACKEND": "cpu"}))
    assert (explicit["selected"], explicit["selected_by"]) == ("fast", "explicit")
    fast = next(b for b in explicit["backends"] if b["name"] == "fast")
    assert fast["selected"] and fast["package"] == "magi-backend-fast" and fast["priority"] == 50


def test_selection_error_exits_1_and_still_lists(tmp_path: Path) -> None:
    add_backend(tmp_path, "fast", device_type="fast", priority=50)
    run = magi("backends", "--json", paths=(tmp_path,), env={"MAGI_BACKEND": "nosuch"})
    assert run.returncode == 1
    report = _json(run)
    assert report["selected"] is None and "'nosuch'" in report["selection_error"]
    assert {"cpu", "fast"} <= {b["name"] for b in report["backends"]}
    assert not any(b["selected"] for b in report["backends"])
    assert "selection error" in run.stderr and "nosuch" in run.stderr
    text = magi("backends", paths=(tmp_path,), env={"MAGI_BACKEND": "nosuch"})
    assert text.returncode == 1
    assert "selection error: magi backend 'nosuch'" in text.stdout and "fast" in text.stdout


def test_text_listing_shows_why_unavailable_and_missing_hooks(tmp_path: Path) -> None:
    add_backend(tmp_path, "flaky", device_type="flaky", priority=50, probe_raises="no driver loaded")
    add_backend(tmp_path, "absent", device_type="absent", priority=60, available=False,
                reason="no absent device visible", omit=["magi_range_push", "magi_range_pop"])
    run = magi("backends", paths=(tmp_path,))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    flaky = next(line for line in lines if line.split()[:1] == ["flaky"])
    assert "magi-backend-flaky 0.0.1" in flaky and "refused: probe raised RuntimeError: no driver loaded" in flaky
    absent = next(line for line in lines if line.split()[:1] == ["absent"])
    assert "60" in absent and "unavailable: no absent device visible" in absent
    assert "absent: entry point fake_absent; backend version 9.9; hook-spec versions 1; " \
           "optional hooks missing: magi_range_push, magi_range_pop" in run.stdout
    cpu = next(line for line in lines if line.split()[:2] == ["*", "cpu"])
    assert "available, selected" in cpu
    assert lines[-1] == "selected: cpu (by probe: the highest-priority available backend)"
    assert "no driver loaded" in run.stderr  # the probe error is logged too


def test_version() -> None:
    run = magi("--version")
    assert run.returncode == 0
    expected = f"magi-core {magi_core.__version__} (hook spec {HOOKSPEC_VERSION}, torch {torch.__version__})"
    assert run.stdout.strip() == expected


def test_trace_hooks_env_logs_hook_calls_from_the_cli() -> None:
    run = magi("backends", env={"MAGI_TRACE_HOOKS": "1"})
    assert run.returncode == 0, run.stderr
    assert "hook trace [cpu]" in run.stderr and "magi_probe [hook]" in run.stderr
    quiet = magi("backends")
    assert "hook trace" not in quiet.stderr


def test_console_script_points_at_cli_main() -> None:
    scripts = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="console_scripts")}
    assert scripts.get("magi") == "magi_core.cli:main"


def test_no_command_prints_help_and_exits_2() -> None:
    run = magi()
    assert run.returncode == 2
    for word in ("backends", "demo", "bench", "--version"):
        assert word in run.stdout


@pytest.mark.parametrize("command", sorted(cli.LAZY_COMMANDS))
def test_lazy_subcommands_dispatch_or_say_they_are_missing(command: str) -> None:
    module = cli.load_command_module(command)
    run = magi(command, "--help")
    if module is None:
        assert run.returncode == 2 and f"magi {command}: not available" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert "usage: magi " + command in run.stdout


@pytest.fixture
def fake_command_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real module on sys.path implementing the add_arguments/main contract, wired as ``magi demo``."""
    (tmp_path / "fake_demo_cmd.py").write_text(textwrap.dedent('''
        import argparse
        CALLS = []
        def add_arguments(parser: argparse.ArgumentParser) -> None:
            parser.add_argument("--steps", type=int, default=1)
        def main(args: argparse.Namespace) -> int:
            CALLS.append(args.steps)
            return 7 if args.steps > 2 else 0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.LAZY_COMMANDS, "demo", ("fake_demo_cmd", "fake demo"))
    monkeypatch.delenv("MAGI_BACKEND", raising=False)
    REGISTRY.reset()
    yield "fake_demo_cmd"
    sys.modules.pop("fake_demo_cmd", None)
    REGISTRY.reset()


def test_lazy_dispatch_passes_parsed_arguments(fake_command_module: str) -> None:
    assert fake_command_module not in sys.modules
    assert cli.main(["backends", "--json"]) in (0, 1)
    assert fake_command_module not in sys.modules  # imported only when its subcommand runs
    assert cli.main(["demo", "--steps", "5"]) == 7
    assert cli.main(["--backend", "cpu", "demo"]) == 0
    assert sys.modules[fake_command_module].CALLS == [5, 1]


def test_lazy_dispatch_of_missing_module_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.LAZY_COMMANDS, "bench", ("magi_core.no_such_bench_module", "missing"))
    assert cli.main(["bench", "--anything"]) == 2
    assert "magi bench: not available" in capsys.readouterr().err


def test_backend_option_with_unusable_backend_exits_1(fake_command_module: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--backend", "nosuch", "demo"]) == 1
    assert "'nosuch'" in capsys.readouterr().err
    assert sys.modules[fake_command_module].CALLS == []


def test_build_parser_without_lazy_modules_knows_all_commands() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["backends", "--json"])
    assert isinstance(args, argparse.Namespace) and args.json and args.func is cli.cmd_backends


# -- why each backend lost, --check, -v ------------------------------------------------------------------------------

def test_listing_says_why_each_backend_was_not_selected(tmp_path: Path) -> None:
    add_backend(tmp_path, "fast", device_type="fast", priority=50)
    add_backend(tmp_path, "slow", device_type="slow", priority=10)
    add_backend(tmp_path, "absent", device_type="absent", priority=60, available=False, reason="no absent device")
    add_backend(tmp_path, "flaky", device_type="flaky", priority=70, probe_raises="no driver loaded")
    report = _json(magi("backends", "--json", paths=(tmp_path,)))
    by_name = {b["name"]: b for b in report["backends"]}
    assert report["selected"] == "fast" and by_name["fast"]["lost"] is None and by_name["fast"]["status"] == "available"
    assert by_name["slow"]["lost"].startswith("lower priority (10) than 'fast' (50)")
    assert by_name["cpu"]["lost"].startswith("lower priority (0) than 'fast' (50)")
    assert by_name["absent"]["lost"] == "unavailable: no absent device" and by_name["absent"]["status"] == "unavailable"
    assert by_name["flaky"]["lost"] == "refused: probe raised RuntimeError: no driver loaded"
    assert by_name["flaky"]["status"] == "refused"
    env = _json(magi("backends", "--json", paths=(tmp_path,), env={"MAGI_BACKEND": "slow"}))
    fast = next(b for b in env["backends"] if b["name"] == "fast")
    assert fast["lost"] == "available, but MAGI_BACKEND=slow selects 'slow'"
    text = magi("backends", paths=(tmp_path,)).stdout
    slow = next(line for line in text.splitlines() if line.split()[:1] == ["slow"])
    assert "lower priority (10) than 'fast' (50); select it with MAGI_BACKEND=slow" in slow


BROKEN_DEVICE = """
import contextlib, torch
INIT = []
class Stream:                      # not a torch.Stream: record_stream rejects it
    def __init__(self, device=None, priority=0):
        INIT.append("stream")      # creating a stream initialises this device
class Event:
    def __init__(self, blocking=False):   # no enable_timing
        INIT.append("event")
def current_stream(device=None):
    INIT.append("current_stream")
    return Stream()
@contextlib.contextmanager
def stream(s):
    yield
def synchronize(device=None):
    pass
def is_initialized():
    return bool(INIT)
def current_device():
    return 0
"""

BROKEN_BACKEND_EXTRA = """
import fake_brokendev_module

@hookimpl
def magi_device_module():
    return fake_brokendev_module

@hookimpl
def magi_to_method_aliases():
    return ("to", "not_a_tensor_method")
"""


def test_check_reports_each_problem_with_its_fix_without_initialising_the_device(tmp_path: Path) -> None:
    from helpers.fake_backends import backend_source, write_dist

    source = backend_source("brokendev", 50, omit=["magi_device_module", "magi_to_method_aliases"],
                            extra=BROKEN_BACKEND_EXTRA)
    write_dist(tmp_path, "magi-backend-brokendev", {"fake_brokendev": source, "fake_brokendev_module": BROKEN_DEVICE},
               {"brokendev": "fake_brokendev"})
    run = magi("backends", "--check", "brokendev", paths=(tmp_path,))
    assert run.returncode == cli.EXIT_CHECK_FAILED, run.stdout + run.stderr
    out = run.stdout[run.stdout.index("check of backend 'brokendev'"):]
    assert "Stream is not a torch.Stream subclass" in out and "derive Stream from torch.Stream" in out
    assert "Event does not accept enable_timing" in out
    for attr in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "is_available"):
        assert f"lacks {attr}" in out, attr
    assert "'not_a_tensor_method' is not a torch.Tensor method" in out
    assert out.count("fix: ") == out.count(". magi_") + out.count(". load") + out.count(". install")
    assert "device initialised after the check: no" in out  # classes inspected, never instantiated
    report = _json(magi("backends", "--json", "--check", "brokendev", paths=(tmp_path,)))
    check = report["check"]
    assert check["backend"] == "brokendev" and check["ok"] is False and check["initialised"] is False
    hooks = {p["hook"] for p in check["problems"]}
    assert hooks == {"magi_device_module", "magi_to_method_aliases"}
    assert all(p["what"] and p["fix"] for p in check["problems"])
    assert any("magi_capabilities not implemented" in n for n in check["notes"])


def test_check_of_a_conforming_backend_passes() -> None:
    run = magi("backends", "--check", "cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "check of backend 'cpu': no problems found" in run.stdout
    assert "capabilities: Capabilities(inductor=True, default_unit_compiler='eager'" in run.stdout
    nosuch = magi("backends", "--check", "nosuch")
    assert nosuch.returncode == cli.EXIT_CHECK_FAILED and "no backend named 'nosuch' is installed" in nosuch.stdout


def test_verbose_listing_shows_the_load_error_traceback(tmp_path: Path) -> None:
    from helpers.fake_backends import write_dist

    write_dist(tmp_path, "magi-backend-broken", {"fake_broken": "import no_such_module_xyz\n"},
               {"broken": "fake_broken"})
    quiet = magi("backends", paths=(tmp_path,))
    assert "Traceback" not in quiet.stdout and "run `magi -v backends`" in quiet.stdout
    loud = magi("-v", "backends", paths=(tmp_path,))
    assert "Traceback (most recent call last)" in loud.stdout and 'fake_broken.py", line 1' in loud.stdout
    also = magi("backends", "-v", paths=(tmp_path,))
    assert "Traceback (most recent call last)" in also.stdout
    broken = next(b for b in _json(magi("backends", "--json", paths=(tmp_path,)))["backends"] if b["name"] == "broken")
    assert "ModuleNotFoundError" in broken["error_traceback"]


# -- magi demo on the CPU: what it shows, what each column means ---------------------------------------------------

def test_demo_on_the_cpu_says_what_it_shows_and_explains_its_columns() -> None:
    run = magi("demo", "--layers", "2", "--hidden", "32", "--heads", "2", "--tokens", "8", "--steps", "1",
               "--policies", "BASE", "--ratios", "0", "--unit-compiler", "eager", "--no-progress")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    intro = out.index("this run checks correctness, not speed")
    header = next(line for line in out.splitlines() if line.startswith("run "))
    assert intro < out.index(header)  # said up front
    for left_out in ("step ms", "planned ms", "peak dev MB", "copy GB/s", "err vs fp32"):  # noise / not measurable
        assert left_out not in header and f"  {left_out} " not in out
    legend = out[out.index("columns:"):]
    for column in ("run", "compiler", "streamed MB/step", "err vs resident", "correct"):
        assert column in header and legend.count(f"  {column} ") == 1, column  # each explained once
    row = next(line for line in out.splitlines() if line.startswith("BASE r=0 "))
    assert row.split()[-1] == "yes"  # the verdict of each policy and ratio
    assert "PASSED" in out and "not meaningful there" not in out


# -- what get_backend() would refuse is a selection error in the listing too; errors of a command are one line ------

def test_listing_reports_what_building_the_backend_refuses(tmp_path: Path) -> None:
    add_backend(tmp_path, "noto", device_type="noto", priority=50, aliases=("orig_to",))
    run = magi("backends", "--json", paths=(tmp_path,))
    assert run.returncode == cli.EXIT_SELECTION_ERROR, run.stdout + run.stderr
    report = _json(run)
    assert report["selected"] is None and "magi_to_method_aliases must include 'to'" in report["selection_error"]
    demo = magi("demo", "--steps", "1", paths=(tmp_path,))
    assert demo.returncode == cli.EXIT_SELECTION_ERROR
    assert "Traceback" not in demo.stderr and "magi demo: backend 'noto'" in demo.stderr, demo.stderr
    assert "magi_to_method_aliases must include 'to'" in demo.stderr and "`magi -v demo`" in demo.stderr


def test_a_malformed_hookspec_answer_is_named_as_such(tmp_path: Path) -> None:
    add_backend(tmp_path, "strver", device_type="strver", priority=50,
                omit=["magi_hookspec_versions"], extra='@hookimpl\ndef magi_hookspec_versions():\n    return "1"\n')
    report = _json(magi("backends", "--json", paths=(tmp_path,)))
    rec = next(b for b in report["backends"] if b["name"] == "strver")
    assert rec["status"] == "refused" and rec["spec_error"].startswith("TypeError: magi_hookspec_versions returned '1'")
    assert rec["lost"].startswith("refused: magi_hookspec_versions failed: TypeError")
    assert "supports no" not in rec["lost"]
    check = magi("backends", "--check", "strver", paths=(tmp_path,))
    assert check.returncode == cli.EXIT_CHECK_FAILED and "magi_hookspec_versions failed: TypeError" in check.stdout


def test_check_does_not_blame_the_probe_for_the_host_being_initialised(tmp_path: Path) -> None:
    add_backend(tmp_path, "hostly", device_type="cpu", priority=-5, omit=["magi_device_module"],
                extra="import torch\n@hookimpl\ndef magi_device_module():\n    return torch.cpu\n")
    run = magi("backends", "--json", "--check", "hostly", paths=(tmp_path,))
    check = _json(run)["check"]
    assert "magi_probe" not in {p["hook"] for p in check["problems"]}, check
    assert any("the host needs no initialisation" in n for n in check["notes"])
