"""The conformance kit against magi-core's CPU reference backend."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fake_backends import Run, backend_source, python_env, write_dist

from magi_core.plugin.cpu import registered_ranges
from magi_core.testing.conformance import *  # noqa: F403


@pytest.fixture
def magi_backend_name() -> str:
    """Pin the backend under test to cpu."""
    return "cpu"


@pytest.fixture(autouse=True)
def _no_leaked_ranges():
    before = registered_ranges()
    yield
    assert registered_ranges() == before, "a conformance check left a host range registered"


# -- the kit's own behaviour: a broken backend reported once, ids naming the module, failures naming the hook -------

KIT = ["-m", "pytest", "-p", "magi", "--pyargs", "magi_core.testing.conformance", "-p", "no:cacheprovider",
       "-o", "addopts=", "-q"]


def _kit(tmp_path: Path, backend: str, *extra: str) -> Run:
    """Run the kit against ``backend`` from ``tmp_path`` (outside the rootdir, as a backend author would)."""
    argv = [*KIT, f"--magi-backend={backend}", "--rootdir", str(tmp_path), *extra]
    env = python_env([tmp_path / "site"])
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600, stdin=subprocess.DEVNULL)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def _kit_tests() -> list[str]:
    from magi_core.testing import conformance

    return [n for n in conformance.__all__ if n.startswith("test_")]


def test_a_backend_that_cannot_be_selected_is_reported_once(tmp_path: Path) -> None:
    write_dist(tmp_path / "site", "magi-backend-broken", {"fake_broken": "import no_such_module_xyz\n"},
               {"broken": "fake_broken"})
    run = _kit(tmp_path, "broken")
    assert run.returncode != 0
    out = run.stdout
    body = out.split("short test summary info")[0]  # newer pytest repeats the message in the summary line
    assert body.count("could not be selected, so no conformance check can run") == 1, out
    assert "no_such_module_xyz" in out and "magi backends --check" in out
    assert "1 error" in out and f"{len(_kit_tests()) - 1} skipped" in out, out.splitlines()[-1]
    first = re.search(r"^ERROR (\S+)", out, re.M)
    assert first and first.group(1).startswith("magi_core.testing.conformance::test_")


def test_kit_test_ids_name_their_module(tmp_path: Path) -> None:
    run = _kit(tmp_path, "cpu", "--collect-only")
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(ids) == len(_kit_tests()), run.stdout
    assert all(line.startswith("magi_core.testing.conformance::test_") for line in ids), ids


BAD_MODULE_BACKEND = """
from magi_core.plugin.cpu import device as _host

class _Module:  # the host module, but with a Stream torch's record_stream rejects
    def __getattr__(self, name):
        return getattr(_host, name)

class Stream:
    def __init__(self, device=None, priority=0):
        pass

_Module.Stream = Stream
MODULE = _Module()

@hookimpl
def magi_device_module():
    return MODULE

@hookimpl
def magi_to_method_aliases():
    return ("to", "to_the_moon")
"""


def test_kit_failures_name_the_hook_and_the_fix(tmp_path: Path) -> None:
    source = backend_source("badmod", -20, omit=["magi_device_module", "magi_to_method_aliases"],
                            extra=BAD_MODULE_BACKEND)
    write_dist(tmp_path / "site", "magi-backend-badmod", {"fake_badmod": source}, {"badmod": "fake_badmod"})
    run = _kit(tmp_path, "badmod", "-k", "device_module_api or to_method_aliases")
    assert "2 failed" in run.stdout, run.stdout[-3000:]
    assert "magi_device_module: " in run.stdout and "Stream is not a torch.Stream subclass" in run.stdout
    assert "fix: derive Stream from torch.Stream" in run.stdout
    assert "magi_to_method_aliases: torch.Tensor has no method 'to_the_moon'" in run.stdout


def test_kit_keeps_torch_trace_records_out_of_the_output(magi_backend) -> None:
    # torch's structured trace (tlparse input) is at DEBUG and would flood "Captured log" of a failing check
    trace = logging.getLogger("torch.__trace")
    if not os.environ.get("TORCH_TRACE"):
        assert not trace.isEnabledFor(logging.DEBUG)
    assert trace.propagate is False


def test_kit_restores_torch_trace_logging_afterwards() -> None:
    assert logging.getLogger("torch.__trace").level == logging.DEBUG


PROFILED_RANGES = """
import os, torch
_OPEN = []

@hookimpl
def magi_range_push(name):
    _OPEN.append(torch.ops.profiler._record_function_enter_new(name, None))

