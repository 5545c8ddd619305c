"""pytest plugin (entry point ``pytest11``): ``--magi-backend=NAME`` and the ``magi_backend`` fixture."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--magi-backend``."""
    parser.addoption("--magi-backend", default=None, help="magi backend to test (default: automatic selection)")
