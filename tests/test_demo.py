"""``magi demo`` on the active backend with a tiny model: every run listed, errors small, nothing left behind."""

from __future__ import annotations

import argparse

import torch

from magi_core import demo
from magi_core.cpu_backend import registered_ranges


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


def test_inductor_rows_compare_like_with_like():
    # bf16 with Inductor units: the reference is Inductor-compiled too, both rounding where the model casts
    args = parse("--layers", "4", "--hidden", "64", "--heads", "2", "--tokens", "16", "--steps", "1", "--dtype", "bf16",
                 "--unit-compiler", "inductor", "--no-progress", "--policies", "BASE", "--ratios", "0")
    rows = demo.run_demo(args, emit=lambda s: None)
    assert [(r.name, r.compiler) for r in rows] == [("resident", "inductor"), ("BASE r=0", "inductor")]
    assert rows[1].rel_err <= 1e-3, "only fusion boundaries differ: the offloaded units should round like the graph"
    assert "inductor" in demo.format_table(rows).splitlines()[2]
    torch._dynamo.reset()
