"""Merging ``magi bench`` result parts of one machine: first completed run per configuration, own bandwidth."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from magi_core.bench import analysis
from magi_core.bench.analysis import merge
from magi_core.bench.report import markdown
from magi_core.errors import MagiError


def _env(**over: Any) -> dict[str, Any]:
    backend = {"name": "b", "device_type": "d", "package": "p", "version": "v"}
    return {"hardware": "H", "date": "2026-01-01T00:00:00+00:00", "meaningful": True, "torch": "t",
            "magi_core": "m", "python": "p", "backend": backend, **over}


def _run(system: str, step_ms: float | None, status: str = "ok", **over: Any) -> dict[str, Any]:
    return {"workload": "m", "tokens": 2048, "system": system, "label": over.pop("label", system), "policy": None,
            "ratio": None, "budget_fraction": None, "status": status, "step_ms": step_ms, "weight_bytes": 10**9,
            "recompiles": 0, "peak_alloc_bytes": 0, "peak_reserved_bytes": 0, **over}


def _part(runs: list[dict[str, Any]], bw: float, date: str, **env: Any) -> dict[str, Any]:
    workload = {"block_bytes": [10**8] * 10, "weight_bytes": 10**9, "dtype": "torch.bfloat16", "shape": {}}
    return {"schema": 1, "env": _env(date=date, **env), "h2d_GBps": bw, "workloads": {"m": workload},
            "runs": runs, "notes": [], "options": {}, "time_budget_s": 300.0}


def test_merge_keeps_first_completed_run_and_each_parts_bandwidth() -> None:
    a = _part([
        _run("resident_compiled", 4.0),
        _run("magi", 12.0, policy="H", ratio=0.0, label="magi H r=0"),
        _run("magi", None, "skipped", policy="B", ratio=0.0, label="magi B r=0", reason="time budget spent"),
    ], bw=100.0, date="2026-01-01T00:00:05+00:00")
    b = _part([
        _run("magi", 99.0, policy="H", ratio=0.0, label="magi H r=0"),  # already completed in part a
        _run("magi", 11.0, policy="B", ratio=0.0, label="magi B r=0"),  # completes the skipped one
    ], bw=50.0, date="2026-01-01T00:00:01+00:00")
    doc = merge([a, b])
    by = {r["label"]: r for r in doc["runs"]}
    assert [r["label"] for r in doc["runs"]] == ["resident_compiled", "magi H r=0", "magi B r=0"]
    assert by["magi H r=0"]["step_ms"] == 12.0 and by["magi H r=0"]["part"] == 0
    assert by["magi B r=0"]["status"] == "ok" and by["magi B r=0"]["part"] == 1
    assert doc["env"]["date"] == "2026-01-01T00:00:01+00:00" and len(doc["parts"]) == 2
    assert a["runs"][2]["status"] == "skipped", "the parts are not modified"
    analysis.finalize(doc)
    # each run's ideal uses its own process's bandwidth: 1 GB at 100 GB/s = 10 ms, at 50 GB/s = 20 ms
    assert by["magi H r=0"]["ideal_ms"] == pytest.approx(10.0)
    assert by["magi B r=0"]["ideal_ms"] == pytest.approx(20.0)
    md = markdown([doc], [None], Path("."))
    assert "50.00 - 100.00 (2 processes)" in md and "merged from 2" in md
    json.dumps(doc)  # still a JSON document


def test_merging_a_merged_document_again_keeps_its_parts() -> None:
    """A later run merged in front of an earlier merge: its runs win, every part stays listed with its runs."""
    a = _part([_run("magi", 12.0, policy="H", ratio=0.0, label="magi H r=0")], bw=100.0,
              date="2026-01-01T00:00:05+00:00")
    b = _part([_run("diffusers", 40.0)], bw=50.0, date="2026-01-01T00:00:01+00:00")
    old = merge([a, b])
    new = _part([_run("magi", 10.0, policy="H", ratio=0.0, label="magi H r=0"), _run("accelerate", 30.0)],
                bw=80.0, date="2026-01-02T00:00:00+00:00")
    doc = merge([new, old])
    by = {r["label"]: r for r in doc["runs"]}
    assert [p["h2d_GBps"] for p in doc["parts"]] == [80.0, 100.0, 50.0]
    assert by["magi H r=0"]["step_ms"] == 10.0 and by["magi H r=0"]["part"] == 0
    assert by["diffusers"]["part"] == 2 and by["diffusers"]["h2d_GBps"] == 50.0
    assert [n for n in doc["notes"] if n.startswith("merged from")] == [doc["notes"][-1]]
    assert doc["notes"][-1].startswith("merged from 3 ")


@pytest.mark.parametrize("field,value", [("hardware", "other GPU"), ("torch", "2.99"), ("magi_core", "9")])
def test_merge_refuses_parts_of_other_machines_or_software(field: str, value: str) -> None:
    a = _part([_run("resident_compiled", 4.0)], 100.0, "2026-01-01T00:00:00+00:00")
    b = _part([_run("resident_compiled", 4.0)], 100.0, "2026-01-01T00:00:00+00:00", **{field: value})
    with pytest.raises(MagiError, match=field):
        merge([a, b])
    with pytest.raises(MagiError, match="at least one"):
        merge([])


def test_report_script_merges_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report", Path(__file__).parents[2] / "benchmarks/report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    parts = []
    for i, bw in enumerate((100.0, 80.0)):
        p = tmp_path / f"part{i}.json"
        p.write_text(json.dumps(_part([_run("resident_compiled", 4.0 + i)], bw, f"2026-01-01T00:00:0{i}+00:00")))
        parts.append(str(p))
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr(mod, "ROOT", tmp_path)  # the report then reads tmp_path/benchmarks/results
    merged = results / "merged.json"
    assert mod.main(["--merge", str(merged), *parts, "--md", str(tmp_path / "B.md")]) == 0
    doc = json.loads(merged.read_text())
    assert [r["step_ms"] for r in doc["runs"]] == [4.0] and len(doc["parts"]) == 2
    assert "80.00 - 100.00 (2 processes)" in (tmp_path / "B.md").read_text()
    # merged elsewhere (a device's output folder): the report covers the merged document alone
    merged.unlink()  # the results folder is empty again
    elsewhere = tmp_path / "out" / "merged.json"
    elsewhere.parent.mkdir()
    assert mod.main(["--merge", str(elsewhere), *parts, "--md", str(tmp_path / "C.md")]) == 0
    assert "80.00 - 100.00 (2 processes)" in (tmp_path / "C.md").read_text()


def test_exchange_results_get_their_own_section() -> None:
    from magi_core.bench.report import exchange_markdown, is_exchange_doc

    entry = {"step_ms": 60.0, "weight_rate_GBps": 100.0, "x_single_link_rate": 1.85, "exchanges": 12}
    doc = {"model": "mlp", "tokens": 2048, "gpus": 2, "hardware": "GPU", "date": "2026-12-01", "link_GBps": 54.0,
           "weight_bytes": 6 << 30, "outputs_identical": [True, True], "ok": True, "target": ">= 1.6x",
           "exchange_off": [{**entry, "x_single_link_rate": 0.97, "exchanges": 0}] * 2, "exchange_on": [entry] * 2}
    assert is_exchange_doc(doc) and not is_exchange_doc({"runs": []})
    text = "\n".join(exchange_markdown([doc, {**doc, "ok": False, "outputs_identical": [True, False]}]))
    assert text.count("| 0 | on | 60.000 | 100.0 | 1.85 | 12 |") == 2
    assert "**met**" in text and "**missed**" in text and "per-rank path: False" in text


def test_merge_keeps_every_parts_token_counts_and_their_regimes() -> None:
    # parts that ran one model at different token counts: the merged document knows each count's regime, so the
    # balanced count is held to the balanced target
    a = _part([_run("resident_compiled", 4.0)], bw=100.0, date="2026-01-01T00:00:05+00:00")
    b = _part([_run("resident_compiled", 9.0, tokens=8192),
               _run("magi", 10.1, policy="H", ratio=0.0, label="magi H r=0", tokens=8192)],
              bw=100.0, date="2026-01-01T00:00:06+00:00")
    a["workloads"]["m"]["tokens"] = {"2048": {"regime_h200": "transfer-bound"}}
    b["workloads"]["m"]["tokens"] = {"8192": {"regime_h200": "balanced"}}
    doc = merge([a, b])
    assert doc["workloads"]["m"]["tokens"] == {"2048": {"regime_h200": "transfer-bound"},
                                               "8192": {"regime_h200": "balanced"}}
    analysis.finalize(doc)
    step = [t for t in doc["targets"] if t["scope"].startswith("m 8192 tok, H")]
    assert step and step[0]["target"] == "step <= 1.02x ideal" and step[0]["status"] == "met", step
    assert a["workloads"]["m"]["tokens"] == {"2048": {"regime_h200": "transfer-bound"}}, "the parts are not modified"
