"""Step time against card size: each system on each model with the process's device memory capped, one process each.

    python benchmarks/cap_grid.py --out cap-grid.json --plot cap-grid.png                 # the whole grid
    python benchmarks/cap_grid.py --models flux --resume cap-grid.json --out cap-grid.json --time-budget 480
    python benchmarks/cap_grid.py --plot-only cap-grid.json --plot cap-grid.png           # plot a finished grid

A smaller card is emulated by capping this process's device memory through the backend
(``magi bench --device-memory SIZE``, hook ``magi_limit_device_memory``: on CUDA the caching allocator's memory
fraction), which must happen before the process's first allocation: every row is a ``magi bench`` process of its
own, one (model, cap, system) each, at the models' full size (llama8b: Llama-3-8B, 16.06 GB; wan14b: Wan2.1-14B
blocks, 20 layers, 14.58 GB; flux: FLUX.1-dev, 23.80 GB; bf16) and one token count per model (transfer-bound on an
H200 by default: llama8b 2048, wan14b 2184, flux 4096 image tokens; ``--tokens flux=8192``). Caps: 12, 16, 24 and
48 GiB and ``none`` (the whole card). Systems:

``magi_default``  ``magi_core.offload(model)`` with ``OffloadConfig()``: the plan fits the card
``magi_r0``       ``OffloadConfig(gpu_resident_weight_ratio=0)``, policy HEURISTIC: every weight streams
``magi_r1``       (not in the default systems) ``OffloadConfig(gpu_resident_weight_ratio=1)``, policy HEURISTIC: the
                  whole graph as one unit where the card holds it, else the fastest plan that fits
``diffusers``     diffusers group offloading, block level, one block per group, ``use_stream=True``,
                  ``record_stream=True``, the top-level group as the bench's diffusers peer forms it
``accelerate``    accelerate ``device_map="auto"`` with ``max_memory={0: card - slack, "cpu": ...}`` (what fits stays
                  on the card, the rest is offloaded to the host), ``dispatch_model``
``resident``      (``none`` only, for the ideal) the whole model on the device, ``torch.compile``'d

A row that runs out of device memory, or a system that fails, is a row with its error. Every row has its step time
(median of ``--steps`` timed steps), its peak device memory (allocated and reserved), the bytes it streams per step
and the host-to-device rate its process measured; its ``ideal_ms`` is the bench's: ``max(resident compiled step,
streamed bytes / link rate)`` (compute from the uncapped ``resident`` row; without one, streamed / link alone;
``ideal_link_ms`` is streamed / link alone), and ``card_floor_ms`` is the best any system could do on a card of that
size, ``max(compute, (weights - cap) / link)``: what does not fit must stream each step.

Resumable: rows already in ``--resume`` (or in ``--out`` when it exists) are kept and not run again
(``--retry-failed`` runs the failed ones again); ``--time-budget`` stops starting rows that would not finish in time
(each row is expected to take as long as the longest one of its model so far), so a grid runs across several device
calls of 9 minutes. The JSON is rewritten after every row; ``remaining`` lists the rows still to run. The plot has
one panel per model: step time against card size per system, with the card floor.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("cap_grid")

GIB = 1 << 30
MODELS = ("llama8b", "wan14b", "flux")
CAPS = ("12GiB", "16GiB", "24GiB", "48GiB", "none")
SYSTEMS = ("magi_default", "magi_r0", "diffusers", "accelerate")
#: Token count per model (transfer-bound on an H200: where the card size shows most).
TOKENS = {"llama8b": 2048, "wan14b": 2184, "flux": 4096}
#: ``magi bench`` arguments of each grid system.
BENCH_ARGS = {
    "resident": ["--systems", "resident_compiled"],
    "magi_default": ["--systems", "magi", "--magi-default", "--ratios", "", "--budgets", ""],
    "magi_r0": ["--systems", "magi", "--policies", "HEURISTIC", "--ratios", "0", "--budgets", ""],
    "magi_r1": ["--systems", "magi", "--policies", "HEURISTIC", "--ratios", "1", "--budgets", ""],
    "diffusers": ["--systems", "diffusers"],
    "accelerate": ["--systems", "accelerate", "--accelerate-device-map"],
}
#: What a row keeps of its ``magi bench`` run record.
RUN_FIELDS = ("label", "status", "reason", "step_ms", "steps_ms", "peak_alloc_bytes", "peak_reserved_bytes",
              "streamed_bytes", "resident_bytes", "weight_bytes", "setup_s", "first_call_s", "recompiles",
              "output_finite", "units", "plan_resident_units", "predicted_step_ms", "transfer_buffer_bytes",
              "accelerate_max_memory", "accelerate_offloaded_modules", "diffusers_use_stream")
#: Seconds a row is expected to take before any row of its model has run.
FIRST_ROW_GUESS_S = 150.0
ROOT = Path(__file__).resolve().parents[1]


def cap_bytes(cap: str) -> int | None:
    """``"12GiB"`` -> bytes; ``"none"`` -> None."""
    if cap == "none":
        return None
    from magi_core.plugin.device_limit import parse_device_memory

    nbytes, fraction = parse_device_memory(cap)
    if nbytes is None:
        raise SystemExit(f"cap {cap!r}: give caps in bytes (12GiB) or none, not as a percentage ({fraction})")
    return nbytes


def row_key(model: str, tokens: int, cap: str, system: str) -> str:
    """What identifies a row across runs of the script."""
    return f"{model}/{tokens}/{cap}/{system}"


def plan_rows(models: Sequence[str], caps: Sequence[str], systems: Sequence[str], tokens: dict[str, int],
              resident: bool) -> list[dict[str, Any]]:
    """Every row of the grid, in the order they run: per model the uncapped resident row first (the ideal's
    compute), then each cap (in the order given) with each system."""
    rows = []
    for model in models:
        t = tokens[model]
        if resident:
            rows.append({"model": model, "tokens": t, "cap": "none", "system": "resident"})
        rows += [{"model": model, "tokens": t, "cap": cap, "system": system} for cap in caps for system in systems]
    for r in rows:
        r["key"] = row_key(r["model"], r["tokens"], r["cap"], r["system"])
    return rows


def bench_command(row: dict[str, Any], args: argparse.Namespace, out: Path) -> list[str]:
    """The ``magi bench`` command line of one row."""
    cmd = [sys.executable, "-m", "magi_core", "bench", "--models", row["model"], "--tokens", str(row["tokens"]),
           *BENCH_ARGS[row["system"]], "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--no-overhead-probe", "--no-host-timing", "--time-budget", "0", "--dtype", args.dtype,
           "--out", str(out)]
    if row["cap"] != "none":
        cmd += ["--device-memory", row["cap"]]
    if args.layers is not None:
        cmd += [f"--{'llama' if row['model'] == 'llama8b' else 'wan' if row['model'] == 'wan14b' else 'flux'}-layers",
                str(args.layers)]
    if args.quick:
        cmd.append("--quick")
    return cmd


def _tail(text: str | bytes | None, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip()[-n:]


def failure_text(stderr: str, returncode: int) -> str:
    """Why a ``magi bench`` process gave no result: its own one-line error when it printed one, else its log's end."""
    said = [line for line in stderr.splitlines() if line.startswith("magi bench: ")]
    return said[-1] if said else (_tail(stderr, 800) or f"magi bench exited {returncode}")


