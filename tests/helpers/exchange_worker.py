"""One rank of the weight-exchange tests (torchrun, gloo, CPU backend): every scenario in one launch.

Scenarios (in order, all ranks together): ``same`` (identical weights: every batch exchanged, outputs equal
to the plain per-rank path bit for bit, half the host bytes per rank), ``differ`` (rank-specific weights in
one block, MAGI_EP_SIZE hint: those batches copied whole, each rank equals its own model), ``rebind`` (one rank
rebinds a weight's ``.data`` after planning: agreed again, each rank equals its own model), ``whole`` (ratio 1,
one rank's card too small for the whole graph: every rank splits alike and exchanges), ``disagree``
(different plans: an error on every rank, no hang), ``dead`` (a rank leaves: the other gets an error within
the exchange timeout). Writes ``rank<r>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import magi_core
import magi_core.compile.backend as compile_backend
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.execute.transfer.exchange import ExchangeTransfer

SPEC = TransformerSpec(layers=3, hidden=64, heads=2)


def run(model: torch.nn.Module, x: torch.Tensor, cfg: magi_core.OffloadConfig, steps: int = 5) -> tuple[Any, Any]:
    """Offload ``model``, run ``steps`` calls, return (last output, transfer), released."""
    magi_core.offload(model, cfg)
    try:
        with torch.no_grad():
            for _ in range(steps):
                out = model(x)
        t = magi_core.handle(model).runtime.executor.transfer
        stats = {"type": type(t).__name__, "exchanges": getattr(t, "exchanges", 0),
                 "bytes_copied": t.bytes_copied, "bytes_gathered": getattr(t, "bytes_gathered", 0),
                 "streamed_per_step": magi_core.handle(model).runtime.executor.actions.streamed_bytes,
                 "units": magi_core.handle(model).runtime.executor.n_units}
        return out.clone(), stats
    finally:
        magi_core.release(model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec: dict[str, Any] = {"rank": rank}
    x = example_input(SPEC, tokens=6)
    base = magi_core.OffloadConfig(unit_compiler="eager", policy="BASE", bandwidth_probe_bytes=1 << 20)

    # same weights: exchanged, equal to the plain path bit for bit
    torch._dynamo.reset()
    ref = build_transformer(SPEC)
    with torch.no_grad():
        expect = ref(x)
    plain, plain_stats = run(build_transformer(SPEC), x, base.replace(transfer="unit"))
    torch._dynamo.reset()
    shared, stats = run(build_transformer(SPEC), x, base.replace(exchange="on"))
    rec["same"] = {"equal_plain": bool(torch.equal(shared, plain)), "err": float((shared - expect).abs().max()),
                   **stats, "plain_bytes_copied": plain_stats["bytes_copied"]}

    # rank-specific weights in one block: those batches are copied whole
    torch._dynamo.reset()
    own = build_transformer(SPEC)
    if rank == 1:
        with torch.no_grad():
            for p in own.blocks[1].parameters():  # type: ignore[index]
                p.mul_(-0.5)
    with torch.no_grad():
        own_expect = own(x)
    os.environ["MAGI_EP_SIZE"] = "2"  # the hint: these ranks hold different weights
    try:
        out, stats = run(own, x, base.replace(exchange="on"))
    finally:
        del os.environ["MAGI_EP_SIZE"]
    rec["differ"] = {"err": float((out - own_expect).abs().max()), **stats}

    # a weight rebound after planning on one rank (param.data = new, outside the shared file): the step agreement
    # sees the new data and that batch is copied whole on that rank; every rank still equals its own model
    torch._dynamo.reset()
    model, mine = build_transformer(SPEC), build_transformer(SPEC)
    magi_core.offload(model, base.replace(exchange="on"))
    try:
        with torch.no_grad():
            for _ in range(4):
                model(x)
            if rank == 1:
                for m in (model, mine):
                    w = m.blocks[1].mlp.up.weight  # type: ignore[index]
                    w.data = w.data * -0.5
            expect_mine = mine(x)
            outs = [model(x) for _ in range(3)]
        rec["rebind"] = {"err": max(float((o - expect_mine).abs().max()) for o in outs)}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        rec["rebind"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        magi_core.release(model)

    # ratio 1 where one rank's card could not hold the graph whole (rank 0's check says no, as a smaller card's
    # would): the ranks split alike, so their units and plans match and they exchange as usual
    torch._dynamo.reset()
    fits = compile_backend._whole_graph_fits
    if rank == 0:
        compile_backend._whole_graph_fits = lambda *a, **k: False  # type: ignore[assignment]
    try:
        whole = build_transformer(SPEC)
        with torch.no_grad():
            whole_expect = whole(x)
        out, stats = run(whole, x, base.replace(exchange="on", gpu_resident_weight_ratio=1.0))
        rec["whole"] = {"err": float((out - whole_expect).abs().max()), **stats}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        rec["whole"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        compile_backend._whole_graph_fits = fits  # type: ignore[assignment]

    # different plans: an error on every rank, not a hang
    torch._dynamo.reset()
    try:
        run(build_transformer(SPEC), x, base.replace(exchange="on", lookahead=1 + rank))
        rec["disagree"] = "no error"
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        rec["disagree"] = f"{type(exc).__name__}: {exc}"

    # a rank that leaves: the other's next step fails within the exchange timeout
    torch._dynamo.reset()
    model = build_transformer(SPEC)
    magi_core.offload(model, base.replace(exchange="on"))
    with torch.no_grad():
        for _ in range(4):
            model(x)
    assert isinstance(magi_core.handle(model).runtime.executor.transfer, ExchangeTransfer)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rec))
    if rank == 1:
        magi_core.release(model)
        os._exit(0)  # leaves without a word, as a crashed rank would
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            model(x)
        rec["dead"] = "no error"
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        rec["dead"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["dead_after_s"] = time.monotonic() - t0
    magi_core.release(model)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rec))
    os._exit(0)  # the group cannot be torn down cleanly without the other rank


if __name__ == "__main__":
    main()
