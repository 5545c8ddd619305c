"""``magi bench --generate`` on the cpu backend: the tiny llama8b preset (4 layers, hidden 64), a few new tokens.

One run with every system in one process (``--in-process``) checks each row's figures and that magi-core's greedy
tokens are the resident model's; one run through the default path (a process per system, merged) checks the merge;
the derived figures (the decode ideal, tokens compared) and the flag checks are tested on their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from magi_core.bench import add_arguments, main
from magi_core.bench.generate.derive import derive
from magi_core.bench.generate.options import GenerateOptions, child_arguments, generate_specs, options_from_args
from magi_core.bench.generate.report import generate_markdown, text_summary
from magi_core.errors import ConfigError
from magi_core.plugin.manager import get_backend

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
NEW = 5
#: The compiled resident model on the host through aot_eager (Inductor would need a C++ toolchain).
RESIDENT = ["--compile-on-cpu", "--compile-backend", "aot_eager"]
OK_FIELDS = ("prefill_ms", "decode_ms_per_token", "decode_steps_ms", "decode_tokens_per_s", "e2e_tokens_per_s",
             "tokens", "peak_alloc_bytes", "peak_reserved_bytes", "compiles", "recompiles_timed",
             "streamed_bytes_per_token", "resident_bytes", "h2d_GBps", "ideal_link_ms_per_token", "ideal_ms_per_token",
             "x_ideal", "setup_s", "warmup_s", "weight_bytes")
MAGI_FIELDS = ("units", "graphs", "predicted_peak_bytes", "host_us_per_unit", "decode_host_ms",
               "measured_streamed_bytes_per_token", "tokens_match_resident", "compiles_timed")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _run(argv: list[str], out: Path) -> dict[str, Any]:
    if get_backend().is_accelerator:
        pytest.skip("the tiny generate runs are for the cpu backend")
    assert main(_parse(["--generate", "--prompt-tokens", "8", "--new-tokens", str(NEW), *argv, "--out",
                        str(out)])) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default systems (compiled resident, magi-core at ratio 0, half the weights and ratio 0.9, accelerate)."""
    return _run(["--in-process", *RESIDENT], tmp_path_factory.mktemp("gen") / "g.json")


def _rows(doc: dict[str, Any], system: str) -> list[dict[str, Any]]:
    return [r for r in doc["rows"] if r["system"] == system]


def test_every_row_has_its_figures(in_process: dict[str, Any]) -> None:
    doc = in_process
    env = doc["env"]
    assert doc["kind"] == "generate" and env["hardware"] and env["date"].endswith("+00:00")
    assert env["torch"] and env["python"] and env["transformers"] and env["meaningful"] is False
    command = doc["commands"][0]
    assert command.startswith("python -m magi_core bench --generate ") and "--in-process" in command
    assert [r["label"] for r in doc["rows"]] == ["resident_compiled", "magi HEURISTIC r=0",
                                                 "magi HEURISTIC budget=0.5W", "magi HEURISTIC r=0.9", "accelerate"]
    accelerate = _rows(doc, "accelerate")[0]
    assert accelerate["status"] == "skipped" and "accelerator" in accelerate["reason"]
    ok = [r for r in doc["rows"] if r["system"] != "accelerate"]
    for r in ok:
        assert r["status"] == "ok", r.get("reason")
        missing = [k for k in OK_FIELDS + (MAGI_FIELDS if r["system"] == "magi" else ()) if r.get(k) is None]
        assert not missing, (r["label"], missing)
        assert (r["prompt_tokens"], r["new_tokens"], r["batch"], r["cache"]) == (8, NEW, 1, "dynamic")
        assert len(r["decode_steps_ms"]) == NEW - 1 and len(r["tokens"]) == 1 and len(r["tokens"][0]) == NEW
        assert r["decode_ms_per_token"] == pytest.approx(statistics.median(r["decode_steps_ms"]), abs=1e-3)
        assert r["decode_tokens_per_s"] == pytest.approx(1e3 / r["decode_ms_per_token"])
        assert r["x_ideal"] == pytest.approx(r["decode_ms_per_token"] / r["ideal_ms_per_token"])
        assert r["recompiles_timed"] == 0 and r["peak_reserved_bytes"] >= r["peak_alloc_bytes"] >= 0
    assert _rows(doc, "resident_compiled")[0]["compiles"] >= 2  # prefill and decode graphs, by Dynamo


