"""The transfer plan, checked on a recording backend in a subprocess (``MAGI_BACKEND=recording``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/
REC = HERE / "recording_backend"


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REC), env.get("PYTHONPATH", "")])
    env["MAGI_BACKEND"] = "recording"
    proc = subprocess.run(
        [sys.executable, str(REC / "check_transfer_plan.py"), str(HERE)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == 14, proc.stdout[-2000:]
    return out


def test_outputs_match_and_plan_installed(results):
    for r in results:
        assert r["match"], r  # the first call with the static plan (resident weights copied there)
        assert r["phase"] == "planned", r
        for k, step in enumerate(r["steps"]):  # every steady-state step after it (prefetch carried across calls)
            assert step["match"], (r["model"], r["policy"], r["ratio"], f"steady step {k}")


def _allocating(results: list[dict]) -> list[dict]:
    """The runs whose transfer allocates each copy (the copies and device bytes below are counted per weight)."""
    return [r for r in results if r["allocates"]]


def test_each_offloaded_weight_copied_once_per_step_kept_weights_never(results):
    for r in _allocating(results):
        for step in r["steps"]:
            assert len(step["copies"]) == r["streamed_weights"], (r["model"], r["policy"], r["ratio"])
            assert step["distinct_sources"]
        if r["ratio"] == 1.0:
            assert all(not s["copies"] for s in r["steps"])
        assert r["first_planned_copies"] >= r["resident_weights"]


def test_prefetch_order_and_positions_as_planned(results):
    for r in _allocating(results):
        for step in r["steps"]:
            assert step["copies"] == step["expected"], (r["model"], r["policy"], r["ratio"])


def test_copies_on_copy_stream_and_compute_waits_on_copy_events_only(results):
    for r in _allocating(results):
        for step in r["steps"]:
            assert step["all_on_copy_stream"] and step["all_non_blocking"]
            assert step["waits_on_copy_events_only"]
            if r["streamed_weights"]:
                assert step["n_waits"] > 0


def test_copies_start_no_earlier_than_the_unit_that_issues_them(results):
    # the copy stream waits on a compute-stream event recorded just before the issuing unit's launch
    for r in _allocating(results):
        for step in r["steps"]:
            assert step["copy_waits_on_compute_events_only"]
            assert step["copies_gated_at_their_unit"], (r["model"], r["policy"], r["ratio"])
            if any(c[0] > 0 for c in step["copies"]):
                assert step["n_copy_waits"] > 0


def test_peak_device_bytes_within_budget_plus_two_units(results):
    for r in _allocating(results):
        for step in r["steps"]:
            assert step["peak"] <= step["budget"], (r["model"], r["policy"], r["ratio"], step["peak"], step["budget"])
            # after a step only resident weights and the next step's prefetch stay alive
            assert step["alive_after"] == step["resident_bytes"] + step["carry_bytes"]


def test_measured_step_holds_no_more_than_the_plan_predicts(results):
    """``stats()``'s measured peak of a planned step stays within its predicted peak (plus one unit where the
    transfer allocates per copy: the host may run a unit ahead of the plan's working set)."""
    for r in results:
        assert r["predicted_peak_bytes"] is not None and r["measured_peak_bytes"] is not None, r["model"]
        slack = r["largest_unit"] if r["allocates"] else 0
        assert r["measured_peak_bytes"] <= r["predicted_peak_bytes"] + slack, (
            r["model"], r["policy"], r["ratio"], r["measured_peak_bytes"], r["predicted_peak_bytes"])


def test_copies_into_fixed_places_at_step_start_wait_for_the_compute_stream(results):
    """The unit transfer's places are reused across steps: a batch issued at step start (before any unit's gate)
    waits on an event of the compute stream, or it could overwrite bytes the previous step still reads."""
    fixed = [r for r in results if not r["allocates"]]
    assert any(c[0] == 0 for r in fixed for step in r["steps"] for c in step["copies"]), "copies at step start ran"
    for r in fixed:
        for step in r["steps"]:
            assert step["start_copies_gated"], (r["model"], r["policy"], r["ratio"], r["transfer"])
