"""mkdocs hook: the benchmark results of ``benchmarks/results/*.json`` rendered into ``benchmarks.md`` at build time.

``docs/benchmarks.md`` holds the prose (how to run, what the columns mean); the line ``<!-- benchmark-results -->``
in it is replaced by one section per ``magi bench`` result document (newest first, accelerator runs before host-only
ones), the weight-exchange results and the other scripts' results, rendered by the same functions as
``benchmarks/report.py``. Plots are shown where their PNG is in ``docs/``. Nothing is written to the source tree.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.benchmarks")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- benchmark-results -->"
PAGE = "benchmarks.md"


def results_markdown(docs_dir: Path) -> str:
    """The generated part of the benchmarks page, from every JSON document in ``benchmarks/results``."""
    from magi_core.bench import analysis
    from magi_core.bench.report import doc_markdown, exchange_markdown, is_exchange_doc, load, plot_names

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from script_report import is_script_doc, scripts_markdown
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    paths = sorted(RESULTS.glob("*.json"))
    raw = {p: json.loads(p.read_text(encoding="utf-8")) for p in paths}
    exchanges = [d for d in raw.values() if is_exchange_doc(d)]
    scripts = [d for d in raw.values() if is_script_doc(d)]
    bench: list[dict[str, Any]] = [analysis.finalize(load(p)) for p, d in raw.items()
                                   if "runs" in d and not is_exchange_doc(d) and not is_script_doc(d)]
    bench.sort(key=lambda d: d["env"]["date"], reverse=True)
    bench.sort(key=lambda d: not d["env"].get("meaningful", False))
    lines: list[str] = []
    for doc, name in zip(bench, plot_names(bench), strict=True):
        png = docs_dir / name
        lines += doc_markdown(doc, png if png.exists() else None, docs_dir)
    if exchanges:
        lines += exchange_markdown(exchanges)
    lines += scripts_markdown(scripts, docs_dir)
    log.info("benchmarks page: %d bench documents, %d exchange, %d script results", len(bench), len(exchanges),
             len(scripts))
    return "\n".join(lines).rstrip() + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the rendered results in place of the marker on the benchmarks page."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its '{MARKER}' line: the hook has nowhere to put the results")
    return markdown.replace(MARKER, results_markdown(Path(config["docs_dir"])))
