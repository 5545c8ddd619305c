"""A machine without an accelerator is not an error: the CPU fallback is said once at INFO (not a warning every
process prints), and ``magi backends --check`` reports a backend whose device is absent as skipped checks, not
problems."""

from __future__ import annotations

import json
from pathlib import Path

import importlib_metadata
import pytest
import torch
from helpers.fake_backends import add_backend, backend_source, run_python, write_dist

from magi_core import cli

SELECT = "import magi_core\nmagi_core.get_backend()\n"


def test_cpu_fallback_is_quiet_by_default_and_said_once_at_info(tmp_path: Path) -> None:
    add_backend(tmp_path, "absent", device_type="absent", priority=60, available=False,
                reason="no absent device visible")
    quiet = run_python(SELECT + "magi_core.get_backend()\n", [tmp_path])
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", quiet.stderr  # nothing at the default level (WARNING)
    loud = run_python("import logging\nlogging.basicConfig(level=logging.INFO)\n" + SELECT
                      + "magi_core.get_backend()\n", [tmp_path])
    assert loud.stderr.count("Installed backends not used") == 1, loud.stderr
    assert "INFO" in loud.stderr.split("Installed backends not used")[0].splitlines()[-1]


def test_a_refused_backend_still_warns(tmp_path: Path) -> None:
    add_backend(tmp_path, "broken", device_type="broken", priority=60, probe_raises="driver exploded")
    run = run_python(SELECT, [tmp_path])
    assert "driver exploded" in run.stderr and "Installed backends not used" not in run.stderr


STREAMLESS_DEVICE = """
class Stream:                      # a placeholder, as a torch build without the accelerator has
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no device")
def is_initialized():
    return False
"""

STREAMLESS_EXTRA = """
import fake_gone_module

@hookimpl
def magi_device_module():
    return fake_gone_module
"""


def _check(name: str, paths: list[Path]) -> tuple[int, dict, str]:
    js = run_python("", paths, args=["-m", "magi_core", "backends", "--json", "--check", name])
    text = run_python("", paths, args=["-m", "magi_core", "backends", "--check", name])
    return js.returncode, json.loads(js.stdout)["check"], text.stdout


def test_check_of_a_backend_whose_device_is_absent_skips_what_needs_it(tmp_path: Path) -> None:
    source = backend_source("gone", 50, available=False, reason="no gone device visible",
                            omit=["magi_device_module"], extra=STREAMLESS_EXTRA)
    write_dist(tmp_path, "magi-backend-gone", {"fake_gone": source, "fake_gone_module": STREAMLESS_DEVICE},
               {"gone": "fake_gone"})
    rc, check, text = _check("gone", [tmp_path])
    assert rc == cli.EXIT_OK and check["ok"] and check["problems"] == [], check
    assert any("no gone device visible" in s for s in check["skipped"]), check
    assert any("Stream is not a torch.Stream subclass" in s for s in check["skipped"]), check
    assert "no problems found;" in text and "check(s) skipped: its device is absent here" in text, text


def test_check_of_a_present_device_still_reports_its_problems(tmp_path: Path) -> None:
    source = backend_source("here", 50, omit=["magi_device_module"], extra=STREAMLESS_EXTRA.replace("gone", "here"))
    write_dist(tmp_path, "magi-backend-here", {"fake_here": source, "fake_here_module": STREAMLESS_DEVICE},
               {"here": "fake_here"})
    rc, check, _ = _check("here", [tmp_path])
    assert rc == cli.EXIT_CHECK_FAILED and not check["skipped"]
    assert any("Stream is not a torch.Stream subclass" in p["what"] for p in check["problems"]), check


@pytest.mark.skipif(torch.cuda.is_available() or not any(
    ep.name == "cuda" for ep in importlib_metadata.entry_points(group="magi.backends")),
    reason="needs the cuda backend installed on a torch that sees no CUDA device")
def test_our_cuda_backend_passes_its_check_without_a_device() -> None:
    rc, check, text = _check("cuda", [])
    assert rc == cli.EXIT_OK and check["problems"] == [], check
    assert check["skipped"] and check["initialised"] is False
