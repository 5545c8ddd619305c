"""griffe extension: the Sphinx markup of magi-core's docstrings rendered as Markdown on the docs site.

The docstrings are written for Python's ``help()`` and Sphinx (``:func:`name```, ``.. versionadded:: 1.2``);
mkdocstrings shows them as Markdown, where that markup would appear literally. A role becomes a code span of its
target (``~a.b.c`` gives ``c``), a ``versionadded`` directive a sentence. Nothing in the source tree changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
VERSION_ADDED = re.compile(r"^([ \t]*)\.\. versionadded:: *(\S+)[ \t]*$", re.M)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown(text: str, *, spec: bool = False) -> str:
    """``text`` with its Sphinx roles and ``versionadded`` directives in Markdown."""
    what = "hook spec " if spec else "version "
    text = VERSION_ADDED.sub(lambda m: f"{m.group(1)}*New in {what}{m.group(2)}.*", text)
    return ROLE.sub(_role, text)


class SphinxRoles(griffe.Extension):
    """Rewrite each object's docstring once it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value, spec=obj.path.startswith("magi_core.plugin.spec"))