def run_row(row: dict[str, Any], args: argparse.Namespace, work: Path, timeout: float) -> dict[str, Any]:
    """Run one row's ``magi bench`` process; the row with what it measured, or its error."""
    part = work / f"{row['key'].replace('/', '_')}.json"
    part.unlink(missing_ok=True)
    cmd = bench_command(row, args, part)
    out = {k: row[k] for k in ("key", "model", "tokens", "cap", "system")}
    out["cap_bytes"] = cap_bytes(row["cap"])
    out["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")  # rows of one grid span sessions
    out["command"] = " ".join("''" if not a else a for a in ["python", *cmd[1:]])
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MAGI_DEVICE_MEMORY", None)  # each row's cap is its own --device-memory
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=args.cwd)
    except subprocess.TimeoutExpired as exc:
        out.update(status="timed out", reason=f"no result within {timeout:.0f} s", log_tail=_tail(exc.stderr),
                   wall_s=time.perf_counter() - t0)
        return out
    out["wall_s"] = time.perf_counter() - t0
    if not part.exists():
        out.update(status="failed", reason=failure_text(proc.stderr, proc.returncode))
        return out
    doc = json.loads(part.read_text())
    runs = [r for r in doc.get("runs", []) if r.get("tokens") == row["tokens"]]
    if not runs:
        out.update(status="failed", reason="magi bench recorded no run", log_tail=_tail(proc.stderr))
        return out
    out.update({k: runs[0][k] for k in RUN_FIELDS if k in runs[0]})
    out["h2d_GBps"] = doc.get("h2d_GBps")
    out["device_memory"] = doc.get("device_memory")
    out["env"] = doc.get("env")
    if out["status"] != "ok":
        out["log_tail"] = _tail(proc.stderr, 600)
    return out


