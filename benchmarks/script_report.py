"""Sections of the benchmarks page (``docs/benchmarks.md``, and ``report.py``'s Markdown) for the results of the
scripts in this folder that are not ``magi bench`` runs (``report.py`` appends them): two ranks with one host copy
(``llama70b_two_gpus.py``), loading a checkpoint (``load_rate.py``), expert parallelism (``moe_ep.py``), time to
the first step against the peers' loaders (``first_step_vs_peers.py``), the card-size grid (``cap_grid.py``), and
``magi bench --generate`` (one process per system, merged: rendered by :mod:`magi_core.bench.generate.report`).
Each is recognised by its keys; unknown documents are left out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from magi_core.bench.generate.report import INTRO as GENERATE_INTRO
from magi_core.bench.generate.report import generate_markdown, is_generate_doc
from magi_core.bench.report import human_bytes


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _changes(d: dict[str, Any] | None) -> str:
    """"yes"/"no": whether logits in ``d`` (a diff against the eager reference) differ at all."""
    return "-" if not d else ("yes" if d.get("max_abs_diff") else "no")


def is_two_gpu_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/llama70b_two_gpus.py`` result."""
    return "ranks" in doc and ("host_over_weights" in doc or "shmem_over_weights" in doc)


def is_load_rate_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/load_rate.py`` result."""
    return "checkpoint" in doc and "rows" in doc and "magi_read_vs_page_cache" in doc


def is_moe_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/moe_ep.py`` result."""
    return isinstance(doc.get("model"), dict) and "results" in doc and "torchrun_command" in doc


def _host_over_weights(doc: dict[str, Any]) -> Any:
    """The ranks' summed arena Pss over the weights (older results: the node's Shmem growth)."""
    return doc.get("host_over_weights", doc.get("shmem_over_weights"))


