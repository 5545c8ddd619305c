"""Turns result documents into the Markdown report (tables, targets), a PNG plot and a terminal summary."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from magi_core.bench import analysis

logger = logging.getLogger(__name__)

GB = 1e9


def load(path: Path) -> dict[str, Any]:
    """Read a result JSON and (re)compute its derived figures and targets."""
    return analysis.finalize(json.loads(path.read_text()))


def _f(v: Any, fmt: str = "{:.3f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def human_bytes(n: float | None) -> str:
    """``n`` bytes as GB, MB or kB (decimal units)."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def _slug(doc: dict[str, Any]) -> str:
    """File-name stem of a document's plot: its start time to the minute and its hardware."""
    hw = re.sub(r"[^A-Za-z0-9]+", "-", doc["env"]["hardware"]).strip("-").lower()[:40]
    when = re.sub(r"[^0-9T]+", "-", doc["env"]["date"][:16]).strip("-")
    return f"{when}-{hw}"


def plot_names(docs: Sequence[dict[str, Any]]) -> list[str]:
    """One distinct PNG name per document (runs started in the same minute on one kind of hardware get -2, -3)."""
    names: list[str] = []
    for d in docs:
        stem = base = f"bench-{_slug(d)}"
        n = 1
        while f"{stem}.png" in names:
            n += 1
            stem = f"{base}-{n}"
        names.append(f"{stem}.png")
    return names