def _seen_total(row: dict[str, Any]) -> int | None:
    seen = (row.get("device_memory") or {}).get("seen") or {}
    total = seen.get("total")
    return int(total) if total else None


def card_bytes(row: dict[str, Any]) -> int | None:
    """The card size a row ran on: its cap, else the device's total as its process saw it."""
    return row.get("cap_bytes") or _seen_total(row)


def derive(doc: dict[str, Any]) -> None:
    """Per row: compute_ms (uncapped resident step), ideal_ms, ideal_link_ms, ratio_to_ideal, card_floor_ms.

    A row whose process measured no link rate or weights (it failed early) takes its model's from the other rows
    for the card floor.
    """
    compute = {(r["model"], r["tokens"]): r["step_ms"] for r in doc["rows"]
               if r["system"] == "resident" and r.get("status") == "ok"}
    weights_of = {r["model"]: r["weight_bytes"] for r in doc["rows"] if r.get("weight_bytes")}
    links: dict[str, float] = {}
    for r in doc["rows"]:
        if r.get("h2d_GBps"):
            links[r["model"]] = max(links.get(r["model"], 0.0), float(r["h2d_GBps"]))
    for r in doc["rows"]:
        for k in ("compute_ms", "ideal_ms", "ideal_link_ms", "ratio_to_ideal", "card_floor_ms", "card_bytes"):
            r.pop(k, None)
        c = compute.get((r["model"], r["tokens"]))
        card = card_bytes(r)
        if card is not None:
            r["card_bytes"] = card
        if c is not None:
            r["compute_ms"] = c
        link = float(r.get("h2d_GBps") or links.get(r["model"], 0.0)) * 1e9
        weights = r.get("weight_bytes") or weights_of.get(r["model"])
        if link > 0 and weights and card is not None:
            floor = max(0, weights - card) / link * 1e3
            r["card_floor_ms"] = max(c, floor) if c is not None else floor
        if r.get("status") != "ok" or not r.get("h2d_GBps") or r.get("streamed_bytes") is None:
            continue
        r["ideal_link_ms"] = r["streamed_bytes"] / (float(r["h2d_GBps"]) * 1e9) * 1e3
        r["ideal_ms"] = max(c, r["ideal_link_ms"]) if c is not None else r["ideal_link_ms"]
        if r["ideal_ms"] > 0:
            r["ratio_to_ideal"] = r["step_ms"] / r["ideal_ms"]


