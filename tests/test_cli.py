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
    assert "magi-backend-flaky 0.0.1" in flaky and "unavailable: probe raised RuntimeError: no driver loaded" in flaky
    absent = next(line for line in lines if line.split()[:1] == ["absent"])
    assert "60" in absent and "unavailable: no absent device visible" in absent
    assert "absent: entry point fake_absent; backend version 9.9; hook-spec versions 1; " \
           "optional hooks missing: magi_range_push, magi_range_pop" in run.stdout
    cpu = next(line for line in lines if line.split()[:2] == ["*", "cpu"])
    assert "available" in cpu
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