@hookimpl
def magi_range_pop():
    if os.environ.get("FAKE_POP_CLOSES", "1") == "1":  # else: a pop that forgets to close (the handle stays held)
        torch.ops.profiler._record_function_exit._RecordFunction(_OPEN.pop())
"""


def test_kit_sees_a_pop_that_closes_nothing(tmp_path: Path) -> None:
    source = backend_source("ranged", -20, omit=["magi_range_push", "magi_range_pop"], extra=PROFILED_RANGES)
    write_dist(tmp_path / "site", "magi-backend-ranged", {"fake_ranged": source}, {"ranged": "fake_ranged"})
    good = _kit(tmp_path, "ranged", "-k", "ranges_balance")
    assert "1 passed" in good.stdout, good.stdout[-3000:]
    env = python_env([tmp_path / "site"], {"FAKE_POP_CLOSES": "0"})
    argv = [*KIT, "--magi-backend=ranged", "--rootdir", str(tmp_path), "-k", "ranges_balance"]
    bad = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert "1 failed" in bad.stdout, bad.stdout[-3000:]
    assert "magi_range_pop: ranges ['outer', 'inner'" in bad.stdout and "were still open after their pops" in bad.stdout


RAISING_REGISTER = """
@hookimpl
def magi_host_register(ptr, nbytes):
    raise RuntimeError("vendor runtime exploded")
"""


def test_kit_names_the_hook_when_register_raises_something_else(tmp_path: Path) -> None:
    source = backend_source("cpu", -20, omit=["magi_host_register"], extra=RAISING_REGISTER)
    write_dist(tmp_path / "site", "magi-backend-boom", {"fake_boom": source}, {"boom": "fake_boom"})
    run = _kit(tmp_path, "boom", "-k", "host_register or streams_and_events")
    failed = re.findall(r"^FAILED \S+::(test_\w+)", run.stdout, re.M)
    assert len(failed) >= 4, run.stdout[-3000:]
    sections = re.split(r"^_{3,} (test_\w+) _{3,}$", run.stdout, flags=re.M)[1:]
    for name, body in zip(sections[::2], sections[1::2], strict=True):
        # one line naming the hook and the runtime's text, no source listing of the kit
        assert re.search(r"magi_host_register: .* raised RuntimeError: vendor runtime exploded", body), body
        assert "During handling" not in body, body
        assert not re.search(r"^>", body, re.M), (name, body)


CAP_THAT_CANNOT_LIFT = """
import os
from magi_core.plugin import DeviceMemory
TOTAL = 8 << 30
CAPS = {}

@hookimpl
def magi_device_memory(device_index):
    cap = CAPS.get(device_index, TOTAL)
    if os.environ.get("FAKE_CAP_SHOWN", "1") == "0":
        cap = TOTAL  # a cap that does not show in device_memory: the check fails before the lift
    return DeviceMemory(free=cap // 2, total=cap)

@hookimpl
def magi_limit_device_memory(device_index, nbytes):
    seen = CAPS.get(device_index, TOTAL)  # the cap taken for the device's size: a lift is refused
    if nbytes > seen:
        raise RuntimeError(f"cannot cap at {nbytes}: the device has {seen}")
    CAPS[device_index] = nbytes
"""


@pytest.mark.parametrize("cap_shown", ["1", "0"])
def test_kit_reports_a_cap_that_cannot_be_lifted_without_hiding_an_earlier_failure(tmp_path: Path,
                                                                                   cap_shown: str) -> None:
    # "ipu": a device type without kernels here, so the kit skips its allocation check and reaches the lift
    source = backend_source("ipu", -20, omit=["magi_device_memory", "magi_limit_device_memory"],
                            extra=CAP_THAT_CANNOT_LIFT)
    write_dist(tmp_path / "site", "magi-backend-caps", {"fake_caps": source}, {"caps": "fake_caps"})
    env = python_env([tmp_path / "site"], {"FAKE_CAP_SHOWN": cap_shown})
    argv = [*KIT, "--magi-backend=caps", "--rootdir", str(tmp_path), "-k", "limit_device_memory"]
    run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert "1 failed" in run.stdout, run.stdout[-3000:]
    if cap_shown == "1":
        assert re.search(r"magi_limit_device_memory: a cap at the device's total \(8589934592 B\) must lift the cap; "
                         r"it raised BackendError: .*cannot cap at 8589934592", run.stdout), run.stdout[-3000:]
    else:  # the first failure is the one reported, not the lift's error raised while cleaning up
        assert "magi_device_memory: after a cap of" in run.stdout and "report the cap as total" in run.stdout
        assert "must lift the cap" not in run.stdout, run.stdout[-3000:]