def test_magi_greedy_tokens_are_the_resident_models(in_process: dict[str, Any]) -> None:
    resident = _rows(in_process, "resident_compiled")[0]
    magi = _rows(in_process, "magi")
    assert len(magi) == 3
    for r in magi:
        assert r["tokens"] == resident["tokens"], r["label"]
        assert r["tokens_match_resident"] is True and r["tokens_compared"] == NEW and r["first_mismatch"] is None
        assert r["tokens_reference"] == "resident_compiled"
        # a DynamicCache compiles the prefill, the first decode step and a decode graph dynamic in the KV length
        assert r["compiles"] == 3 and r["compiles_timed"] == 0
        assert r["host_us_per_unit"] > 0 and r["units"] >= 4


def test_decode_ideal_is_the_decode_graphs_streamed_bytes_over_the_link(in_process: dict[str, Any]) -> None:
    resident_ms = _rows(in_process, "resident_compiled")[0]["decode_ms_per_token"]
    by_label = {r["label"]: r for r in _rows(in_process, "magi")}
    for r in by_label.values():
        decode = r["graphs"][r["decode_graph"]]
        assert decode["steps"] == max(g["steps"] for g in r["graphs"])  # the graph that ran the decode steps
        assert r["streamed_bytes_per_token"] == decode["streamed_bytes_per_step"]
        assert r["resident_bytes"] == decode["resident_bytes"]
        link = r["streamed_bytes_per_token"] / (r["h2d_GBps"] * 1e9) * 1e3
        assert r["ideal_link_ms_per_token"] == pytest.approx(link)
        assert r["ideal_ms_per_token"] == pytest.approx(max(link, resident_ms))
    r0, r09 = by_label["magi HEURISTIC r=0"], by_label["magi HEURISTIC r=0.9"]
    budget = by_label["magi HEURISTIC budget=0.5W"]
    assert r0["resident_bytes"] == 0 and r0["streamed_bytes_per_token"] >= r0["weight_bytes"]
    assert r0["measured_streamed_bytes_per_token"] == r0["streamed_bytes_per_token"]
    assert r09["resident_bytes"] >= 0.75 * r09["weight_bytes"] > r09["streamed_bytes_per_token"]
    assert budget["budget_bytes"] == budget["weight_bytes"] // 2 == budget["device_budget_bytes"]
    assert 0 < budget["resident_bytes"] < budget["budget_bytes"] and budget["predicted_peak_bytes"] <= (
        budget["budget_bytes"])


def test_resident_weights_are_not_copied_again_each_decode_step(in_process: dict[str, Any]) -> None:
    r09 = next(r for r in _rows(in_process, "magi") if r["ratio"] == 0.9)
    assert r09["measured_streamed_bytes_per_token"] == r09["streamed_bytes_per_token"]


def test_the_table_renders_every_row(in_process: dict[str, Any]) -> None:
    md = "\n".join(generate_markdown(in_process))
    assert md.startswith("### llama8b, 8-token prompt, 5 new tokens, batch 1, dynamic cache")
    assert "| system | ratio / budget | prefill ms | ms/token | tokens/s | ideal ms/token | x ideal |" in md
    for r in in_process["rows"]:
        assert f"| {r['label']} |" in md
    assert "| yes (5) |" in md and "skipped: accelerate's device_map" in md
    assert "magi HEURISTIC r=0.9" in text_summary(in_process)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("script_report", ROOT / "benchmarks" / "script_report.py")
        assert spec is not None and spec.loader is not None
        script_report = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script_report)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert script_report.is_script_doc(in_process)
    page = "\n".join(script_report.scripts_markdown([in_process]))
    assert "## Generate: prefill and decode (`magi bench --generate`)" in page and md in page


def test_one_process_per_system_merged_into_one_document(tmp_path: Path) -> None:
    doc = _run(["--systems", "resident_eager,magi", "--ratios", "0", "--budgets", ""], tmp_path / "g.json")
    assert doc["processes"] == "one process per system" and len(doc["rows"]) == 2
    assert "--in-process" not in doc["commands"][0] and doc["env"]["hardware"]
    resident, magi = doc["rows"]
    for r, selected in ((resident, "--systems resident_eager"), (magi, "--systems magi --policies HEURISTIC "
                                                                       "--ratios 0 --budgets ''")):
        assert r["status"] == "ok", r.get("reason")
        assert "--in-process" in r["command"] and selected in r["command"] and r["wall_s"] > 0
    assert magi["tokens"] == resident["tokens"] and magi["tokens_match_resident"] is True
    assert magi["tokens_reference"] == "resident_eager" and magi["compiles"] == 3


