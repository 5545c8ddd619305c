"""``magi bench --generate``: one process per system (clean device peaks, no allocator or Dynamo state carried from
one system to the next), their rows merged into one result document.

This process never touches the device: each system runs in ``magi bench --generate --in-process`` with that system
alone selected, writing its own document (hardware, versions, its H2D probe, one row); the rows are merged, the
comparisons derived (:mod:`.derive`) and the document rewritten after every system. ``--time-budget`` bounds the
whole run: a system is not started once it is spent, and each process may take what is left of it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from magi_core.bench.generate.derive import derive
from magi_core.bench.generate.options import GenerateOptions, child_arguments, generate_specs
from magi_core.bench.generate.run import SCHEMA_VERSION, record_base
from magi_core.bench.systems import SystemSpec

logger = logging.getLogger(__name__)

#: Seconds a system's process may take when no time budget bounds the run.
PROCESS_TIMEOUT_S = 1800.0


def _tail(text: str | bytes | None, n: int = 1200) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip()[-n:]


def shell_line(argv: list[str]) -> str:
    """``argv`` as one line to paste into a shell (``python`` for the interpreter)."""
    return " ".join(["python", *(shlex.quote(a) for a in argv[1:])])


def run_child(options: GenerateOptions, spec: SystemSpec, work: Path, timeout: float,
              prompt_tokens: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run ``spec`` in a process of its own; its row (or why it gave none) and its document's environment."""
    part = work / f"{re.sub(r'[^A-Za-z0-9]+', '-', spec.label)}.json"
    cmd = [sys.executable, "-m", "magi_core", *child_arguments(options, spec, part)]
    base = {**record_base(options.models[0], spec, None, options, prompt_tokens), "command": shell_line(cmd)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        return {**base, "status": "timed out", "reason": f"no result within {timeout:.0f} s",
                "log_tail": _tail(exc.stderr), "wall_s": time.perf_counter() - t0}, None
    wall = time.perf_counter() - t0
    # the process's own log goes into this one's, so a run's log says what each system did
    sys.stderr.write(f"---- {spec.label}: {shell_line(cmd)} (exit {proc.returncode}, {wall:.0f} s)\n"
                     f"{proc.stdout}{proc.stderr}---- end of {spec.label}\n")
    sys.stderr.flush()
    if not part.exists():
        said = [line for line in proc.stderr.splitlines() if line.startswith("magi bench: ")]
        reason = said[-1] if said else (_tail(proc.stderr, 800) or f"exited {proc.returncode}")
        return {**base, "status": "failed", "reason": reason, "wall_s": wall}, None
    doc = json.loads(part.read_text())
    rows = doc.get("rows") or [{**base, "status": "failed", "reason": "the process recorded no row"}]
    row = {**rows[0], "command": base["command"], "wall_s": wall}
    if row.get("status") != "ok":
        row["log_tail"] = _tail(proc.stderr, 600)
    return row, doc.get("env")


def default_out(env: dict[str, Any] | None, root: Path) -> Path:
    """``benchmarks/results/<date>-generate-<hardware>.json`` under ``root``."""
    hardware = (env or {}).get("hardware") or "unknown"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", hardware).strip("-").lower()[:40] or "unknown"
    day = (env or {}).get("date") or _dt.datetime.now(_dt.timezone.utc).isoformat()
    return root / "benchmarks" / "results" / f"{day[:10]}-generate-{slug}.json"


def write(doc: dict[str, Any], path: Path) -> None:
    """Derive, then write the document atomically (creating the folder)."""
    derive(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_processes(options: GenerateOptions, is_accelerator: bool, command: str,
                  root: Path) -> tuple[dict[str, Any], Path]:
    """Every selected system in a process of its own, in order; the merged document and where it was written
    (``options.out``, or the default path once the first process said which hardware it ran on)."""
    specs = generate_specs(options)
    prompt_tokens = options.prompt_length(is_accelerator)
    doc: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": "generate", "env": None, "options": options.as_json(),
                           "commands": [command], "processes": "one process per system", "rows": []}
    out = options.out
    start = time.perf_counter()
    budget = options.time_budget_s or None
    with tempfile.TemporaryDirectory(prefix="magi-generate-") as tmp:
        for spec in specs:
            left = None if budget is None else budget - (time.perf_counter() - start)
            if left is not None and left <= 0:
                row = {**record_base(options.models[0], spec, None, options, prompt_tokens), "status": "skipped",
                       "reason": "time budget spent (--time-budget; 0 for no limit)"}
            else:
                logger.info("%s: a process of its own ...", spec.label)
                row, env = run_child(options, spec, Path(tmp), PROCESS_TIMEOUT_S if left is None else left,
                                     prompt_tokens)
                if env is not None and doc["env"] is None:
                    doc["env"] = env
                logger.info("%s: %s in %.0f s", spec.label, row.get("status"), row.get("wall_s", 0.0))
            doc["rows"].append(row)
            if out is None and doc["env"] is not None:
                out = default_out(doc["env"], root)
            if out is not None:
                write(doc, out)
    if out is None:
        out = default_out(doc["env"], root)
    write(doc, out)
    return doc, out