def new_doc(args: argparse.Namespace, planned: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The result document (no rows yet)."""
    return {
        "what": "cap-grid: step time against card size, the device memory of each process capped, one process per "
                "(model, cap, system)",
        "kind": "cap-grid",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": None, "python": platform.python_version(), "torch": None, "magi_core": None,
        "models": list(args.models), "caps": list(args.caps), "systems": list(args.systems),
        "tokens": {m: args.tokens[m] for m in args.models}, "steps": args.steps, "dtype": args.dtype,
        "commands": [], "rows": [], "remaining": [r["key"] for r in planned],
    }


def _sync_env(doc: dict[str, Any]) -> None:
    """Hardware and versions from the rows' processes (this one never touches the device)."""
    for r in doc["rows"]:
        env = r.get("env") or {}
        if env.get("hardware"):
            doc["hardware"] = doc["hardware"] or env["hardware"]
            doc["torch"] = doc["torch"] or env.get("torch")
            doc["magi_core"] = doc["magi_core"] or env.get("magi_core")
            doc["meaningful"] = bool(env.get("meaningful"))


def save(doc: dict[str, Any], path: Path) -> None:
    """Derive, then write the document atomically."""
    _sync_env(doc)
    derive(doc)
    doc["dates"] = sorted({str(r["date"])[:10] for r in doc["rows"] if r.get("date")} | {str(doc["date"])[:10]})
    doc["complete"] = not doc["remaining"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def widen(doc: dict[str, Any], before: dict[str, Any]) -> None:
    """The grid of a resumed run is the earlier run's and this one's together: models, caps, systems and token
    counts (this call's count where both name a model), so that a call narrowed to some of them keeps the others
    in the document, its plot and what remains."""
    for key in ("models", "caps", "systems"):
        doc[key] = list(dict.fromkeys([*before.get(key, []), *doc[key]]))
    doc["tokens"] = {**before.get("tokens", {}), **doc["tokens"]}


def merge_rows(doc: dict[str, Any], previous: Iterable[dict[str, Any]], retry_failed: bool,
               rerun: Sequence[str] = ()) -> set[str]:
    """Keep the rows of an earlier run of the grid, but failed ones with ``retry_failed`` and those whose key
    matches a ``rerun`` pattern (``fnmatch``, e.g. ``llama8b/*/16GiB/magi_default``); the keys that need not run
    again."""
    done: set[str] = set()
    for r in previous:
        if retry_failed and r.get("status") != "ok":
            continue
        if any(fnmatch.fnmatchcase(r["key"], pattern) for pattern in rerun):
            continue
        doc["rows"].append(r)
        done.add(r["key"])
    return done


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    """Run the rows not done yet, within the time budget; returns the document (also written to ``args.out``)."""
    planned = plan_rows(args.models, args.caps, args.systems, args.tokens, not args.no_resident)
    doc = new_doc(args, planned)
    resume = args.resume if args.resume is not None else (args.out if args.out.exists() else None)
    done: set[str] = set()
    if resume is not None and resume.exists():
        before = json.loads(resume.read_text())
        done = merge_rows(doc, before.get("rows", []), args.retry_failed,
                          [p for p in (args.rerun or "").split(",") if p])
        doc["commands"] = list(before.get("commands", []))
        doc["date"] = before.get("date", doc["date"])
        widen(doc, before)
        logger.info("resuming from %s: %d rows done", resume, len(done))
    doc["commands"].append("python benchmarks/cap_grid.py " + " ".join(sys.argv[1:]))
    todo = [r for r in planned if r["key"] not in done]
    # what the whole grid still lacks, this call's rows first (a call narrowed to some models runs only theirs)
    grid = plan_rows(doc["models"], doc["caps"], doc["systems"], doc["tokens"], not args.no_resident)
    keys = [r["key"] for r in todo]
    skip = done | set(keys)
    doc["remaining"] = keys + [r["key"] for r in grid if r["key"] not in skip]
    start = time.perf_counter()
    longest: dict[str, float] = {}
    for r in doc["rows"]:
        if r.get("wall_s"):
            longest[r["model"]] = max(longest.get(r["model"], 0.0), float(r["wall_s"]))
    with tempfile.TemporaryDirectory(prefix="cap-grid-") as tmp:
        for row in todo:
            left = args.time_budget - (time.perf_counter() - start) if args.time_budget else None
            expect = longest.get(row["model"], FIRST_ROW_GUESS_S)
            if left is not None and left < expect:
                logger.info("time budget: %.0f s left, a %s row takes about %.0f s; %d rows remain (run again to "
                            "resume)", left, row["model"], expect, len(doc["remaining"]))
                break
            timeout = args.worker_timeout if left is None else max(30.0, min(args.worker_timeout, left))
            logger.info("%s ...", row["key"])
            result = run_row(row, args, Path(tmp), timeout)
            longest[row["model"]] = max(longest.get(row["model"], 0.0), result.get("wall_s", 0.0))
            doc["rows"].append(result)
            doc["remaining"].remove(row["key"])
            step = f"{result['step_ms']:.1f} ms" if result.get("step_ms") is not None else result["status"]
            peak = result.get("peak_reserved_bytes")
            logger.info("%s: %s, peak reserved %s, %.0f s", row["key"], step,
                        f"{peak / GIB:.2f} GiB" if peak is not None else "-", result.get("wall_s", 0.0))
            save(doc, args.out)
    save(doc, args.out)
    return doc


# -- the plot ---------------------------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Step time against card size, one panel per model and a line per system, with the card floor; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'magi-core[bench]'): no plot written; run "
                       "`python benchmarks/cap_grid.py --plot-only RESULT.json --plot PNG` where it is")
        return None
    derive(doc)
    models = [m for m in doc["models"] if any(r["model"] == m for r in doc["rows"])]
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in doc["rows"] if r["model"] == model]
        for system in [s for s in ("resident", *doc["systems"]) if any(r["system"] == s for r in rows)]:
            ok = sorted((r["card_bytes"] / GIB, r["step_ms"]) for r in rows
                        if r["system"] == system and r.get("status") == "ok" and r.get("card_bytes"))
            failed = [r["card_bytes"] / GIB for r in rows
                      if r["system"] == system and r.get("status") != "ok" and r.get("card_bytes")]
            line = ax.plot(*zip(*ok, strict=True), marker="o", label=system) if ok else None
            if failed:
                color = line[0].get_color() if line else None
                ymin = min((p[1] for p in ok), default=1.0)
                ax.scatter(failed, [ymin * 0.8] * len(failed), marker="x", s=60, color=color,
                           label=f"{system}: failed (out of memory or error)")
        floor = sorted({(r["card_bytes"] / GIB, r["card_floor_ms"]) for r in rows
                        if r.get("card_floor_ms") is not None and r.get("card_bytes")})
        if floor:
            ax.plot(*zip(*floor, strict=True), linestyle="--", color="red", linewidth=1,
                    label="card floor: max(compute, (weights - card) / link)")
        weights = next((r["weight_bytes"] for r in rows if r.get("weight_bytes")), None)
        if weights:
            ax.axvline(weights / GIB, linestyle=":", color="grey", linewidth=1, label="model weights")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        cards = sorted({r["card_bytes"] / GIB for r in rows if r.get("card_bytes")})
        if cards:
            ax.set_xticks(cards, [f"{c:.0f}" for c in cards])
            ax.minorticks_off()
        ax.set_xlabel("card size (GiB of device memory the process may use)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{model}, {doc['tokens'].get(model)} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    days = doc.get("dates") or [str(doc.get("date", ""))[:10]]
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    fig.suptitle(f"cap grid on {doc.get('hardware') or '?'} ({when})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tokens(text: str | None) -> dict[str, int]:
    tokens = dict(TOKENS)
    for part in (text or "").split(","):
        if part.strip():
            name, _, value = part.partition("=")
            if name.strip() not in MODELS or not value.strip().isdigit():
                raise SystemExit(f"--tokens {text!r}: give MODEL=COUNT pairs, MODEL one of {', '.join(MODELS)}")
            tokens[name.strip()] = int(value)
    return tokens


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or resume) the grid, write the JSON and the plot; return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list (default {','.join(MODELS)})")
    ap.add_argument("--caps", default=",".join(CAPS), help="comma list of card sizes (bytes: 12GiB, 16e9; none: the "
                    f"whole card; default {','.join(CAPS)})")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default {','.join(SYSTEMS)})")
    ap.add_argument("--no-resident", action="store_true",
                    help="skip the uncapped resident compiled row (the ideal then has no compute term)")
    ap.add_argument("--tokens", default=None, help="MODEL=COUNT pairs (default " +
                    ",".join(f"{k}={v}" for k, v in TOKENS.items()) + ")")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10; their median)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="warm-up calls after setup (default 3; magi-core's first planned calls fill its resident "
                         "copies and allocate its buffers, which the timed steps must not include)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--layers", type=int, default=None, help="blocks per model (tests; default the real models')")
    ap.add_argument("--quick", action="store_true", help="the bench's quick sizes (4 blocks at full width)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds after which no row is started (0: none); rows left are listed in 'remaining'")
    ap.add_argument("--worker-timeout", type=float, default=420.0, help="seconds one row may take (default 420)")
    ap.add_argument("--resume", type=Path, default=None, help="a result of an earlier run: its rows are kept")
    ap.add_argument("--retry-failed", action="store_true", help="run rows that failed earlier again")
    ap.add_argument("--rerun", default=None, metavar="PATTERNS",
                    help="comma list of row-key patterns (fnmatch: MODEL/TOKENS/CAP/SYSTEM, e.g. '*/magi_default') "
                         "to run again though the resumed result has them (after a change to what they measure)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/<date>-cap-grid"
                    "-<hardware>.json)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of step time against card size (default next to "
                    "the JSON)")
    ap.add_argument("--plot-only", type=Path, default=None, metavar="RESULT_JSON", help="only plot this result")
    args = ap.parse_args(argv)
    if args.plot_only is not None:
        doc = json.loads(args.plot_only.read_text())
        written = plot(doc, args.plot or args.plot_only.with_suffix(".png"))
        print(f"plot: {written}" if written else "no plot written")
        return 0 if written else 1
    args.models = _names(args.models, MODELS, "models")
    args.systems = _names(args.systems, [s for s in BENCH_ARGS if s != "resident"], "systems")
    args.caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    for cap in args.caps:
        cap_bytes(cap)  # refuse an unreadable cap before anything runs
    args.tokens = _tokens(args.tokens)
    args.cwd = str(Path.cwd())
    if args.out is None:
        day = datetime.datetime.now(datetime.UTC).date().isoformat()
        args.out = ROOT / "benchmarks" / "results" / f"{day}-cap-grid.json"
    doc = run_grid(args)
    done = sum(1 for r in doc["rows"] if r.get("status") == "ok")
    print(f"results: {args.out} ({len(doc['rows'])} rows, {done} ok, {len(doc['remaining'])} remaining)")
    if not doc["remaining"] or args.plot is not None:
        written = plot(doc, args.plot or args.out.with_suffix(".png"))
        if written:
            print(f"plot: {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
