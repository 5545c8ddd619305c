"""The conformance kit against magi-core's CPU reference backend."""

from __future__ import annotations

import pytest

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
