"""The diagnostic scripts under benchmarks/ run on the CPU backend at a tiny size and write what they promise."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str, tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_numerics_separates_streaming_from_rounding(tmp_path: Path) -> None:
    doc = _script("numerics", tmp_path, "--layers", "2", "--hidden", "32", "--heads", "2", "--tokens", "8")
    err = doc["errors"]
    # eager units streamed from host memory compute exactly what the resident eager model computes
    assert err["magi_eager_r0"]["vs_eager"] == 0.0 and err["magi_eager_r1"]["vs_eager"] == 0.0
    # streaming does not change a compiled unit's numerics; at ratio 1 the graph compiles whole, as torch.compile
    # does, bit for bit; bf16 is measurably off float32
    assert err["magi_inductor_r0"]["vs_fp32"] == err["magi_inductor_r0.5"]["vs_fp32"]
    assert err["magi_inductor_r1"]["vs_compiled"] == 0.0
    assert 0.0 < err["eager"]["vs_fp32"] < 0.1
    assert err["fp32_eager"]["vs_fp32"] == 0.0 and doc["spec"]["dtype"] == "bfloat16"


def test_host_overhead_reports_every_figure(tmp_path: Path) -> None:
    doc = _script("host_overhead", tmp_path, "--hidden", "16", "--layers", "4", "--tokens", "4", "--rounds", "2")
    assert doc["units"] == 4 and doc["backend"] == "cpu"
    for key in ("resident_compiled_call_us", "ratio1_call_us", "ratio1_wrapped_call_us", "ratio0_call_us",
                "ratio0_host_work_us", "overhead_us_per_unit_ratio1", "ratio1_loop_only_us"):
        assert isinstance(doc[key], float), key
    assert 0.0 <= doc["ratio0_blocked_us"] <= doc["ratio0_call_us"]
    assert len(doc["per_unit"]) == 4 and doc["cprofile_ratio1_top"]


def test_first_step_vs_peers_loads_the_same_model_everywhere(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    ckpt = tmp_path / "ckpt"
    doc = _script("first_step_vs_peers", tmp_path, "--model", "wan14b", "--dir", str(ckpt))
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) == {"magi", "diffusers", "accelerate"}, doc["rows"]
    assert all(r["status"] == "ok" for r in rows.values()), doc["rows"]
    # every loader gives the model the same weights and the same output (float32 on the host)
    assert all(r["max_rel_err_vs_magi"] == 0.0 for r in rows.values())
    weights = rows["magi"]["weight_bytes"]
    assert weights > 0 and all(r["weight_bytes"] == weights for r in rows.values())
    assert rows["magi"]["shm_weight_bytes"] >= weights and rows["diffusers"]["shm_weight_bytes"] == 0
    assert all(0 < r["seconds_to_loaded"] <= r["seconds_to_first_output"] for r in rows.values())
    assert doc["checkpoint_bytes"] > 0 and not doc["meaningful"]
    assert not list(ckpt.glob(".first-step-*"))  # the outputs compared are removed
    assert doc["checkpoint_write_s"] > 0
    # a system that outlasts --worker-timeout is reported, and the next one still runs
    again = _script("first_step_vs_peers", tmp_path, "--model", "wan14b", "--dir", str(ckpt),
                    "--systems", "magi,accelerate", "--worker-timeout", "0.01")
    assert [(r["system"], r["status"]) for r in again["rows"]] == [("magi", "timed out"), ("accelerate", "timed out")]
    assert again["checkpoint_write_s"] is None  # the checkpoint was there already
    # the reference system failing leaves the next one measured (without a comparison)
    third = _script("first_step_vs_peers", tmp_path, "--model", "wan14b", "--dir", str(ckpt),
                    "--systems", "nosuch,accelerate")
    assert [(r["system"], r["status"]) for r in third["rows"]] == [("nosuch", "failed"), ("accelerate", "ok")]
    assert "unknown system" in third["rows"][0]["reason"] and "max_rel_err_vs_nosuch" not in third["rows"][1]


def test_load_rate_compares_magi_with_threads_against_the_page_cache(tmp_path: Path) -> None:
    doc = _script("load_rate", tmp_path, "--layers", "2", "--hidden", "64", "--ffn", "128", "--vocab", "256",
                  "--repeats", "1", "--threads", "1", "--also-threads", "2", "--dir", str(tmp_path / "ckpt"))
    rows = doc["rows"]
    nbytes = rows["magi"][0]["weight_bytes"]  # the files hold these and their headers
    assert rows["magi"][0]["threads"] == 1 and rows["magi_threads_2"][0]["threads"] == 2
    assert rows["magi"][0]["bytes_read"] == rows["magi_threads_2"][0]["bytes_read"] == nbytes > 0
    assert nbytes < doc["checkpoint"]["bytes"] < nbytes + 4096 * 4
    assert doc["threads_read_vs_page_cache"]["2"] > 0 and doc["magi_read_vs_page_cache"] > 0


def test_llama70b_rehearsal_two_gloo_ranks_one_host_copy(tmp_path: Path) -> None:
    """The 70B script's tiny rehearsal (two gloo ranks on the CPU): one host copy for the node, every rank's step
    against its own ideal (its streamed bytes at its own rate measured with every rank copying, or its compute)."""
    pytest.importorskip("transformers")
    out = tmp_path / "llama70b.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "benchmarks" / "llama70b_two_gpus.py"), "--layers", "2", "--hidden", "64", "--tokens", "16",
           "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert 0.99 <= doc["host_over_weights"] <= 1.02 and doc["targets"]["host weights <= 1.02 W"]
    assert doc["host_pss_bytes"] == sum(r["arena_pss_bytes"] for r in doc["ranks"])
    assert all(r["arena_pss_bytes"] > 0 for r in doc["ranks"])  # both ranks map the one copy
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["finite"] for r in ranks)
    for r in ranks:
        nb = r["node_bytes"]
        assert nb["distinct"] == nb["all_shared"] == doc["weight_bytes"] and nb["all_private"] == 2 * nb["distinct"]
        assert r["streamed_bytes"] + r["resident_bytes"] <= doc["weight_bytes"] and r["streamed_bytes"] > 0
        assert r["link_GBps"] > 0 and r["planning_link_GBps"] > 0 and r["compute_ms"] > 0
        want = max(r["streamed_bytes"] / (r["link_GBps"] * 1e9) * 1e3, r["compute_ms"])
        assert r["ideal_ms"] == pytest.approx(want) and r["x_ideal"] == pytest.approx(r["step_ms"] / want)
        assert r["load"]["strict"] and not r["load"]["missing"] and r["plans"]
    assert doc["targets"]["step <= 1.02x ideal"] == all(r["x_ideal"] <= 1.02 for r in ranks)


def _cap_grid_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("cap_grid_script", ROOT / "benchmarks" / "cap_grid.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cap_grid_runs_each_row_in_its_own_process_and_resumes(tmp_path: Path) -> None:
    """Tiny llama8b on the CPU backend: the uncapped row runs, the capped one is a failed row saying the cpu backend
    cannot cap; a second call finds both done and runs nothing."""
    pytest.importorskip("transformers")
    out = tmp_path / "grid.json"
    argv = ["--models", "llama8b", "--tokens", "llama8b=16", "--caps", "none,12GiB", "--systems", "magi_r0",
            "--no-resident", "--out", str(out)]
    first = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cap_grid.py"), *argv], capture_output=True,
                           text=True, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["cap"]: r for r in doc["rows"]}
    assert doc["kind"] == "cap-grid" and doc["complete"] and doc["remaining"] == []
    assert all(r["date"][:10] in doc["dates"] for r in doc["rows"]) and doc["dates"] == sorted(doc["dates"])
    assert rows["none"]["status"] == "ok" and rows["none"]["step_ms"] > 0
    assert rows["none"]["label"] == "magi HEURISTIC r=0"
    assert rows["none"]["streamed_bytes"] >= rows["none"]["weight_bytes"] > 0 and rows["none"]["ideal_ms"] > 0
    assert "--device-memory" not in rows["none"]["command"] and "--device-memory 12GiB" in rows["12GiB"]["command"]
    capped = rows["12GiB"]
    assert capped["status"] == "failed" and capped["cap_bytes"] == 12 << 30
    assert capped["reason"].startswith("magi bench: backend cpu cannot cap device memory")
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cap_grid.py"), *argv], capture_output=True,
                           text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0 and "2 rows, 1 ok, 0 remaining" in again.stdout
    redone = json.loads(out.read_text())
    assert redone["rows"] == doc["rows"] and len(redone["commands"]) == 2


def test_cap_grid_ideal_floor_order_and_time_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = _cap_grid_module()
    rows = grid.plan_rows(["llama8b", "flux"], ["12GiB", "none"], ["magi_r0", "accelerate"], grid.TOKENS, True)
    assert [r["key"] for r in rows[:3]] == ["llama8b/2048/none/resident", "llama8b/2048/12GiB/magi_r0",
                                           "llama8b/2048/12GiB/accelerate"] and len(rows) == 10
    gib = 1 << 30
    doc = {"rows": [
        {"model": "m", "tokens": 1, "cap": "none", "system": "resident", "status": "ok", "step_ms": 100.0,
         "streamed_bytes": 0, "weight_bytes": 20 * gib, "h2d_GBps": 50.0,
         "device_memory": {"seen": {"total": 140 * gib}}},
        {"model": "m", "tokens": 1, "cap": "12GiB", "cap_bytes": 12 * gib, "system": "magi_r0", "status": "ok",
         "step_ms": 500.0, "streamed_bytes": 20 * gib, "weight_bytes": 20 * gib, "h2d_GBps": 50.0},
        {"model": "m", "tokens": 1, "cap": "12GiB", "cap_bytes": 12 * gib, "system": "magi_default",
         "status": "failed", "reason": "OutOfMemoryError"},
    ]}
    grid.derive(doc)
    resident, r0, failed = doc["rows"]
    link_ms = 20 * gib / 50e9 * 1e3
    assert resident["ideal_ms"] == 100.0 and resident["card_bytes"] == 140 * gib and resident["card_floor_ms"] == 100.0
    assert r0["compute_ms"] == 100.0 and r0["ideal_link_ms"] == pytest.approx(link_ms)
    assert r0["ideal_ms"] == pytest.approx(link_ms) and r0["ratio_to_ideal"] == pytest.approx(500.0 / link_ms)
    assert r0["card_floor_ms"] == pytest.approx(max(100.0, 8 * gib / 50e9 * 1e3))
    assert "ideal_ms" not in failed and failed["card_floor_ms"] == r0["card_floor_ms"]
    args = grid.argparse.Namespace(steps=3, warmup=1, dtype="bf16", layers=None, quick=False)
    cmd = grid.bench_command({"model": "flux", "tokens": 4096, "cap": "16GiB", "system": "accelerate"}, args,
                             tmp_path / "p.json")
    assert cmd[1:6] == ["-m", "magi_core", "bench", "--models", "flux"]
    assert {"--accelerate-device-map", "--no-host-timing", "--no-overhead-probe"} <= set(cmd)
    assert cmd[cmd.index("--device-memory") + 1] == "16GiB" and cmd[cmd.index("--steps") + 1] == "3"
    assert grid._tokens("flux=8192") == {**grid.TOKENS, "flux": 8192}
    r1 = grid.bench_command({"model": "flux", "tokens": 4096, "cap": "none", "system": "magi_r1"}, args,
                            tmp_path / "p.json")
    assert r1[r1.index("--ratios") + 1] == "1" and "--device-memory" not in r1  # opt-in: not a default system
    assert "magi_r1" not in grid.SYSTEMS
    # a time budget that fits no row: nothing runs, every row is left for the next call
    calls: list[str] = []
    monkeypatch.setattr(grid, "run_row", lambda row, *a: calls.append(row["key"]) or {})
    ns = grid.argparse.Namespace(models=["flux"], caps=["none"], systems=["magi_r0"], tokens=grid.TOKENS,
                                 no_resident=True, resume=None, out=tmp_path / "g.json", retry_failed=False,
                                 rerun=None, time_budget=10.0, worker_timeout=60.0, steps=3, dtype="bf16")
    left = grid.run_grid(ns)
    assert calls == [] and left["remaining"] == ["flux/4096/none/magi_r0"] and not left["complete"]


def test_cap_grid_resume_runs_again_only_the_rows_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming keeps the rows done; ``--rerun`` patterns (and ``--retry-failed``) name the ones to run again, and
    the new result replaces the old row rather than adding a second one."""
    grid = _cap_grid_module()
    keys = ["flux/4096/none/magi_r0", "flux/4096/none/magi_default", "flux/4096/16GiB/magi_default"]
    old = {"rows": [{"key": k, "model": "flux", "tokens": 4096, "cap": k.split("/")[2], "system": k.split("/")[3],
                     "status": "ok", "step_ms": 1.0, "wall_s": 1.0} for k in keys],
           "commands": ["first"], "date": "2026-12-03"}
    old["rows"][0]["status"] = "failed"
    (tmp_path / "old.json").write_text(json.dumps(old))
    calls: list[str] = []
    monkeypatch.setattr(grid, "run_row", lambda row, *a: calls.append(row["key"]) or {
        **row, "status": "ok", "step_ms": 2.0, "wall_s": 1.0})

    def run(**kw: object) -> dict:
        ns = grid.argparse.Namespace(models=["flux"], caps=["16GiB", "none"], systems=["magi_r0", "magi_default"],
                                     tokens=grid.TOKENS, no_resident=True, resume=tmp_path / "old.json",
                                     out=tmp_path / "new.json", time_budget=0.0, worker_timeout=60.0, steps=3,
                                     dtype="bf16", **{"retry_failed": False, "rerun": None, **kw})
        return grid.run_grid(ns)

    doc = run(rerun="*/16GiB/magi_default")
    assert sorted(calls) == ["flux/4096/16GiB/magi_default", "flux/4096/16GiB/magi_r0"]
    rows = {r["key"]: r for r in doc["rows"]}
    assert len(doc["rows"]) == len(rows) == 4 and rows["flux/4096/16GiB/magi_default"]["step_ms"] == 2.0
    assert rows["flux/4096/none/magi_r0"]["status"] == "failed" and doc["commands"][0] == "first"
    calls.clear()
    run(retry_failed=True)
    assert sorted(calls) == ["flux/4096/16GiB/magi_r0", "flux/4096/none/magi_r0"]


