"""pytest plugin: fail any test after which the stream-ordering checker holds new violations.

Use it for suites run on magidev: ``pytest -p torch_magidev.pytest_plugin ...``. After each test it collects
garbage (so frees are checked) and fails the test with every violation the checker found during it; the
violations are then cleared, so each test answers for its own. Importing it imports torch_magidev (which
renames PrivateUse1): use it only in processes meant to run on magidev.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from torch_magidev import checker


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Run the test, then fail it when the checker found stream-order violations during it."""
    checker.clear()
    result = yield
    gc.collect()
    found = checker.violations()
    checker.clear()
    if found:
        lines = "\n".join(f"  - {v}" for v in found[:20])
        more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
        pytest.fail(f"{len(found)} magidev stream-order violation(s) during {item.nodeid}:\n{lines}{more}",
                    pytrace=False)
    return result
