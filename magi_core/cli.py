"""The ``magi`` command: ``magi backends [--json] [--check NAME]``, ``magi demo``, ``magi bench``, ``magi --version``.

``demo`` and ``bench`` live in :mod:`magi_core.bench.demo` and :mod:`magi_core.bench`; each module provides
``add_arguments(parser)`` and ``main(args) -> int`` and is imported only when its subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

#: Subcommands served by other modules: name -> (module, one-line help).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("magi_core.bench.demo", "run the demo job: a model offloaded with magi-core"),
    "bench": ("magi_core.bench", "run the benchmarks"),
}

#: Exit codes.
EXIT_OK, EXIT_SELECTION_ERROR, EXIT_UNAVAILABLE, EXIT_CHECK_FAILED = 0, 1, 2, 3

_SELECTED_BY_TEXT = {
    "explicit": "explicit choice (use_backend / --backend)",
    "env": "the MAGI_BACKEND environment variable",
    "probe": "probe: the highest-priority available backend",
}


def version_text() -> str:
    """``magi-core X (hook spec Y, torch Z)``."""
    import torch

    from magi_core import __version__
    from magi_core.plugin.spec import HOOKSPEC_VERSION

    return f"magi-core {__version__} (hook spec {HOOKSPEC_VERSION}, torch {torch.__version__})"


def backends_report(explicit: str | None = None, check: str | None = None) -> dict[str, Any]:
    """Every discovered backend, the selection (or its error) and why each other backend lost, as a JSON-ready dict.

    ``check`` names a backend to check as ``magi backends --check NAME`` does (the result is under ``"check"``).
    """
    import torch

    from magi_core import __version__
    from magi_core.plugin.manager import current_selection, list_backends
    from magi_core.plugin.spec import HOOKSPEC_VERSION

    records = list_backends()
    selection = current_selection(explicit)
    winner = next((r for r in records if r.name == selection.name), None)
    report: dict[str, Any] = {
        "magi_core_version": __version__,
        "hookspec_version": HOOKSPEC_VERSION,
        "torch_version": torch.__version__,
        "selected": selection.name,
        "selected_by": selection.selected_by,
        "selection_error": selection.error,
        "backends": [
            r.to_dict(selected=r.name == selection.name, lost=r.lost_to(winner, selection.selected_by))
            for r in records
        ],
    }
    if check is not None:
        from magi_core.plugin.check import check_backend

        report["check"] = check_backend(check).to_dict()
    return report


def _status_text(b: dict[str, Any]) -> str:
    """The STATUS cell: selected, or why this backend lost (refused, unavailable, lower priority)."""
    if b["selected"]:
        return "available, selected"
    return b.get("lost") or ("available" if b["available"] else f"unavailable: {b['why_unavailable']}")


def format_report(report: dict[str, Any], verbose: int = 0) -> str:
    """The human-readable form of :func:`backends_report` (``verbose``: load and probe tracebacks too)."""
    lines = [
        f"magi-core {report['magi_core_version']}, hook spec {report['hookspec_version']}, "
        f"torch {report['torch_version']}",
        "",
    ]
    rows = [("", "NAME", "PACKAGE", "DEVICE", "PRIORITY", "STATUS")]
    for b in report["backends"]:
        rows.append((
            "*" if b["selected"] else "",
            b["name"],
            f"{b['package']} {b['package_version']}",
            b["device_type"] or "-",
            "-" if b["priority"] is None else str(b["priority"]),
            _status_text(b),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if not report["backends"]:
        lines.append("  (no backend installed under the entry-point group magi.backends)")
    lines.append("")
    for b in report["backends"]:
        details = [
            f"entry point {b['entry_point']}",
            f"backend version {b['version'] or '-'}",
            f"hook-spec versions {', '.join(b['hookspec_versions']) or '-'}",
            "optional hooks missing: " + (", ".join(b["missing_optional_hooks"]) or "none"),
        ]
        if b["missing_required_hooks"]:
            details.append("REQUIRED hooks missing: " + ", ".join(b["missing_required_hooks"]))
        if b["unknown_hooks"]:
            details.append("unknown hooks: " + ", ".join(b["unknown_hooks"]))
        lines.append(f"{b['name']}: " + "; ".join(details))
        if b.get("error_traceback"):
            if verbose:
                lines.append("  " + b["error_traceback"].replace("\n", "\n  "))
            else:
                lines.append("  (error traceback: run `magi -v backends`)")
    lines.append("")
    if report["selection_error"]:
        lines.append(f"selection error: {report['selection_error']}")
    else:
        how = _SELECTED_BY_TEXT.get(report["selected_by"], report["selected_by"])
        lines.append(f"selected: {report['selected']} (by {how})")
    if report.get("check") is not None:
        lines += ["", _format_check(report["check"])]
    return "\n".join(lines)


def _format_check(check: dict[str, Any]) -> str:
    """The ``--check`` section: each problem with its fix, what was skipped without the device, then the notes."""
    problems, skipped = check["problems"], check.get("skipped", [])
    lines = [f"check of backend {check['backend']!r}: "
             + ("no problems found" if not problems else f"{len(problems)} problem(s)")
             + (f"; {len(skipped)} check(s) skipped: its device is absent here" if skipped else "")]
    for i, p in enumerate(problems, 1):
        lines.append(f"  {i}. {p['hook']}: {p['what']}")
        lines.append(f"     fix: {p['fix']}")
    lines += [f"  skipped: {n}" for n in skipped]
    lines += [f"  note: {n}" for n in check["notes"]]
    if check["initialised"] is not None:
        lines.append(f"  device initialised after the check: {'yes' if check['initialised'] else 'no'}")
    return "\n".join(lines)


def cmd_backends(args: argparse.Namespace) -> int:
    """``magi backends``: list every backend and the selection; exit 1 when selection fails.

    With ``--check NAME``: also check that backend (hooks, probe, device module, aliases, capabilities) without
    initialising its device; exit 3 when the check finds problems.
    """
    check = getattr(args, "check", None)
    report = backends_report(args.backend, check=check)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, verbose=args.verbose))
    if check is not None and not report["check"]["ok"]:
        if args.json:
            print(f"magi: backend {check!r} failed its check ({len(report['check']['problems'])} problem(s))",
                  file=sys.stderr)
        return EXIT_CHECK_FAILED
    if report["selection_error"] and check is None:
        if args.json:
            print(f"magi: selection error: {report['selection_error']}", file=sys.stderr)
        return EXIT_SELECTION_ERROR
    return EXIT_OK


def load_command_module(name: str) -> ModuleType | None:
    """Import the module behind a lazy subcommand; None when that module is not part of this install."""
    module_name = LAZY_COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            return None
        raise
    if not (callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "main", None))):
        return None
    return module


def build_parser(lazy: dict[str, ModuleType | None] | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``lazy`` holds the already-imported module of the subcommand being run."""
    parser = argparse.ArgumentParser(
        prog="magi", description="magi-core: run torch.compile'd models whose weights live in host memory."
    )
    parser.add_argument("--version", action="store_true", help="print magi-core, hook-spec and torch versions")
    parser.add_argument("--backend", metavar="NAME", default=None,
                        help="use this backend (like magi_core.use_backend; beats MAGI_BACKEND)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("backends", help="list discovered backends and which one is selected, and why")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--check", metavar="NAME", default=None,
                   help="check backend NAME (hooks, device module, aliases, capabilities) without initialising its "
                        "device; print each problem with its fix, exit 3 on problems")
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="show the traceback of load and probe errors (same as `magi -v backends`)")
    p.set_defaults(func=cmd_backends)
    for name, (module_name, help_text) in LAZY_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=f"{help_text} ({module_name})")
        module = (lazy or {}).get(name)
        if module is not None:
            module.add_arguments(p)
        p.set_defaults(lazy_command=name)
    return parser


