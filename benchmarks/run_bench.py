"""Run the magi-core benchmark (same as ``magi bench``): python benchmarks/run_bench.py [--quick] [--out PATH] ..."""

from __future__ import annotations

import argparse
import sys

from magi_core.bench import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="run_bench.py", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
