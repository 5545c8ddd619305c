"""The docs site's griffe extension: no Sphinx markup of magi-core's docstrings reaches the rendered pages.

Runs where griffe is installed (tox docs, next to the strict site build); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

HOOK = Path(__file__).resolve().parents[1] / "docs" / "_hooks" / "sphinx_roles.py"
LEFT = re.compile(r":(?:py:)?[a-z]+:`|\.\. versionadded::")


def _extension():
    spec = importlib.util.spec_from_file_location("sphinx_roles", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roles_and_versionadded_become_markdown() -> None:
    ext = _extension()
    text = "See :func:`magi_core.offload` and :class:`~magi_core.config.OffloadConfig`.\n\n    .. versionadded:: 1.2\n"
    assert ext.markdown(text) == "See `magi_core.offload` and `OffloadConfig`.\n\n    *New in version 1.2.*\n"
    assert ext.markdown(".. versionadded:: 1.0", spec=True) == "*New in hook spec 1.0.*"
    assert ext.markdown("``literal`` and :param x: kept") == "``literal`` and :param x: kept"


def test_no_docstring_of_magi_core_keeps_sphinx_markup_once_loaded() -> None:
    ext = _extension()
    package = griffe.load("magi_core", extensions=griffe.Extensions(ext.SphinxRoles()),
                          search_paths=[str(HOOK.parents[2])])
    left: list[str] = []

    def walk(obj) -> None:
        if obj.is_alias:
            return
        if obj.docstring is not None:
            found = LEFT.search(obj.docstring.value)
            # the spec module's own text names the directive it uses, in a literal
            if found and "``.. versionadded::``" not in obj.docstring.value:
                left.append(f"{obj.path}: {found.group(0)}")
        for member in obj.members.values():
            walk(member)

    walk(package)
    assert not left, left