def _subcommand(argv: Sequence[str]) -> str | None:
    """The first positional word of argv (skipping ``--backend NAME``), if it names a lazy subcommand."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--backend":
            skip = True
        elif not word.startswith("-"):
            return word if word in LAZY_COMMANDS else None
    return None


def _configure_logging(verbose: int) -> None:
    from magi_core.plugin.manager import tracing_enabled

    level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 or tracing_enabled() else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``magi`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    lazy_name = _subcommand(argv)
    lazy: dict[str, ModuleType | None] = {}
    if lazy_name is not None:
        lazy[lazy_name] = load_command_module(lazy_name)
        if lazy[lazy_name] is None:
            module_name = LAZY_COMMANDS[lazy_name][0]
            print(f"magi {lazy_name}: not available in this install ({module_name} is missing or lacks "
                  f"add_arguments()/main()); update magi-core, or run `magi backends`", file=sys.stderr)
            return EXIT_UNAVAILABLE
    parser = build_parser(lazy)
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    if args.version:
        print(version_text())
        return EXIT_OK
    if args.command is None:
        parser.print_help()
        return EXIT_UNAVAILABLE
    if lazy_name is not None and args.command == lazy_name:
        module = lazy[lazy_name]
        assert module is not None
        if args.backend is not None:
            from magi_core.errors import BackendError
            from magi_core.plugin.manager import use_backend

            try:
                use_backend(args.backend)
            except BackendError as exc:
                print(f"magi: {exc}", file=sys.stderr)
                return EXIT_SELECTION_ERROR
        return _run_command(lambda: int(module.main(args)), lazy_name, args.verbose)
    return _run_command(lambda: int(args.func(args)), args.command, args.verbose)


def _run_command(run: Callable[[], int], name: str, verbose: int) -> int:
    """Run a subcommand; a magi-core error (no usable backend, a bad setting) is one line on stderr, not a
    traceback (``-v``: the traceback too). Exit 1 for a backend that cannot be selected, 2 for other errors."""
    from magi_core.errors import BackendError, MagiError

    try:
        return run()
    except MagiError as exc:
        if verbose:
            logger.error("magi %s failed", name, exc_info=exc)
        print(f"magi {name}: {exc}" + ("" if verbose else f" (`magi -v {name}` shows the traceback)"),
              file=sys.stderr)
        return EXIT_SELECTION_ERROR if isinstance(exc, BackendError) else EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
