"""The conformance kit against the CUDA backend (accelerator; skipped cleanly without a usable CUDA device)."""

from __future__ import annotations

import pytest
from magi_backend_cuda import runtime

from magi_core.plugin.manager import REGISTRY
from magi_core.testing.conformance import *  # noqa: F403

pytestmark = pytest.mark.accelerator


@pytest.fixture
def magi_backend_name() -> str:
    """Pin the backend under test to cuda, skipping when it cannot be used here."""
    rec = REGISTRY.records().get("cuda")
    if rec is None or not rec.available:
        pytest.skip(f"magi backend 'cuda' unavailable: {rec.why_unavailable if rec else 'not installed'}")
    return "cuda"


@pytest.fixture(autouse=True)
def _no_leaked_ranges():
    before = runtime.registered_ranges()
    yield
    assert runtime.registered_ranges() == before, "a conformance check left a host range registered"