def test_cap_grid_call_narrowed_to_one_model_keeps_the_whole_grid(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A call resumed with ``--models flux`` runs only flux rows, but the document still holds llama8b (models,
    caps, systems, token counts) and lists its rows not yet run as remaining: the plot and the next call see
    the whole grid."""
    grid = _cap_grid_module()
    old = {"models": ["llama8b", "flux"], "caps": ["12GiB", "none"], "systems": ["magi_r0", "diffusers"],
           "tokens": {"llama8b": 2048, "flux": 4096}, "commands": ["first"], "date": "2026-12-03",
           "rows": [{"key": "llama8b/2048/none/magi_r0", "model": "llama8b", "tokens": 2048, "cap": "none",
                     "system": "magi_r0", "status": "ok", "step_ms": 1.0, "wall_s": 1.0}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    calls: list[str] = []
    monkeypatch.setattr(grid, "run_row", lambda row, *a: calls.append(row["key"]) or {
        **row, "status": "ok", "step_ms": 2.0, "wall_s": 1.0, "date": "2026-12-04T10:00:00+00:00"})
    ns = grid.argparse.Namespace(models=["flux"], caps=["none"], systems=["magi_r0"], tokens=dict(grid.TOKENS),
                                 no_resident=True, resume=tmp_path / "old.json", out=tmp_path / "new.json",
                                 time_budget=0.0, worker_timeout=60.0, steps=3, dtype="bf16", retry_failed=False,
                                 rerun=None)
    doc = grid.run_grid(ns)
    assert calls == ["flux/4096/none/magi_r0"]
    assert doc["models"] == ["llama8b", "flux"] and doc["caps"] == ["12GiB", "none"]
    assert doc["systems"] == ["magi_r0", "diffusers"] and doc["tokens"] == {"llama8b": 2048, "flux": 4096}
    assert sorted(doc["remaining"]) == sorted(["llama8b/2048/12GiB/magi_r0", "llama8b/2048/12GiB/diffusers",
                                               "llama8b/2048/none/diffusers", "flux/4096/12GiB/magi_r0",
                                               "flux/4096/12GiB/diffusers", "flux/4096/none/diffusers"])
    assert not doc["complete"] and doc["dates"] == ["2026-12-03", "2026-12-04"]
    assert json.loads((tmp_path / "new.json").read_text())["remaining"] == doc["remaining"]


def test_cap_grid_report_section_and_plot(tmp_path: Path) -> None:
    """The benchmarks page gets a table per model (a column per card size); the plot a panel per model."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from script_report import is_cap_grid_doc, scripts_markdown

    grid = _cap_grid_module()
    gib = 1 << 30
    doc = {"kind": "cap-grid", "models": ["flux"], "caps": ["12GiB", "none"], "systems": ["magi_r0"],
           "tokens": {"flux": 4096}, "steps": 3, "dtype": "bf16", "commands": ["python benchmarks/cap_grid.py"],
           "remaining": [], "hardware": "H", "date": "2026-12-03", "rows": [
               {"model": "flux", "tokens": 4096, "cap": "none", "system": "magi_r0", "status": "ok", "step_ms": 450.0,
                "streamed_bytes": 24 * gib, "weight_bytes": 24 * gib, "h2d_GBps": 55.0, "peak_reserved_bytes": gib,
                "device_memory": {"seen": {"total": 140 * gib}}},
               {"model": "flux", "tokens": 4096, "cap": "12GiB", "cap_bytes": 12 * gib, "system": "magi_r0",
                "status": "failed", "reason": "OutOfMemoryError: | out of memory"}]}
    grid.derive(doc)
    assert is_cap_grid_doc(doc)
    text = "\n".join(scripts_markdown([doc]))
    assert "| system | 12GiB | none |" in text and "| magi_r0 | failed: OutOfMemoryError: / out of memory |" in text
    assert "450.0 (0.96x; 1.074 GB)" in text and "median of 3 steps" in text  # no per-step times: the document's
    doc["rows"][0]["steps_ms"] = [450.0] * 10
    doc["rows"].append({**doc["rows"][0], "cap": "12GiB", "steps_ms": [450.0] * 3})  # a row of an earlier call
    assert "median of 3-10 steps (per row in the JSON)" in "\n".join(scripts_markdown([doc]))
    doc["rows"].pop()
    assert "cap-grid-2026-12-03" not in text  # no docs directory: no plot named
    (tmp_path / "cap-grid-2026-12-03-h200.png").write_bytes(b"png")
    (tmp_path / "cap-grid-2026-12-02-h200.png").write_bytes(b"png")
    text = "\n".join(scripts_markdown([doc], tmp_path))
    assert "](cap-grid-2026-12-03-h200.png)" in text and "2026-12-02" not in text
    pytest.importorskip("matplotlib")
    assert grid.plot(doc, tmp_path / "grid.png") == tmp_path / "grid.png" and (tmp_path / "grid.png").stat().st_size


def test_plan_probe_interleaved_times_every_variant_alive_at_once(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    argv = ["--model", "mlp", "--layers", "2", "--tokens", "8", "--ratio", "default", "--steps", "3",
            "--variants", "resident,HEURISTIC,HEURISTIC@1", "--interleave", "--trace", str(tmp_path / "traces"),
            "--out", str(out)]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_probe.py"), *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["resident", "HEURISTIC", "HEURISTIC@1"]
    # one gzipped Chrome trace per variant, named so that any file system keeps it ('@' becomes '_')
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == ["HEURISTIC.json.gz", "HEURISTIC_1.json.gz", "resident.json.gz"]
    with gzip.open(tmp_path / "traces" / "HEURISTIC.json.gz") as f:
        assert any(e.get("cat") == "cpu_op" for e in json.load(f)["traceEvents"])  # the step's operators
    for r in runs.values():
        assert len(r["steps_ms"]) == 3 and r["step_ms"] > 0 and 0 < r["host_ms"]
    assert "units" not in runs["resident"]  # the whole model compiled, not offloaded
    assert runs["HEURISTIC@1"]["units"] == 1 and runs["HEURISTIC"]["units"] == 2  # one unit per block
