"""Shared pytest setup: hypothesis profiles (``HYPOTHESIS_PROFILE``: ``ci`` default, ``dev``, ``explore``); skips.

``ci``: 30 derandomized examples, the same every run (what CI runs). ``dev``: 300 random examples.
``explore``: 2000 random examples with a fresh seed each run, for a scheduled or manual search; a failure
prints the seed and the blob to reproduce it (``@reproduce_failure``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.register_profile(
    "explore", max_examples=2000, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _musa_backend_installed() -> bool:
    import importlib_metadata

    return any(ep.name == "musa" for ep in importlib_metadata.entry_points(group="magi.backends"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``emulated`` tests (torch_musa emulation + MUSA backend) where magi-backend-musa is not installed."""
    emulated = [item for item in items if item.get_closest_marker("emulated") is not None]
    if emulated and not _musa_backend_installed():
        skip = pytest.mark.skip(reason="needs magi-backend-musa installed (run: tox -e musa)")
        for item in emulated:
            item.add_marker(skip)


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private directory for the host weights' shared-memory files (``MAGI_SHM_DIR``), with Dynamo's caches reset
    around the test; the test must leave no file in it.

    In memory (``/dev/shm``) where there is one, as in use: an accelerator runtime refuses to pin file-backed pages
    of a disk filesystem (CUDA: "invalid argument" on ext4), which would leave nothing registered to check.
    """
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"magi-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    monkeypatch.setenv("MAGI_SHM_DIR", str(path))
    torch._dynamo.reset()
    try:
        yield path
        assert list(path.iterdir()) == [], "files left in the shm directory"
    finally:
        torch._dynamo.reset()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def accelerator() -> Any:
    """The active backend, when its device has memory of its own (magidev, CUDA); skips on the CPU backend."""
    from magi_core.plugin.manager import get_backend  # at use: the backend is chosen after the test's environment

    backend = get_backend()
    if not backend.is_accelerator:
        pytest.skip("needs a device with its own memory (magidev, CUDA): on the CPU backend the host is the device")
    return backend
