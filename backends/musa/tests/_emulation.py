"""Load ``tests/fakes/run_emulated.py`` of the magi-core checkout by path (no sys.path changes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "tests" / "fakes" / "run_emulated.py"
_spec = importlib.util.spec_from_file_location("magi_fakes_run_emulated", _PATH)
assert _spec is not None and _spec.loader is not None, f"cannot load {_PATH}"
run_emulated_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_emulated_module)

run_emulated = run_emulated_module.run_emulated
run_emulated_argv = run_emulated_module.run_emulated_argv
FAKES_DIR = run_emulated_module.FAKES_DIR
