"""What backend authors import: the ``hookimpl`` marker, spec types and the entry-point group name.

Register a backend in your ``pyproject.toml``::

    [project.entry-points."magi.backends"]
    mydev = "my_backend_package"

and implement the hooks of :mod:`magi_core.hookspecs` with ``@hookimpl`` in that module.
"""

from __future__ import annotations

import pluggy

from magi_core.hookspecs import HOOKSPEC_VERSION, PROJECT, ProbeResult

ENTRY_POINT_GROUP = "magi.backends"
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["ENTRY_POINT_GROUP", "HOOKSPEC_VERSION", "ProbeResult", "hookimpl"]
