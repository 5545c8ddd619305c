"""Shared fixtures and helpers of the host-memory tests (imported by tests/test_host_*.py)."""

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

from magi_core.cpu_backend import registered_ranges

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


def torchrun(nproc: int, args: list[str], shm_dir: str, out: Path, timeout: float = 180,
             **env: str) -> subprocess.CompletedProcess[str]:
    """Run tests/host_workers/materialize_worker.py under torchrun (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKERS / "materialize_worker.py"), "--out", str(out), *args]
    return subprocess.run(cmd, env=child_env(shm_dir, **env), capture_output=True, text=True, timeout=timeout)


def results(out: Path, nproc: int) -> list[dict]:
    """Every rank's JSON record, in rank order."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
