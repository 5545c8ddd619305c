"""Install throw-away backend packages as real ``*.dist-info`` folders and run Python against them.

Discovery then goes through real importlib-metadata entry points (group ``magi.backends``), exactly
as for a pip-installed backend: each fake is a module file plus a dist-info folder holding
``METADATA`` and ``entry_points.txt``, placed in a directory that a subprocess gets on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import importlib_metadata

#: Environment variables the subprocess must not inherit (they change selection or logging).
_SCRUBBED_ENV = ("MAGI_BACKEND", "MAGI_TRACE_HOOKS")
#: Hide real accelerators from the subprocess so selection tests behave the same on a GPU host.
HIDE_ACCELERATORS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "MUSA_VISIBLE_DEVICES": ""}

#: Every hook a complete fake backend implements.
ALL_FAKE_HOOKS = (
    "magi_probe",
    "magi_hookspec_versions",
    "magi_device_module",
    "magi_host_register",
    "magi_host_unregister",
    "magi_range_push",
    "magi_range_pop",
    "magi_to_method_aliases",
)


def write_dist(
    root: Path,
    package: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, str],
    version: str = "0.0.1",
    extra_groups: Mapping[str, Mapping[str, str]] | None = None,
) -> Path:
    """Write modules and a ``<package>-<version>.dist-info`` registering ``entry_points`` under ``magi.backends``."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist_name = re.sub(r"[-_.]+", "_", package)
    info = root / f"{dist_name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    groups: dict[str, Mapping[str, str]] = {"magi.backends": entry_points, **(extra_groups or {})}
    lines: list[str] = []
    for group, eps in groups.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in eps.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "top_level.txt").write_text("\n".join(modules) + "\n")
    return info


def backend_source(
    device_type: str,
    priority: int,
    *,
    available: bool = True,
    reason: str | None = None,
    spec_versions: Sequence[str] = ("1",),
    probe_raises: str | None = None,
    omit: Iterable[str] = (),
    extra: str = "",
    aliases: Sequence[str] = ("to",),
) -> str:
    """Source of a backend module whose hooks behave as told (device module: magi-core's host module).

    ``aliases``: what its ``magi_to_method_aliases`` returns (``("to", "orig_to")``: as torch_musa's backend).
    """
    omit = set(omit)
    probe_body = (
        f"raise RuntimeError({probe_raises!r})"
        if probe_raises is not None
        else f"return ProbeResult(available={available!r}, device_type={device_type!r}, priority={priority!r}, "
        f"version='9.9', reason={reason!r})"
    )
    bodies = {
        "magi_probe": ("", probe_body),
        "magi_hookspec_versions": ("", f"return {tuple(spec_versions)!r}"),
        "magi_device_module": ("", "return cpu_device"),
        "magi_host_register": ("ptr, nbytes", "RANGES[ptr] = nbytes"),
        "magi_host_unregister": ("ptr", "del RANGES[ptr]"),
        "magi_range_push": ("name", "STACK.append(name)"),
        "magi_range_pop": ("", "STACK.pop()"),
        "magi_to_method_aliases": ("", f"return {tuple(aliases)!r}"),
    }
    parts = [
        "from magi_core.plugin.cpu import device as cpu_device",
        "from magi_core.plugin import ProbeResult, hookimpl",
        "RANGES = {}",
        "STACK = []",
    ]
    for hook, (args, body) in bodies.items():
        if hook not in omit:
            parts.append(f"\n@hookimpl\ndef {hook}({args}):\n    {body}\n")
    parts.append(textwrap.dedent(extra))
    return "\n".join(parts) + "\n"


def add_backend(root: Path, name: str, package: str | None = None, **kwargs: Any) -> Path:
    """Install one fake backend ``name`` (module ``fake_<name>``, package ``magi-backend-<name>``) under root."""
    module = f"fake_{name}"
    return write_dist(
        root,
        package or f"magi-backend-{name}",
        {module: backend_source(**kwargs)},
        {name: module},
    )


