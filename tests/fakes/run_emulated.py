"""Run Python code in a fresh interpreter with ``tests/fakes`` importable (``import torch_musa`` = emulation).

Usage from any test (the file has no package dependencies, so it can be loaded by path)::

    from fakes.run_emulated import run_emulated      # when tests/ is on sys.path
    proc = run_emulated("import torch_musa, torch; assert torch.musa.is_available()")

The child inherits the environment plus ``PYTHONPATH`` with this directory first, so grandchildren
(for example a pytest run inside the child) see the fakes too. ``MAGI_BACKEND`` is removed unless
given in ``env`` so the parent's selection never leaks into the child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Directory holding the fake packages (``torch_musa``, ``torchada``).
FAKES_DIR = Path(__file__).resolve().parent


def emulated_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a child needs to import the fakes: ``PYTHONPATH`` with :data:`FAKES_DIR` first."""
    child = dict(os.environ)
    child.pop("MAGI_BACKEND", None)
    child.update(env or {})
    parts = [str(FAKES_DIR)] + [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p]
    child["PYTHONPATH"] = os.pathsep.join(parts)
    return child


def run_emulated(
    code: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    check: bool = True,
    args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh ``python -c`` with the fakes importable; raise on failure when ``check``."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=emulated_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"emulated subprocess failed (rc={proc.returncode})\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def run_emulated_argv(
    argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 600.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python *argv`` (for example ``-m pytest ...``) with the fakes importable; never raises on rc."""
    return subprocess.run(
        [sys.executable, *argv], env=emulated_env(env), capture_output=True, text=True, timeout=timeout
    )