def _status(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        notes = []
        if r.get("streamed_bytes_estimated"):
            notes.append("streamed bytes from ratio")
        return "ok" + (f" ({'; '.join(notes)})" if notes else "")
    return f"{r['status']}: {r.get('reason', '')}".replace("|", "/").replace("\n", " ")[:160]


def runs_table(doc: dict[str, Any], workload: str, tokens: int) -> list[str]:
    """Markdown rows of every configuration at one model and token count."""
    lines = [
        "| system | step ms | x ideal | ideal ms | x faster than diffusers | x faster than accelerate | "
        "peak alloc | peak reserved | pinned / weights | copy GB/s | setup s | first call s | recompiles | "
        "max rel err | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        if r["workload"] != workload or r["tokens"] != tokens:
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['label']} |" + " - |" * 13 + f" {_status(r)} |")
            continue
        sp = r.get("speedup_vs", {})
        lines.append(
            f"| {r['label']} | {_f(r['step_ms'])} | {_f(r.get('ratio_to_ideal'))} | {_f(r.get('ideal_ms'))} | "
            f"{_f(sp.get('diffusers'), '{:.2f}')} | {_f(sp.get('accelerate'), '{:.2f}')} | "
            f"{human_bytes(r['peak_alloc_bytes'])} | {human_bytes(r['peak_reserved_bytes'])} | "
            f"{_f(r.get('pinned_over_weights'), '{:.4f}')} | {_f(r.get('copy_GBps'), '{:.2f}')} | "
            f"{_f(r.get('setup_s'), '{:.2f}')} | {_f(r.get('first_call_s'), '{:.2f}')} | {r['recompiles']} | "
            f"{_error(r)} | {_status(r)} |"
        )
    return lines


def _error(r: dict[str, Any]) -> str:
    """Max rel err against the process's first run; '-' for that run itself, the reference named when it is not a
    resident run (a part of a merged grid that ran magi-core alone compares its configurations with each other)."""
    ref = r.get("error_reference")
    if ref is None or ref.startswith("resident"):
        return _f(r.get("max_rel_err"), "{:.2e}")
    if ref == r["label"]:
        return "-"
    return f"{_f(r.get('max_rel_err'), '{:.2e}')} vs {ref.removeprefix('magi ')}"


def _target_value(t: dict[str, Any]) -> str:
    if t["value"] is None:
        return "-"
    if t["unit"] == "B":
        return human_bytes(t["value"])
    return f"{t['value']:.3f}{t['unit']}"


def _target_limit(t: dict[str, Any]) -> str:
    if t["unit"] == "B":
        return human_bytes(t["limit"])
    return f"{t['limit']:g}{t['unit']}"


def targets_table(doc: dict[str, Any]) -> list[str]:
    """Markdown rows: each target, its scope, the measured value, the limit, met / missed by how much."""
    lines = ["| target | scope | value | limit | result | note |", "|---|---|---|---|---|---|"]
    for t in doc.get("targets", []):
        if t["status"] == "missed" and t["limit"] == 0:
            result = f"**missed** by {t['missed_by']:g}"
        elif t["status"] == "missed":
            result = f"**missed** by {t['missed_by'] * 100:.1f}%"
        else:
            result = t["status"]
        note = (t.get("note") or "").replace("|", "/")
        lines.append(f"| {t['target']} | {t['scope']} | {_target_value(t)} | {_target_limit(t)} | {result} | {note} |")
    return lines


def _bandwidth(doc: dict[str, Any]) -> str:
    """The run's pinned H2D GB/s, or the range over the processes of a merged document."""
    parts = [p["h2d_GBps"] for p in doc.get("parts", [])]
    if len(parts) > 1:
        return f"{min(parts):.2f} - {max(parts):.2f} ({len(parts)} processes)"
    return f"{doc['h2d_GBps']:.2f}"


def doc_markdown(doc: dict[str, Any], plot: Path | None, md_dir: Path) -> list[str]:
    """The Markdown section of one result document."""
    env = doc["env"]
    lines = [f"## {env['hardware']} - {env['date']}", ""]
    if not env.get("meaningful", False):
        lines += [f"> **Not meaningful:** {env.get('note')}", ""]
    be = env["backend"]
    lines += [
        "| hardware | backend | torch | magi-core | python | pinned H2D GB/s (same run) |",
        "|---|---|---|---|---|---|",
        f"| {env['hardware']} | {be['name']} ({be['device_type']}, {be['package']} {be['version']}) | {env['torch']} "
        f"| {env['magi_core']} | {env['python']} | {_bandwidth(doc)} |",
        "",
    ]
    for name, w in doc["workloads"].items():
        if w.get("status") == "skipped":
            lines.append(f"- **{name}**: skipped: {w.get('reason', '')}")
            continue
        shape = ", ".join(f"{k}={v}" for k, v in w["shape"].items())
        lines.append(f"- **{name}**: {human_bytes(w['weight_bytes'])} of {w['dtype']} weights, "
                     f"{len(w['block_bytes'])} blocks ({shape})")
        for tok, t in w.get("tokens", {}).items():
            if "tflop" in t:
                lines.append(f"  - {tok} tokens: {t['tflop']:.1f} TFLOP; on an H200 compute "
                             f"{t['compute_ms_h200'][0]:.0f}-{t['compute_ms_h200'][1]:.0f} ms against "
                             f"{t['transfer_ms_h200']:.0f} ms of transfer: {t['regime_h200']}")
    lines += [f"- note: {n}" for n in doc.get("notes", [])]
    lines.append("")
    if plot is not None:
        rel = Path(plot).resolve().relative_to(md_dir.resolve()) if _is_under(plot, md_dir) else Path(plot)
        lines += [f"![step time against residency]({rel.as_posix()})", ""]
    pairs = sorted({(r["workload"], r["tokens"]) for r in doc["runs"]})
    for wl, tok in pairs:
        lines += [f"### {wl}, {tok} tokens", ""] + runs_table(doc, wl, tok) + [""]
    lines += ["### Targets", ""] + targets_table(doc) + [""]
    return lines


def _is_under(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


HOW_TO = """\
Run `magi bench` (or `python benchmarks/run_bench.py`) on the machine to measure: it writes
`benchmarks/results/<date>-<hardware>[-<models>].json`; then `python benchmarks/report.py` rewrites
this page and its plots from every JSON there. Options: `--models mlp,transformer`, `--tokens`,
`--systems`, `--policies`, `--ratios`, `--budgets`, `--grid core|full`, `--steps` (>= 10), `--quick`,
`--time-budget S`, `--accelerate-all-tokens`, sizes (`--mlp-layers`, `--tf-layers`, ...).
Defaults on an accelerator: the 24-block MLP stack (hidden 4096, 4x FFN, 6.44 GB bf16) and the
synthetic transformer (`magi_core.bench.models`: hidden 4096, 32 heads, SwiGLU FFN 14336, 32 blocks,
15.6 GB bf16) at 2048 and 16384 tokens; the `core` grid (the first policy at every ratio and budget
plus the all-resident probe, the other policies at the budgets; `--grid full` runs every policy at
every ratio); accelerate at the smallest token count only; a 420 s time budget split across the
models (configurations not started in time are recorded as skipped; `--time-budget 0` lifts it), so
the core grid of both models finishes in under 10 minutes. The full grid of both models takes longer
(about 15 minutes on one H200): where one command may not run that long, run it in parts (a model or token
count per process, e.g. one per GPU of a host: `benchmarks/device_session.sh bench-parts`) and merge them
with `python benchmarks/report.py --merge benchmarks/results/<date>-<hardware>.json PART.json ...`.
diffusers runs `apply_group_offloading` at block level,
one block per group, with a copy stream and `record_stream`; a model with no weights outside its block
list (the MLP stack) gets a 1-element host buffer so that diffusers builds its top-level group and with
it the prefetch chain (without it, diffusers 0.42 copies each block on its stream while the block
already computes). On the cpu backend it runs tiny models (diffusers without a stream) and marks the
figures as not meaningful.
"""

LEGEND = """\
Step time is the median of the timed steps (device timing events, steps issued back to back after
warm-up). "ideal" = max(compiled resident step time, streamed bytes / pinned H2D bandwidth measured
in the same process); "x faster than P" = P's step time / this step time; setup = materialise + pin
(+ wrap), "first call" includes compilation; recompiles are Dynamo graphs compiled during the timed
steps; max rel err = max|out - ref| / max|ref| against the first system run (resident eager).
copy GB/s = weight bytes streamed per step / step time (peers are taken to stream every weight).
Executor host overhead per unit = (host time of one call of magi-core with every weight resident
minus that of the compiled resident model, each the fastest of 20 calls issued onto an idle device) /
units: an estimate from two measurements minutes apart (documents without `host_call_method` hold the
median of 5 calls, which other load on the host skews by tens of us per unit); `benchmarks/host_overhead.py`
measures it in interleaved rounds and breaks it down.
"""


def markdown(docs: Sequence[dict[str, Any]], plots: Sequence[Path | None], md_dir: Path,
             exchanges: Sequence[dict[str, Any]] = (), extra: Sequence[str] = ()) -> str:
    """The whole Markdown report for ``docs`` (newest first; ``benchmarks/report.py`` writes it to
    ``build/benchmarks/BENCHMARKS.md``), weight-exchange results and ``extra`` lines at the end (the other scripts'
    sections: ``benchmarks/script_report.py``)."""
    lines = ["# Benchmarks", "", "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`"
             " (written by `magi bench` and the scripts in `benchmarks/`). Do not edit by hand.", "", HOW_TO,
             LEGEND]
    if not docs:
        lines += ["No results yet: run `magi bench` on an accelerator."]
    for doc, plot in zip(docs, plots, strict=True):
        lines += doc_markdown(doc, plot, md_dir)
    if exchanges:
        lines += exchange_markdown(exchanges)
    lines += extra
    return "\n".join(lines).rstrip() + "\n"


def is_exchange_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/exchange_bench.py`` result (per-rank runs with the exchange off and on)."""
    return "exchange_on" in doc and "exchange_off" in doc


def exchange_markdown(docs: Sequence[dict[str, Any]]) -> list[str]:
    """A section per weight-exchange result: each rank's step and weight rate without and with the exchange."""
    lines = ["## Weight exchange across the GPUs of one host", "",
             "Every rank runs the same model at ratio 0 from one shared host copy; `exchange=off`: each rank copies "
             "every weight over its own host link; `exchange=on`: each copies 1/N of every unit and the ranks "
             "all-gather the rest. \"x link\" = weight rate / the host-to-device rate measured in the same run.", ""]
    for doc in sorted(docs, key=lambda d: (d.get("date", ""), d.get("model", "")), reverse=True):
        lines += [f"### {doc.get('model')}, {doc.get('tokens')} tokens, {doc.get('gpus')}x {doc.get('hardware')} - "
                  f"{doc.get('date')}", "",
                  f"torch {doc.get('torch')}, {human_bytes(doc.get('weight_bytes'))} of weights, link "
                  f"{_f(doc.get('link_GBps'), '{:.2f}')} GB/s; outputs identical to the per-rank path: "
                  f"{all(doc.get('outputs_identical') or [False])}; command: `{doc.get('command')}`", "",
                  "| rank | exchange | step ms | weight GB/s | x link | exchanges per run |",
                  "|---|---|---|---|---|---|"]
        for mode in ("off", "on"):
            for r, e in enumerate(doc[f"exchange_{mode}"]):
                lines.append(f"| {r} | {mode} | {_f(e.get('step_ms'))} | {_f(e.get('weight_rate_GBps'), '{:.1f}')} | "
                             f"{_f(e.get('x_single_link_rate'), '{:.2f}')} | {e.get('exchanges', 0)} |")
        lines += ["", f"Target: {doc.get('target')}: **{'met' if doc.get('ok') else 'missed'}**.", ""]
    return lines


def plot_available() -> bool:
    """True when matplotlib can be imported (plots are written)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _resident_fraction(r: dict[str, Any]) -> float:
    """Resident share of the weight bytes: what the runtime reports, else the configured ratio."""
    if r.get("resident_bytes") is not None and r["weight_bytes"]:
        return float(r["resident_bytes"]) / r["weight_bytes"]
    return float(r.get("ratio") or 0.0)


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Step time against residency ratio for each system, with the ideal line; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'magi-core[bench]'): no plot written")
        return None
    wls = sorted({r["workload"] for r in analysis.ok_runs(doc)})
    toks = {wl: sorted({r["tokens"] for r in doc["runs"] if r["workload"] == wl}) for wl in wls}
    if not wls:
        return None
    cols = max(len(t) for t in toks.values())
    fig, axes = plt.subplots(len(wls), cols, figsize=(6.0 * cols, 4.4 * len(wls)), squeeze=False)
    bw = doc["h2d_GBps"] * 1e9
    for i, wl in enumerate(wls):
        for j in range(len(toks[wl]), cols):
            axes[i][j].set_visible(False)  # models run at their own token counts: rows differ in length
    for (i, wl), (j, tok) in ((a, b) for a in enumerate(wls) for b in enumerate(toks[a[1]])):
        ax = axes[i][j]
        runs = [r for r in analysis.ok_runs(doc) if r["workload"] == wl and r["tokens"] == tok]
        for r in (r for r in runs if r["system"] == "magi" and r["policy"] is None):  # the default config
            ax.scatter([_resident_fraction(r)], [r["step_ms"]], marker="D", s=60, label=r["label"])
        for pol in sorted({r["policy"] for r in runs if r["system"] == "magi" and r["policy"] is not None}):
            pts = sorted((_resident_fraction(r), r["step_ms"]) for r in runs
                         if r["policy"] == pol and r.get("ratio") is not None)
            line = ax.plot(*zip(*pts, strict=True), marker="o", label=f"magi {pol}") if pts else None
            for r in (r for r in runs if r["policy"] == pol and r.get("budget_fraction") is not None):
                ax.scatter([_resident_fraction(r)], [r["step_ms"]], marker="*", s=110,
                           color=line[0].get_color() if line else None,
                           label=f"magi {pol} budget {r['budget_fraction']:g}W")
        resident = next((r for r in runs if r["system"] == "resident_compiled"), None) or \
            next((r for r in runs if r["system"] == "resident_eager"), None)
        for r in runs:
            if r["system"] in ("resident_eager", "resident_compiled"):
                ax.axhline(r["step_ms"], linestyle=":", color="grey" if r["system"] == "resident_eager" else "black",
                           label=r["label"])
            elif r["system"] in analysis.PEERS:
                ax.scatter([0.0], [r["step_ms"]], marker="x", s=70, label=r["label"])
        if resident is not None:
            weights = doc["workloads"][wl]["weight_bytes"]
            xs = [k / 50 for k in range(51)]
            ax.plot(xs, [max(resident["step_ms"], (1 - x) * weights / bw * 1e3) for x in xs], color="red",
                    linewidth=1, label="ideal")
        ax.set_title(f"{wl}, {tok} tokens")
        ax.set_xlabel("resident fraction of weight bytes")
        ax.set_ylabel("step time (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    title = f"magi bench - {doc['env']['hardware']} - {doc['env']['date'][:10]}"
    if not doc["env"].get("meaningful", False):
        title += " (cpu: not meaningful)"
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(docs: Sequence[dict[str, Any]], md_path: Path, plot_dir: Path | None = None,
                 exchanges: Sequence[dict[str, Any]] = (), extra: Sequence[str] = ()) -> list[Path]:
    """Write ``md_path`` and one PNG per document (in ``plot_dir``, default next to the Markdown); return the files.

    ``exchanges``: ``benchmarks/exchange_bench.py`` results, one section after the bench documents; ``extra``:
    Markdown lines after that (the other scripts' sections).
    """
    md_path = Path(md_path)
    plot_dir = plot_dir if plot_dir is not None else md_path.parent
    docs = [analysis.finalize(d) for d in docs]
    docs.sort(key=lambda d: d["env"]["date"], reverse=True)  # newest first ...
    docs.sort(key=lambda d: not d["env"].get("meaningful", False))  # ... accelerator runs before host-only ones
    plots = [plot(d, plot_dir / name) for d, name in zip(docs, plot_names(docs), strict=True)]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(docs, plots, md_path.parent, exchanges, extra))
    return [md_path] + [p for p in plots if p is not None]


def text_summary(doc: dict[str, Any]) -> str:
    """A compact terminal table of one run: step time, x ideal, peak memory, status, then targets."""
    lines = []
    if not doc["env"].get("meaningful", False):
        lines.append(f"NOTE: {doc['env'].get('note')}")
    lines.append(f"{'model':<12} {'tokens':>6} {'system':<34} {'step ms':>10} {'x ideal':>8} {'peak GB':>8}  status")
    for r in doc["runs"]:
        ok = r["status"] == "ok"
        lines.append(f"{r['workload']:<12} {r['tokens']:>6} {r['label']:<34} "
                     f"{_f(r.get('step_ms') if ok else None):>10} {_f(r.get('ratio_to_ideal'), '{:.3f}'):>8} "
                     f"{_f(r['peak_alloc_bytes'] / GB if ok else None):>8}  "
                     f"{'ok' if ok else r['status'] + ': ' + str(r.get('reason', ''))[:60]}")
    counts: dict[str, int] = {}
    for t in doc.get("targets", []):
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    lines.append("targets: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)
