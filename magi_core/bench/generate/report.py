"""A generate result as a table: the Markdown section of the benchmarks page and the summary ``magi bench`` prints."""

from __future__ import annotations

from typing import Any

from magi_core.bench.report import human_bytes

GIB = 1 << 30
HEADER = ("system", "ratio / budget", "prefill ms", "ms/token", "tokens/s", "ideal ms/token", "x ideal",
          "host us/unit", "peak GiB (alloc / reserved)", "predicted peak GiB", "compiles", "tokens match")
#: What the generate tables mean (the benchmarks page prints it above them).
INTRO = ("Each system runs in a process of its own: warm-up `generate` calls (the compiles, magi-core's plans), then "
         "one timed greedy `generate` of the prompt. prefill ms: from the call to the first token (the prompt's "
         "forward); ms/token: the median decode step (the device synchronised after each token); tokens/s: batch x "
         "1000 / ms per token; ideal ms/token: max(the resident decode step, bytes a decode step streams / the "
         "pinned host-to-device rate measured in the same process); host us/unit: magi-core's host time inside a "
         "decode forward, less the time it blocked waiting for copies, per unit; peak: the device's peak over the "
         "timed `generate`, next to the largest peak magi-core's plans predicted; compiles: graphs compiled "
         "(magi-core's runtimes, Dynamo's graphs for the compiled resident); tokens match: the greedy tokens equal "
         "the compiled resident model's over the tokens both produced. accelerate: `device_map=\"auto\"` with "
         "`max_memory` of a share of the weights on the device, the rest offloaded to the host.")


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def setting(row: dict[str, Any]) -> str:
    """The row's residency: magi-core's ratio or budget, accelerate's device share, or resident."""
    if row.get("system") == "magi":
        if row.get("budget_fraction") is not None:
            return f"budget {row['budget_fraction']:g} W ({human_bytes(row.get('budget_bytes'))})"
        return f"ratio {row.get('ratio', 0):g}"
    if row.get("system") == "accelerate":
        share = row.get("accelerate_budget_fraction")
        return f"device {share:g} W" if share is not None else "device map"
    return "all resident"


def _match(row: dict[str, Any]) -> str:
    m = row.get("tokens_match_resident")
    if m is None:
        return "-" if row.get("system", "").startswith("resident") else "no reference"
    if m:
        return f"yes ({row.get('tokens_compared')})"
    return f"no (from token {row.get('first_mismatch')} of {row.get('tokens_compared')})"


def cells(row: dict[str, Any]) -> list[str]:
    """One row's table cells (a row that did not run: its status and reason)."""
    name = row.get("label") or row.get("system") or "?"
    if row.get("status") != "ok":
        why = str(row.get("reason") or row.get("status")).replace("|", "/").replace("\n", " ")[:120]
        return [name, setting(row), f"{row.get('status')}: {why}"] + ["-"] * (len(HEADER) - 3)
    peak = (f"{row['peak_alloc_bytes'] / GIB:.2f} / {row['peak_reserved_bytes'] / GIB:.2f}"
            if row.get("peak_alloc_bytes") is not None else "-")
    predicted = row.get("predicted_peak_bytes")
    return [name, setting(row), _f(row.get("prefill_ms")), _f(row.get("decode_ms_per_token"), "{:.2f}"),
            _f(row.get("decode_tokens_per_s")), _f(row.get("ideal_ms_per_token"), "{:.2f}"),
            _f(row.get("x_ideal"), "{:.3f}"), _f(row.get("host_us_per_unit")), peak,
            _f(predicted / GIB if predicted else None, "{:.2f}"), _f(row.get("compiles"), "{:d}"), _match(row)]


def title(doc: dict[str, Any]) -> str:
    """``llama8b, 2048-token prompt, 32 new tokens, batch 1, dynamic cache, NVIDIA H200 - date``."""
    o = doc.get("options") or {}
    env = doc.get("env") or {}
    prompt = next((r.get("prompt_tokens") for r in doc.get("rows", []) if r.get("prompt_tokens")), o.get(
        "prompt_tokens"))
    return (f"{', '.join(o.get('models') or [])}, {prompt}-token prompt, {o.get('new_tokens')} new tokens, batch "
            f"{o.get('batch')}, {o.get('cache')} cache, {env.get('hardware') or '?'} - {env.get('date') or '?'}")


def generate_markdown(doc: dict[str, Any]) -> list[str]:
    """One result as a titled Markdown table, with versions, link rate and the commands that made it."""
    env = doc.get("env") or {}
    links = sorted({round(float(r["h2d_GBps"]), 2) for r in doc.get("rows", []) if r.get("h2d_GBps")})
    lines = [f"### {title(doc)}", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, accelerate {env.get('accelerate')}, "
             f"python {env.get('python')}; pinned H2D {', '.join(f'{x:.2f}' for x in links) or '-'} GB/s; "
             f"{doc.get('processes') or 'one process'}; commands: "
             + "; ".join(f"`{c}`" for c in doc.get("commands", [])), ""]
    if env.get("note"):
        lines += [f"Note: {env['note']}", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in doc.get("rows", [])]
    lines.append("")
    return lines


def text_summary(doc: dict[str, Any]) -> str:
    """The table as aligned plain text, for the terminal."""
    table = [list(HEADER)] + [cells(r) for r in doc.get("rows", [])]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = [title(doc)] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                            for row in table]
    return "\n".join(lines)


def is_generate_doc(doc: dict[str, Any]) -> bool:
    """True for a ``magi bench --generate`` result."""
    return doc.get("kind") == "generate" and "rows" in doc
