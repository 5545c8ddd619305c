"""Run the magi-core benchmark (same as ``magi bench``): python benchmarks/run_bench.py [--quick] [--out PATH] ...

Real-library models: ``--models llama8b,wan14b`` (transformers Llama-3-8B, diffusers Wan2.1-14B blocks; needs
``pip install 'magi-core[bench-real]'``; a missing library makes its model a recorded skip). Each runs at its own
transfer-bound, balanced and compute-bound token counts unless ``--tokens`` is given (see magi_core.bench.real).
"""

from __future__ import annotations

import argparse
import sys

from magi_core.bench import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="run_bench.py", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