def load_in_process(monkeypatch: Any, name: str, **kwargs: Any) -> importlib_metadata.EntryPoint:
    """Import fake backend ``name`` (module ``fake_<name>``, :func:`backend_source` of ``kwargs``) into this process.

    Returns an entry point (group ``magi.backends``) that loads it; hand it to a registry's discovery (see
    ``discover_also``) to test selection in-process, without the cost of a subprocess. The module is removed
    from ``sys.modules`` when the test ends (``monkeypatch``).
    """
    module = f"fake_{name}"
    mod = types.ModuleType(module)
    exec(compile(backend_source(**kwargs), f"<{module}>", "exec"), mod.__dict__)  # noqa: S102 - test source
    monkeypatch.setitem(sys.modules, module, mod)
    return importlib_metadata.EntryPoint(name=name, value=module, group="magi.backends")


def discover_also(monkeypatch: Any, *eps: importlib_metadata.EntryPoint) -> None:
    """Make backend discovery (``magi.backends`` entry points) find ``eps`` besides the installed backends."""
    from magi_core.plugin import manager

    real = importlib_metadata.entry_points

    def entry_points(**params: Any) -> Any:
        found = list(real(**params))
        return [*found, *eps] if params.get("group") == "magi.backends" else found

    monkeypatch.setattr(manager.importlib_metadata, "entry_points", entry_points)


#: Prelude that makes torch report an accelerator ``{name}`` (PrivateUse1 renamed, stub device module).
EMULATED_ACCELERATOR = """
import types, torch
torch.utils.rename_privateuse1_backend({name!r})
_mod = types.ModuleType("torch." + {name!r})
_mod.is_available = lambda: True
_mod.device_count = lambda: 1
_mod.current_device = lambda: 0
torch._register_device_module({name!r}, _mod)
assert torch.accelerator.current_accelerator(check_available=True).type == {name!r}
"""


@dataclass
class Run:
    """The outcome of :func:`run_python`."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """The last stdout line parsed as JSON."""
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, f"no stdout; stderr:\n{self.stderr}"
        return json.loads(lines[-1])


def python_env(paths: Sequence[Path] = (), env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess: ``paths`` first on PYTHONPATH, magi variables scrubbed, accelerators hidden."""
    out = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    out.update(HIDE_ACCELERATORS)
    out["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    out.update(env or {})
    return out


def run_python(
    code: str,
    paths: Sequence[Path] = (),
    env: Mapping[str, str] | None = None,
    args: Sequence[str] | None = None,
    timeout: float = 120,
) -> Run:
    """Run ``python -c code`` (or ``python args...`` when args are given) with ``paths`` on PYTHONPATH."""
    argv = [sys.executable, *args] if args is not None else [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=python_env(paths, env), timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return Run(proc.returncode, proc.stdout, proc.stderr)


#: Script that selects a backend and prints the selection (or the error) and the listing as JSON.
SELECT_AND_LIST = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import magi_core
from magi_core.errors import BackendError
from magi_core.plugin.manager import current_selection
out = {{}}
try:
    b = {select}
    out["selected"] = b.name
    out["selected_by"] = b.selected_by
except BackendError as exc:
    out["error"] = str(exc)
out["selection"] = current_selection().__dict__
out["backends"] = {{r.name: r.to_dict() for r in magi_core.list_backends()}}
print(json.dumps(out))
"""


def select_and_list(
    paths: Sequence[Path],
    select: str = "magi_core.get_backend()",
    env: Mapping[str, str] | None = None,
    accelerator: str | None = None,
) -> tuple[dict[str, Any], Run]:
    """Run a selection in a fresh process; returns its JSON report and the run (for stderr)."""
    prelude = EMULATED_ACCELERATOR.format(name=accelerator) if accelerator else ""
    run = run_python(prelude + SELECT_AND_LIST.format(select=select), paths, env)
    assert run.returncode == 0, f"subprocess failed ({run.returncode}):\n{run.stderr}"
    return run.json(), run
