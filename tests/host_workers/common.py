"""Shared fixtures and helpers of the host-memory tests (imported by tests/host/test_host_*.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from magi_core.plugin.cpu import registered_ranges

ROOT = Path(__file__).resolve().parent.parent.parent
WORKERS = Path(__file__).resolve().parent


@pytest.fixture(name="shm_dir")
def shm_dir_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private directory under /dev/shm as MAGI_SHM_DIR; asserts it is empty and nothing is pinned after."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = os.path.join(base, f"magi-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    monkeypatch.setenv("MAGI_SHM_DIR", path)
    for var in ("MAGI_EP_SIZE", "MAGI_SKIP_SHM", "MAGI_PIN_CONCURRENCY", "MAGI_PIN_BUDGET_GB"):
        monkeypatch.delenv(var, raising=False)
    before = registered_ranges()
    try:
        yield path
        import gc

        gc.collect()
        left = os.listdir(path)
        assert left == [], f"files left under the shm dir: {left}"
        assert registered_ranges() == before, "host ranges left registered"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def child_env(shm_dir: str, **extra: str) -> dict[str, str]:
    """Environment for a subprocess: our shm dir, one thread, the repository importable."""
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(MAGI_SHM_DIR=shm_dir, OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.update(extra)
    return env


def torchrun(nproc: int, args: list[str], shm_dir: str, out: Path, timeout: float = 240,
             worker: str = "materialize_worker.py", **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests/host_workers/<worker>`` under torchrun (gloo); each rank's output goes to its own files under
    ``<out>/torchrun-logs`` (see :func:`failure_report`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--log-dir", str(out / LOG_DIR), "--redirects", "3",
           str(WORKERS / worker), "--out", str(out), *args]
    try:
        return subprocess.run(cmd, env=child_env(shm_dir, **env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"torchrun did not finish within {timeout}s\n" + failure_report(exc, out)) from None


LOG_DIR = "torchrun-logs"


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def failure_report(proc: subprocess.CompletedProcess[str] | subprocess.TimeoutExpired, out: Path) -> str:
    """torchrun's own output and every rank's complete stdout/stderr, for an assertion message."""
    parts = [f"--- torchrun exit code {getattr(proc, 'returncode', None)}; its stderr:\n{_text(proc.stderr)}"
             f"\n--- its stdout:\n{_text(proc.stdout)}"]
    for log in sorted((out / LOG_DIR).rglob("*.log")):
        text = log.read_text(errors="replace")
        if text.strip():
            parts.append(f"--- {log.relative_to(out)} (rank {log.parent.name}):\n{text}")
    return "\n".join(parts)


def assert_ok(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """Fail with the full output of every rank when torchrun did not exit 0."""
    assert proc.returncode == 0, failure_report(proc, out)


def results(out: Path, nproc: int) -> list[dict]:
    """Every rank's JSON record, in rank order."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
