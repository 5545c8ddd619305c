"""Shared pytest setup: hypothesis profiles (``HYPOTHESIS_PROFILE``: ``ci`` default, ``dev``, ``explore``); skips.

``ci``: 30 derandomized examples, the same every run (what CI runs). ``dev``: 300 random examples.
``explore``: 2000 random examples with a fresh seed each run, for a scheduled or manual search; a failure
prints the seed and the blob to reproduce it (``@reproduce_failure``).
"""

from __future__ import annotations

import os

import pytest
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
