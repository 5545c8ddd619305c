"""Write the benchmark tables (Markdown, for reading offline) and their PNG plots from benchmark result JSON files.

The documentation site renders the same tables into its benchmarks page when it is built (docs/_hooks/benchmarks.py)
and shows the plots this script writes into docs/.

python benchmarks/report.py [RESULT.json ...] [--md build/benchmarks/BENCHMARKS.md] [--plots docs]
python benchmarks/report.py --merge MERGED.json PART.json PART.json ...
Without files it uses every JSON under benchmarks/results/ (accelerator runs first, newest first).
With --merge, the given documents (parts of one grid run by several processes of one machine) are merged
into MERGED.json first (magi_core.bench.analysis.merge); the report is then written from the result folder when
MERGED.json is in it, else from MERGED.json alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from magi_core.bench.analysis import merge
from magi_core.bench.report import is_exchange_doc, load, write_report

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also when loaded from elsewhere
from script_report import is_script_doc, scripts_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the results, write the Markdown and plots; return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", type=Path, help="result JSON files (default benchmarks/results/*.json)")
    parser.add_argument("--md", type=Path, default=ROOT / "build" / "benchmarks" / "BENCHMARKS.md",
                        help="Markdown file to write (default build/benchmarks/BENCHMARKS.md)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="folder for the PNG plots (default docs/, where the site shows them, when --md is the "
                             "default; else next to --md)")
    parser.add_argument("--merge", type=Path, default=None, metavar="MERGED_JSON",
                        help="merge the given result files into this file, then report (see above)")
    args = parser.parse_args(argv)
    if args.plots is None and "--md" not in (argv if argv is not None else sys.argv[1:]):
        args.plots = ROOT / "docs"
    if args.merge is not None:
        if not args.results:
            parser.error("--merge needs the result files to merge")
        merged = merge([json.loads(p.read_text()) for p in args.results])
        args.merge.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {args.merge} ({len(merged['runs'])} runs from {len(args.results)} files)")
        results_dir = (ROOT / "benchmarks" / "results").resolve()
        # merged into the results folder: report on the folder; elsewhere: on the merged document alone
        args.results = [] if args.merge.resolve().parent == results_dir else [args.merge]
    paths = args.results or sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    # the results folder also holds other benchmarks' JSON (host bandwidth): keep `magi bench` documents only
    raw = {p: json.loads(p.read_text()) for p in paths}
    exchanges = [d for d in raw.values() if is_exchange_doc(d)]
    scripts = [d for d in raw.values() if is_script_doc(d)]
    docs = [load(p) for p, d in raw.items()
            if not is_exchange_doc(d) and not is_script_doc(d) and (args.results or "runs" in d)]
    for path in write_report(docs, args.md, args.plots, exchanges, scripts_markdown(scripts)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
