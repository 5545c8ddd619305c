"""Regenerate docs/BENCHMARKS.md and its PNG plots from benchmark result JSON files.

python benchmarks/report.py [RESULT.json ...] [--md docs/BENCHMARKS.md]
Without files it uses every JSON under benchmarks/results/ (accelerator runs first, newest first).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from magi_core.bench.report import load, write_report

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the results, write the Markdown and plots; return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", type=Path, help="result JSON files (default benchmarks/results/*.json)")
    parser.add_argument("--md", type=Path, default=ROOT / "docs" / "BENCHMARKS.md", help="Markdown file to write")
    parser.add_argument("--plots", type=Path, default=None, help="folder for the PNG plots (default next to --md)")
    args = parser.parse_args(argv)
    paths = args.results or sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    # the results folder also holds other benchmarks' JSON (host bandwidth): keep `magi bench` documents only
    docs = [load(p) for p in paths if args.results or "runs" in json.loads(p.read_text())]
    for path in write_report(docs, args.md, args.plots):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
