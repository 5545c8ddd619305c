"""pytest plugin (entry point ``pytest11``, name ``magi``): ``--magi-backend=NAME`` and backend fixtures.

Fixtures (function scope, cheap after the first discovery):

* ``magi_backend_name``: the ``--magi-backend`` value, or None for automatic selection. Override it in
  a test module to pin a backend (``return "cpu"``).
* ``magi_backend``: the :class:`~magi_core.plugin.facade.Backend` facade, selected with
  :func:`magi_core.use_backend` when a name is given (automatic selection is restored afterwards). A backend
  that cannot be selected (it failed to load, misses a hook, its probe raised, ...) is reported once: the first
  test that asks for it errors with the reason, every later one is skipped pointing at that test. While a test
  holds it, torch's structured-trace log (``torch.__trace``) is kept out of the output unless ``TORCH_TRACE``
  asks for it.
* ``magi_backend_record``: the selected backend's :class:`~magi_core.plugin.manager.BackendRecord`.

The kit's module gets test ids that name it (``magi_core.testing.conformance::test_...``) also when it is run
with ``--pyargs`` from outside the directory it is installed in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from magi_core.errors import BackendError
from magi_core.plugin.facade import Backend
from magi_core.plugin.manager import REGISTRY, BackendRecord, get_backend, use_backend

#: The conformance suite's file (its tests get ids naming the module).
KIT_MODULE = Path(__file__).with_name("conformance.py")
#: The id prefix of the kit's tests when the file lies outside the rootdir.
KIT_NODEID = "magi_core.testing.conformance"
#: torch's structured-trace logger (tlparse input): DEBUG records of every compile.
TORCH_TRACE_LOGGER = "torch.__trace"
#: Per session: backend name (None: automatic) -> node id of the test that reported its selection error.
_SELECTION_FAILED = pytest.StashKey[dict[str | None, str]]()


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
    config.stash[_SELECTION_FAILED] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect the kit's module as ``magi_core.testing.conformance`` when it lies outside the rootdir.

    pytest builds ids from the path relative to the rootdir; for an installed kit run with ``--pyargs`` from a
    backend's checkout that path is empty and every id would read ``::test_...``.
    """
    try:
        if module_path.resolve() != KIT_MODULE.resolve():
            return None
        module_path.resolve().relative_to(parent.config.rootpath.resolve())
        return None  # inside the rootdir: pytest's own id already names the file
    except ValueError:
        pass
    except OSError:
        return None
    return pytest.Module.from_parent(parent, path=module_path, nodeid=KIT_NODEID)


@pytest.fixture
def magi_backend_name(request: pytest.FixtureRequest) -> str | None:
    """The backend named by ``--magi-backend``, or None for automatic selection."""
    return request.config.getoption("--magi-backend", default=None)


def _quiet_torch_trace() -> tuple[int, bool]:
    """Keep ``torch.__trace`` DEBUG records out of captured logs (unless TORCH_TRACE asks for them)."""
    trace = logging.getLogger(TORCH_TRACE_LOGGER)
    saved = (trace.level, trace.propagate)
    trace.propagate = False
    if not os.environ.get("TORCH_TRACE"):
        trace.setLevel(logging.CRITICAL + 1)
    return saved


@pytest.fixture
def magi_backend(request: pytest.FixtureRequest, magi_backend_name: str | None) -> Iterator[Backend]:
    """The backend under test (explicitly selected when named, else the automatic choice)."""
    failed: dict[str | None, str] = request.config.stash[_SELECTION_FAILED]
    label = repr(magi_backend_name) if magi_backend_name is not None else "(automatic selection)"
    if magi_backend_name in failed:
        pytest.skip(f"magi backend {label} could not be selected; reported once, by {failed[magi_backend_name]}")
    error: str | None = None
    try:
        backend = get_backend() if magi_backend_name is None else use_backend(magi_backend_name)
    except BackendError as exc:
        error = str(exc)
    if error is not None:
        failed[magi_backend_name] = request.node.nodeid
        pytest.fail(
            f"magi backend {label} could not be selected, so no conformance check can run (reported here once; the "
            f"other checks are skipped):\n  {error}\n`magi backends --check NAME` lists each problem with its fix",
            pytrace=False,
        )
    assert backend is not None
    level, propagate = _quiet_torch_trace()
    try:
        yield backend
    finally:
        trace = logging.getLogger(TORCH_TRACE_LOGGER)
        trace.setLevel(level)
        trace.propagate = propagate
        if magi_backend_name is not None:
            use_backend(None)


@pytest.fixture
def magi_backend_record(magi_backend: Backend) -> BackendRecord:
    """The registry record of the backend under test (probe result, spec versions, hooks)."""
    return REGISTRY.records()[magi_backend.name]
