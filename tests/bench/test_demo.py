"""``magi demo`` on the active backend with a tiny model: every run listed, errors small, nothing left behind."""

from __future__ import annotations

import argparse

import torch

from magi_core.bench import demo
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.plugin.cpu import registered_ranges


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_demo_runs_every_policy_and_ratio(capsys):
    before = registered_ranges()
    args = parse("--layers", "2", "--hidden", "32", "--heads", "2", "--tokens", "8", "--steps", "1",
                 "--unit-compiler", "eager", "--no-progress", "--ratios", "0,1")
    status = demo.main(args)
    out = capsys.readouterr().out
    assert status == 0, out
    for policy in demo.POLICIES:
        assert f"{policy} r=0 " in out and f"{policy} r=1 " in out
    assert "resident" in out
    assert "compiler" in out and " eager " in out
    assert registered_ranges() == before
    torch._dynamo.reset()


def test_rows_report_streamed_bytes_and_errors():
    args = parse("--layers", "2", "--hidden", "32", "--heads", "2", "--tokens", "8", "--steps", "1",
                 "--unit-compiler", "eager", "--no-progress", "--policies", "BASE", "--ratios", "0,0.5,1")
    rows = demo.run_demo(args, emit=lambda s: None)
    assert [r.name for r in rows] == ["resident", "BASE r=0", "BASE r=0.5", "BASE r=1"]
    total = rows[1].streamed_bytes
    assert total > 0 and 0 < rows[2].streamed_bytes < total and rows[3].streamed_bytes == 0
    assert all(r.rel_err <= 1e-5 for r in rows)
    table = demo.format_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    torch._dynamo.reset()


def test_inductor_units_in_bf16_pass_the_float32_gate():
    # bf16 with Inductor units: errors are judged against float32, not against another bf16 rounding
    args = parse("--layers", "4", "--hidden", "64", "--heads", "2", "--tokens", "16", "--steps", "1", "--dtype", "bf16",
                 "--unit-compiler", "inductor", "--no-progress", "--policies", "BASE", "--ratios", "0")
    rows, refs = demo.run_demo_with_references(args, emit=lambda s: None)
    assert [(r.name, r.compiler) for r in rows] == [("resident", "inductor"), ("BASE r=0", "inductor")]
    assert refs.fp32 is not None and refs.eager_err_fp32 is not None and refs.eager_err_fp32 > 0
    assert all(r.err_fp32 is not None and r.err_fp32 > 0 for r in rows)
    ok, why = demo.check(rows, refs, torch.bfloat16)
    assert ok, why
    assert "inductor" in demo.format_table(rows).splitlines()[2]
    torch._dynamo.reset()


def test_blockwise_eager_reference_equals_the_whole_model():
    spec = TransformerSpec(layers=3, hidden=32, heads=2, dtype=torch.bfloat16)
    model = build_transformer(spec)
    x = example_input(spec, tokens=8)
    with torch.no_grad():
        whole = model(x)
        refs = demo.references(model, x, torch.device("cpu"))
    assert torch.equal(refs.eager, whole)  # same kernels, one block's weights at a time
    assert refs.fp32 is not None and refs.fp32.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the model itself is not cast


def _row(name: str, rel: float, err32: float | None) -> demo.Row:
    return demo.Row(name, 1.0, 0, 0, rel, "inductor", err_fp32=err32)


def test_gate_fails_an_offloaded_run_less_accurate_than_eager_in_its_dtype():
    refs = demo.References(eager=torch.ones(4), fp32=torch.ones(4) * 1.01)  # eager is ~9.9e-3 from float32
    bound = demo.LOW_PRECISION_SLACK * refs.eager_err_fp32
    good = [_row("resident", 0.0, 5e-3), _row("BASE r=0", 2e-2, bound * 0.99)]
    assert demo.check(good, refs, torch.bfloat16)[0]
    bad = [_row("resident", 0.0, 5e-3), _row("BASE r=0", 1e-3, bound * 1.01)]
    ok, why = demo.check(bad, refs, torch.bfloat16)
    assert not ok and "FAILED" not in why and "float32" in why
    # float32 runs are held to the resident run itself
    assert demo.check([_row("BASE r=0", 2e-5, None)], demo.References(torch.ones(1), None), torch.float32)[0] is False
    assert demo.check([_row("BASE r=0", 1e-6, None)], demo.References(torch.ones(1), None), torch.float32)[0] is True


def test_resident_run_that_does_not_fit_is_skipped_and_errors_use_the_eager_reference(monkeypatch, capsys):
    # the point of offloading: a model larger than the device; the demo must still run and judge its errors
    calls = {"n": 0}
    real_build = demo.build_transformer

    def build(spec, seed=0):
        calls["n"] += 1
        if calls["n"] == 2:  # the first build is the host model; the second is the resident copy
            raise torch.OutOfMemoryError("device out of memory (test)")
        return real_build(spec, seed)

    monkeypatch.setattr(demo, "build_transformer", build)
    args = parse("--layers", "2", "--hidden", "32", "--heads", "2", "--tokens", "8", "--steps", "1", "--dtype", "bf16",
                 "--unit-compiler", "eager", "--no-progress", "--policies", "BASE", "--ratios", "0")
    status = demo.main(args)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "skipped: does not fit in device memory" in out and "PASSED" in out
    row = [line for line in out.splitlines() if line.startswith("BASE r=0")][0]
    assert "0.00e+00" in row  # eager units against the block-wise eager reference: identical
    torch._dynamo.reset()


def test_timings_are_printed_only_on_an_accelerator():
    rows = [_row("resident", 0.0, None), _row("BASE r=0", 1e-7, None)]
    on_host = demo.table_columns(rows, is_accelerator=False)
    on_device = demo.table_columns(rows, is_accelerator=True)
    for column in ("step ms", "planned ms", "peak dev MB", "copy GB/s"):
        assert column not in on_host and column in on_device
    assert "correct" in on_host and "correct" in on_device
    refs = demo.References(eager=torch.ones(4), fp32=None)
    ok, _ = demo.check(rows, refs, torch.float32)
    assert ok and [r.correct for r in rows] == [None, True]
    assert demo.format_table(rows, on_host).splitlines()[-1].split()[-1] == "yes"
