"""pytest plugin (entry point ``pytest11``, name ``magi``): ``--magi-backend=NAME`` and backend fixtures.

Fixtures (function scope, cheap after the first discovery):

* ``magi_backend_name``: the ``--magi-backend`` value, or None for automatic selection. Override it in
  a test module to pin a backend (``return "cpu"``).
* ``magi_backend``: the :class:`~magi_core.plugin.facade.Backend` facade, selected with
  :func:`magi_core.use_backend` when a name is given (automatic selection is restored afterwards).
* ``magi_backend_record``: the selected backend's :class:`~magi_core.plugin.manager.BackendRecord`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import REGISTRY, BackendRecord, get_backend, use_backend


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--magi-backend``."""
    group = parser.getgroup("magi", "magi-core backend conformance")
    group.addoption(
        "--magi-backend", default=None, metavar="NAME",
        help="magi backend to test, as listed by `magi backends` (default: automatic selection)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``accelerator`` marker used by the conformance suite."""
    config.addinivalue_line("markers", "accelerator: needs a real accelerator (skipped cleanly without one)")


@pytest.fixture
def magi_backend_name(request: pytest.FixtureRequest) -> str | None:
    """The backend named by ``--magi-backend``, or None for automatic selection."""
    return request.config.getoption("--magi-backend", default=None)


@pytest.fixture
def magi_backend(magi_backend_name: str | None) -> Iterator[Backend]:
    """The backend under test (explicitly selected when named, else the automatic choice)."""
    if magi_backend_name is None:
        yield get_backend()
        return
    backend = use_backend(magi_backend_name)
    assert backend is not None
    try:
        yield backend
    finally:
        use_backend(None)


@pytest.fixture
def magi_backend_record(magi_backend: Backend) -> BackendRecord:
    """The registry record of the backend under test (probe result, spec versions, hooks)."""
    return REGISTRY.records()[magi_backend.name]
