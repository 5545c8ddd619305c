"""``magi bench --generate``: greedy ``generate`` of a language model per system, prefill and decode timed.

Each system (the compiled resident model, magi-core at each ratio and budget, accelerate with part of the weights
offloaded to the host) runs in a process of its own (:mod:`.driver`); each process warms the model up with
``generate`` calls and times one (:mod:`.run`, :mod:`.timing`); the rows are merged into one result document with
the decode ideal and the tokens compared against the resident model's (:mod:`.derive`), printed and rendered on the
benchmarks page (:mod:`.report`)::

    magi bench --generate --models llama8b --prompt-tokens 2048 --new-tokens 32 --batch 1 --cache dynamic \\
        --systems resident_compiled,magi,accelerate --policies HEURISTIC --ratios 0,0.9 --budgets 0.5 --out g.json
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from magi_core.bench.generate.driver import default_out, run_processes, write
from magi_core.bench.generate.options import GenerateOptions, options_from_args, run_arguments
from magi_core.bench.generate.report import text_summary
from magi_core.bench.generate.run import run_in_process
from magi_core.plugin.facade import Backend

__all__ = ["GenerateOptions", "main", "run_generate"]


def run_generate(options: GenerateOptions, backend: Backend, root: Path,
                 command: str) -> tuple[dict[str, Any], Path]:
    """Run a generate benchmark (one process per system, or all in this one with ``in_process``); the document
    and where it was written."""
    if not options.in_process:
        return run_processes(options, backend.is_accelerator, command, root)
    doc = run_in_process(options, backend)
    doc["commands"] = [command]
    doc["processes"] = "every system in one process"
    out = options.out or default_out(doc["env"], root)
    write(doc, out)
    return doc, out


def main(args: argparse.Namespace, root: Path) -> int:
    """``magi bench --generate``: run, print the table and where the JSON went; the exit status.

    Raises :class:`~magi_core.errors.ConfigError` on flags that do not go together (the caller prints it)."""
    from magi_core.plugin.manager import get_backend

    options = options_from_args(args)
    command = "python -m magi_core " + " ".join(shlex.quote(w) for w in run_arguments(options))
    doc, out = run_generate(options, get_backend(), root, command)
    print(text_summary(doc))
    print(f"results: {out}")
    return 0 if any(r.get("status") == "ok" for r in doc["rows"]) else 1