def test_each_process_selects_exactly_its_system() -> None:
    options = GenerateOptions(ratios=(0.0, 0.9), budgets=(0.5,), prompt_tokens=64, llama_layers=2)
    specs = generate_specs(options)
    assert [s.label for s in specs] == ["resident_compiled", "magi HEURISTIC r=0", "magi HEURISTIC budget=0.5W",
                                        "magi HEURISTIC r=0.9", "accelerate"]
    for spec in specs:
        argv = child_arguments(options, spec, Path("part.json"))
        child = options_from_args(_parse(argv[1:]))
        assert generate_specs(child) == [spec] and child.in_process
        assert (child.prompt_tokens, child.llama_layers, child.new_tokens) == (64, 2, 32)


def _row(**kw: Any) -> dict[str, Any]:
    return {"workload": "llama8b", "status": "ok", "batch": 1, "tokens": [[1, 2, 3, 4]], "h2d_GBps": 50.0, **kw}


def test_derived_ideal_and_tokens() -> None:
    doc = {"rows": [
        _row(system="resident_compiled", label="resident_compiled", decode_ms_per_token=7.0,
             streamed_bytes_per_token=0),
        _row(system="magi", label="magi r=0", decode_ms_per_token=101.0, streamed_bytes_per_token=5 * 10**9),
        _row(system="magi", label="magi r=0.9", decode_ms_per_token=8.0, streamed_bytes_per_token=10**8,
             tokens=[[1, 2, 9, 4]]),
        _row(system="accelerate", label="accelerate", decode_ms_per_token=404.0, streamed_bytes_per_token=8 * 10**9,
             tokens=[[1, 2]]),
    ]}
    resident, r0, r09, accel = derive(doc)["rows"]
    assert r0["ideal_link_ms_per_token"] == pytest.approx(100.0) and r0["ideal_ms_per_token"] == pytest.approx(100.0)
    assert r0["x_ideal"] == pytest.approx(1.01) and r0["x_faster_than_accelerate"] == pytest.approx(4.0)
    assert r09["ideal_link_ms_per_token"] == pytest.approx(2.0) and r09["ideal_ms_per_token"] == 7.0
    assert r09["tokens_match_resident"] is False and r09["first_mismatch"] == 2 and r09["tokens_compared"] == 4
    assert accel["tokens_match_resident"] is True and accel["tokens_compared"] == 2  # what it produced in time
    assert resident["x_ideal"] == 1.0 and r0["tokens_match_resident"] is True
    again = json.loads(json.dumps(doc))
    assert derive(again) == doc  # derived afresh from the measured fields: the same


@pytest.mark.parametrize(("argv", "says"), [
    (["--generate", "--tokens", "16"], "--tokens"),
    (["--generate", "--systems", "diffusers"], "cannot run --generate"),
    (["--generate", "--models", "wan14b"], "does not generate"),
    (["--generate", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--generate", "--batch", "0"], "--batch must be >= 1"),
    (["--generate", "--ratios", "", "--budgets", ""], "needs a ratio or a budget"),
    (["--generate", "--accelerate-device-map"], "--accelerate-device-map"),
    (["--new-tokens", "8"], "add --generate"),
    (["--cache", "static", "--models", "mlp"], "add --generate"),
])
def test_flags_that_do_not_go_together_are_a_clear_error(argv: list[str], says: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("magi bench: ") and says in err
    with pytest.raises(ConfigError):
        GenerateOptions(cache="paged")


def test_each_token_waits_for_the_compute_stream_not_the_whole_device() -> None:
    """The clock waits once per new token for the stream that computed the logits; the whole device (a copy stream
    prefetching the next step's weights included) is synchronised only before and after the timed ``generate``."""
    import torch
    import transformers

    from magi_core.bench.generate.timing import timed_generate

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    calls = {"device": 0, "stream": 0}

    def count(kind: str) -> Any:
        return lambda: calls.__setitem__(kind, calls[kind] + 1)

    ids = torch.randint(1, 64, (1, 4))
    t = timed_generate(model, ids, torch.ones_like(ids), NEW, "dynamic", count("device"),
                       step_synchronize=count("stream"))
    assert calls == {"device": 2, "stream": NEW}
    assert len(t.decode_ms) == NEW - 1