def two_gpu_run(doc: dict[str, Any]) -> list[str]:
    """One run: host bytes of the node against the weights, each rank's step against its ideal, load, first step."""
    lines = [f"### {doc.get('layers')} layers, hidden {doc.get('hidden')}, {doc.get('tokens')} tokens, "
             f"{doc.get('gpus')}x {doc.get('hardware')} - {doc.get('date')}", "",
             f"torch {doc.get('torch')}, {human_bytes(doc.get('weight_bytes'))} of weights, ratio "
             f"{doc.get('ratio')}; host memory of the weights {_f(_host_over_weights(doc), '{:.4f}')}x the "
             f"weights; command: `{doc.get('command')}`", "",
             "| rank | step ms | ideal ms | x ideal | streamed | link GB/s | planning probe GB/s | arena copy GB/s | "
             "load s | load GB/s | first step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("ranks", []):
        load = r.get("load") or {}
        lines.append(f"| {r.get('rank')} | {_f(r.get('step_ms'))} | {_f(r.get('ideal_ms'))} | "
                     f"{_f(r.get('x_ideal'), '{:.3f}')} | {human_bytes(r.get('streamed_bytes'))} | "
                     f"{_f(r.get('link_GBps'), '{:.2f}')} | {_f(r.get('planning_link_GBps'), '{:.2f}')} | "
                     f"{_f(r.get('arena_copy_GBps'), '{:.2f}')} | "
                     f"{_f(r.get('load_s'))} | {_f(load.get('GBps'), '{:.2f}')} | {_f(r.get('first_step_s'))} |")
    targets = doc.get("targets", {})
    lines += ["", "Targets: " + "; ".join(f"{k}: **{'met' if v else 'missed'}**" for k, v in targets.items())
              + ".", ""]
    return lines


def load_rate_run(doc: dict[str, Any]) -> list[str]:
    """One run: each way of loading the checkpoint with its rate and its rate against the page cache."""
    hw = doc.get("hardware") or {}
    ck = doc.get("checkpoint") or {}
    rows = doc.get("rows") or {}
    cache = max((r.get("GBps") or 0 for r in rows.get("page_cache") or []), default=0) or None
    lines = [f"### {human_bytes(ck.get('bytes'))} checkpoint, {hw.get('cpu')} ({hw.get('cores')} cores) - "
             f"{doc.get('date')}", "", f"command: `{doc.get('command')}`", ""]
    if doc.get("note"):
        lines += [f"Note: {doc['note']}", ""]
    best = doc.get("magi_end_to_end_vs_page_cache")
    if best is not None:
        read_x = _f(doc.get("magi_read_vs_page_cache"), "{:.2f}")
        verdict = "met" if best >= 0.8 else "missed"
        lines += [f"Best magi run against the best page-cache read: read {read_x}x, end to end {best:.2f}x (target "
                  f">= 0.80x: **{verdict}**). The ratios below are against the best page-cache read too.", ""]
    lines += ["| way | threads | seconds | read GB/s | end-to-end GB/s | read x page cache | "
              "end-to-end x page cache | anonymous extra |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        for r in runs:
            read, e2e = r.get("GBps_read", r.get("GBps")), r.get("GBps_end_to_end", r.get("GBps"))
            lines.append(f"| {name} | {r.get('threads', '-')} | {_f(r.get('seconds'), '{:.2f}')} | "
                         f"{_f(read, '{:.2f}')} | {_f(e2e, '{:.2f}')} | "
                         f"{_f(read / cache if read and cache else None, '{:.2f}')} | "
                         f"{_f(e2e / cache if e2e and cache else None, '{:.2f}')} | "
                         f"{human_bytes(r.get('anon_extra_bytes'))} |")
    lines.append("")
    return lines


def moe_run(doc: dict[str, Any]) -> list[str]:
    """One run, per EP size: host bytes per node against the all-shared and all-private layouts, each rank's logits."""
    m = doc.get("model") or {}
    hw = doc.get("hardware") or {}
    lines = [f"### {m.get('class')}, hidden {m.get('hidden')}, {m.get('layers')} layers, {m.get('experts')} "
             f"experts, {m.get('dtype')}, {hw.get('accelerators') or hw.get('cpu')} - {doc.get('date')}", "",
             f"backend {doc.get('backend')}, units {doc.get('unit_compiler')}; command: `{doc.get('command')}`"]
    if doc.get("note"):
        lines += ["", f"Note: {doc['note']}"]
    lines += ["", "| EP | ranks | distinct | all shared | all private | arena Pss / distinct | rank | "
              "max abs diff vs eager (of max) | vs compiled | argmax changed | rank 0's experts change it | "
              "step x transfer ideal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc.get("results", []):
        rep, meas = s.get("report", {}), s.get("measured", {})
        for r in s.get("per_rank", []):
            e, c = r.get("offloaded_vs_eager") or {}, r.get("offloaded_vs_compiled") or {}
            st = r.get("stream") or {}
            lines.append(
                f"| {s.get('ep')} | {s.get('ranks')} | {human_bytes(rep.get('distinct'))} | "
                f"{human_bytes(rep.get('all_shared'))} | {human_bytes(rep.get('all_private'))} | "
                f"{_f(meas.get('arena_pss_vs_distinct'), '{:.4f}')} | {r.get('rank')} | "
                f"{_f(e.get('max_abs_diff'), '{:.3g}')} ({_f(e.get('max_abs'), '{:.3g}')}) | "
                f"{_f(c.get('max_abs_diff'), '{:.3g}')} | {_f(e.get('argmax_changed'), '{:.3f}')} | "
                f"{_changes((r.get('predecessor_rule') or {}).get('logits_vs_eager'))} | "
                f"{_f(st.get('x_transfer_ideal'), '{:.3f}')} |")
    lines.append("")
    return lines


def is_first_step_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/first_step_vs_peers.py`` result."""
    return "rows" in doc and "checkpoint_bytes" in doc and "tokens" in doc


def first_step_run(doc: dict[str, Any]) -> list[str]:
    """One run: each system's seconds to its model loaded and to the first output, its next step, host memory."""
    lines = [f"### {doc.get('model')}, {doc.get('tokens')} tokens, {human_bytes(doc.get('checkpoint_bytes'))} "
             f"checkpoint, {doc.get('hardware')} - {doc.get('date')}", "", f"command: `{doc.get('command')}`"]
    if doc.get("note"):
        lines += ["", f"Note: {doc['note']}"]
    lines += ["", "| system | status | loaded s | first output s | second step s | peak RSS | anonymous peak extra | "
              "shared memory | unit compiles (reused) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        c = r.get("unit_compiles") or {}
        compiles = f"{c.get('compiled')} ({c.get('reused')})" if c else "-"
        status = r.get("status", "-") + (f": {r['reason']}" if r.get("status") != "ok" and r.get("reason") else "")
        lines.append(f"| {r.get('system')} | {status} | {_f(r.get('seconds_to_loaded'))} | "
                     f"{_f(r.get('seconds_to_first_output'))} | {_f(r.get('second_step_s'), '{:.3f}')} | "
                     f"{human_bytes(r.get('peak_rss_bytes'))} | {human_bytes(r.get('anon_peak_extra_bytes'))} | "
                     f"{human_bytes(r.get('shm_weight_bytes'))} | {compiles} |")
    lines.append("")
    return lines


def is_cap_grid_doc(doc: dict[str, Any]) -> bool:
    """True for a ``benchmarks/cap_grid.py`` result."""
    return doc.get("kind") == "cap-grid" and "rows" in doc


def cap_grid_run(doc: dict[str, Any]) -> list[str]:
    """One grid: per model, a row per system and a column per card size (step ms, x ideal, peak reserved)."""
    counts = sorted({len(r["steps_ms"]) for r in doc.get("rows", []) if r.get("steps_ms")}) or [doc.get("steps")]
    steps = f"{counts[0]} steps" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} steps (per row in the JSON)"
    lines = [f"### {', '.join(doc.get('models', []))} on {doc.get('hardware')} - {doc.get('date')}", "",
             f"torch {doc.get('torch')}, {doc.get('dtype')}, median of {steps}; "
             f"{len(doc.get('remaining') or [])} rows not run yet; commands: "
             + "; ".join(f"`{c}`" for c in doc.get("commands", [])), ""]
    caps = list(doc.get("caps", []))
    for model in doc.get("models", []):
        rows = [r for r in doc.get("rows", []) if r.get("model") == model]
        if not rows:
            continue
        weights = next((r.get("weight_bytes") for r in rows if r.get("weight_bytes")), None)
        lines += [f"{model}, {doc.get('tokens', {}).get(model)} tokens, {human_bytes(weights)} of weights: step ms "
                  "(x ideal; peak reserved), or why it did not run", "",
                  "| system | " + " | ".join(caps) + " |", "|---|" + "---|" * len(caps)]
        floors = {r.get("cap"): r.get("card_floor_ms") for r in rows if r.get("card_floor_ms") is not None}
        lines.append("| card floor ms | " + " | ".join(_f(floors.get(c)) for c in caps) + " |")
        for system in dict.fromkeys(r.get("system") for r in rows):
            cells = []
            for cap in caps:
                r = next((x for x in rows if x.get("system") == system and x.get("cap") == cap), None)
                if r is None:
                    cells.append("-")
                elif r.get("status") != "ok":
                    why = str(r.get("reason") or r.get("status")).replace("|", "/").replace("\n", " ")
                    cells.append(f"{r.get('status')}: {why[:90]}")
                else:
                    cells.append(f"{_f(r.get('step_ms'))} ({_f(r.get('ratio_to_ideal'), '{:.2f}')}x; "
                                 f"{human_bytes(r.get('peak_reserved_bytes'))})")
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


#: (recogniser, section title, what the section's tables mean, one run's lines) for every kind of script result.
SECTIONS: tuple[tuple[Callable[[dict[str, Any]], bool], str, str, Callable[[dict[str, Any]], list[str]]], ...] = (
    (is_two_gpu_doc, "One host copy, several GPUs (`benchmarks/llama70b_two_gpus.py`)",
     "Every rank runs the model (data parallel) from one copy of the weights in shared memory, half of them "
     "resident; ideal = the bytes it streams / its own host-to-device rate from a pinned probe with every rank "
     "copying at once, or its profiled compute if larger (runs without a planning-probe column used rank 0's "
     "planning probe as the link rate).",
     two_gpu_run),
    (is_load_rate_doc, "Loading a checkpoint into the host arena (`benchmarks/load_rate.py`)",
     "`page_cache`: reading the files (already in the page cache) into one reused buffer; `page_cache_fresh`: into "
     "new memory; `magi*`: `magi_core.load` into the shared arena (read: the reading phase; end to end: with "
     "planning, pinning and the rest).", load_rate_run),
    (is_moe_doc, "Expert parallelism, per-tensor sharing (`benchmarks/moe_ep.py`)",
     "Dense tensors identical on every rank, experts filled per EP group: the node should hold the distinct bytes "
     "once. \"vs eager\" / \"vs compiled\": the offloaded logits against the same model resident (eager, or "
     "compiled whole); \"rank 0's experts\": whether the predecessor's rule (rank 0's file for everyone) changes "
     "this rank's logits.", moe_run),
    (is_first_step_doc, "Time to the first step against the peers' loaders (`benchmarks/first_step_vs_peers.py`)",
     "Each system in a fresh process loads the checkpoint (page cache warm) and runs two steps: magi-core "
     "(`magi_core.load` of the meta model, ratio 0, units compiled by Inductor), diffusers (`from_pretrained` + "
     "`enable_group_offload`, block level, with a copy stream), accelerate (`load_checkpoint_and_dispatch` to the "
     "CPU + `cpu_offload`). magi-core's first output includes Dynamo's trace and the units' compiles.",
     first_step_run),
    (is_cap_grid_doc, "Step time against card size (`benchmarks/cap_grid.py`)",
     "Each cell is a process of its own whose device memory was capped at the column's size before its first "
     "allocation (`magi bench --device-memory`; on CUDA the caching allocator's memory fraction), so it ran as on a "
     "card of that size; `none` is the whole card. x ideal: the step against max(the uncapped resident compiled "
     "step, the bytes it streams / its process's pinned link rate); card floor: max(that compute, (weights - card) "
     "/ link), what any system must stream at that size.", cap_grid_run),
    (is_generate_doc, "Generate: prefill and decode (`magi bench --generate`)", GENERATE_INTRO, generate_markdown),
)


def is_script_doc(doc: dict[str, Any]) -> bool:
    """True for a result any section here renders."""
    return any(recognise(doc) for recognise, *_ in SECTIONS)


#: Plots of a kind's runs in the docs directory, by the run's date (``cap_grid.py --plot``, copied there).
PLOTS: dict[Callable[[dict[str, Any]], list[str]], str] = {cap_grid_run: "cap-grid-{date}-*.png"}


def scripts_markdown(docs: Sequence[dict[str, Any]], docs_dir: Path | None = None) -> list[str]:
    """A section per kind present in ``docs``, its runs newest first (with their plots found in ``docs_dir``)."""
    lines: list[str] = []
    for recognise, title, intro, run in SECTIONS:
        mine = sorted((d for d in docs if recognise(d)), key=lambda d: d.get("date") or (d.get("env") or {}).get(
            "date") or "", reverse=True)
        if mine:
            lines += [f"## {title}", "", intro, ""]
            for doc in mine:
                lines += run(doc)
                pattern = PLOTS.get(run)
                date = str(doc.get("date") or "")[:10]
                if pattern and docs_dir is not None and date:
                    lines += [f"![{title}]({png.name})" for png in sorted(docs_dir.glob(pattern.format(date=date)))]
                    lines.append("")
    return lines
