"""The sections of the benchmarks page for the scripts' results that are not ``magi bench`` runs: each kind is
recognised, rendered from its own figures, and kept out of the bench documents."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from magi_core.bench import report

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"
sys.path.insert(0, str(BENCHMARKS))
from script_report import (  # noqa: E402
    is_first_step_doc,
    is_load_rate_doc,
    is_moe_doc,
    is_script_doc,
    is_two_gpu_doc,
    scripts_markdown,
)


def _two_gpu(x: float) -> dict:
    rank = {"rank": 0, "step_ms": 1000.0 * x, "ideal_ms": 1000.0, "x_ideal": x, "streamed_bytes": 7e10,
            "link_GBps": 70.0, "arena_copy_GBps": 68.5, "load_s": 10.0, "first_step_s": 3.0, "load": {"GBps": 7.0}}
    return {"date": "2026-12-01", "layers": 80, "hidden": 8192, "tokens": 2048, "gpus": 2, "hardware": "GPU",
            "torch": "t", "ratio": 0.5, "weight_bytes": 14e10, "shmem_over_weights": 1.0, "ranks": [rank],
            "targets": {"step <= 1.02x ideal": x <= 1.02}, "command": "torchrun ..."}


def _moe(diff: float, wrong_diff: float) -> dict:
    rank = {"rank": 1, "offloaded_vs_eager": {"max_abs_diff": diff, "max_abs": 2.0, "argmax_changed": 0.0},
            "predecessor_rule": {"logits_vs_eager": {"max_abs_diff": wrong_diff}}, "stream": {"x_transfer_ideal": 1.01}}
    return {"model": {"class": "Mixtral", "hidden": 64, "layers": 2, "experts": 8, "dtype": "float32"},
            "hardware": {"cpu": "cpu"}, "backend": "gloo", "unit_compiler": "eager", "command": "python ...",
            "torchrun_command": [], "date": "2026-12-01",
            "results": [{"ep": 2, "ranks": 2, "report": {"distinct": 3e9, "all_shared": 2e9, "all_private": 4e9},
                         "measured": {"arena_pss_vs_distinct": 1.0}, "per_rank": [rank]}]}


def _first_step() -> dict:
    return {"model": "wan14b", "tokens": 2184, "checkpoint_bytes": 1.4e10, "hardware": "GPU", "date": "2026-12-01",
            "command": "python ...", "rows": [
                {"system": "magi", "status": "ok", "seconds_to_loaded": 7.25, "seconds_to_first_output": 126.58,
                 "second_step_s": 0.2694, "peak_rss_bytes": 1.6e10, "anon_peak_extra_bytes": 5e8,
                 "shm_weight_bytes": 1.4e10, "unit_compiles": {"compiled": 3, "reused": 19}},
                {"system": "slow", "status": "timed out", "reason": "--worker-timeout 230 s"}]}


def test_each_kind_is_recognised_and_nothing_else() -> None:
    two, moe = _two_gpu(1.0), _moe(0.0, 1.0)
    load = {"checkpoint": {"bytes": 1e9}, "rows": {}, "magi_read_vs_page_cache": 1.0}
    assert is_two_gpu_doc(two) and not is_moe_doc(two) and not is_load_rate_doc(two)
    assert is_moe_doc(moe) and not is_two_gpu_doc(moe)
    assert is_load_rate_doc(load) and not is_moe_doc(load)
    first = _first_step()
    assert is_first_step_doc(first) and not any(f(first) for f in (is_two_gpu_doc, is_moe_doc, is_load_rate_doc))
    assert not any(is_first_step_doc(d) for d in (two, moe, load))
    bench_like = {"runs": [], "env": {}}
    exchange = {"exchange_on": [], "exchange_off": []}
    assert not is_script_doc(bench_like) and not is_script_doc(exchange)


def test_sections_carry_each_runs_figures_and_verdicts() -> None:
    text = "\n".join(scripts_markdown([_two_gpu(1.010), _two_gpu(1.031), _moe(0.0, 0.5), _moe(0.25, 0.0)]))
    assert "| 0 | 1010.0 | 1000.0 | 1.010 |" in text and "| 0 | 1031.0 | 1000.0 | 1.031 |" in text
    assert "step <= 1.02x ideal: **met**" in text and "step <= 1.02x ideal: **missed**" in text
    assert "| 68.50 |" in text  # the copy rate from the whole arena
    # the MoE rows: offloaded against eager, and whether rank 0's experts would change this rank's logits
    assert "| 0 (2) |" in text and "| 0.25 (2) |" in text
    assert text.count("| yes |") == 1 and text.count("| no |") == 1
    first = "\n".join(scripts_markdown([_first_step()]))
    assert "| magi | ok | 7.2 | 126.6 | 0.269 |" in first and "| 3 (19) |" in first
    assert "| slow | timed out: --worker-timeout 230 s |" in first


@pytest.mark.parametrize("name", ["2026-12-01-llama70b-2xh200.json", "2026-12-01-load-rate-8b-h200.json",
                                  "2026-12-01-moe-ep-2xh200.json", "2026-12-01-first-step-wan14b-h200.json"])
def test_committed_results_get_a_section_and_stay_out_of_the_bench_tables(name: str, tmp_path: Path) -> None:
    doc = json.loads((RESULTS / name).read_text())
    assert is_script_doc(doc) and "runs" not in doc
    md = report.markdown([], [], tmp_path, extra=scripts_markdown([doc]))
    assert doc["date"] in md and md.count("\n## ") >= 1
