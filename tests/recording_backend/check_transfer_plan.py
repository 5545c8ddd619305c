"""Run under ``MAGI_BACKEND=recording`` (this directory on PYTHONPATH): check the executor's transfers against its plan.

Prints one JSON object per line: the configuration and the facts the test asserts.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
from magi_recording_backend import device

from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.compile.handle import OffloadHandle
from magi_core.plugin.manager import get_backend

sys.path.insert(0, sys.argv[1])  # the tests directory
from helpers.models import TableStack, TiedLM  # noqa: E402


def steady_facts(f, args, ex, base0: int, ref: torch.Tensor) -> dict:
    """Run one steady-state step with a fresh log: its output against eager, its copies against the action lists."""
    acts = ex.actions
    device.LOG.clear()
    device.reset_peak_memory_stats()
    out = f(*args)
    log = list(device.LOG)
    launches = 0
    copies = []  # (units launched before the copy, nbytes, src ptr, stream, non_blocking)
    for e in log:
        if e[0] == "range_push" and e[1].startswith("magi.unit"):
            launches += 1
        elif e[0] == "copy":
            copies.append((launches, e[2], e[1], e[3], e[4]))
    nbytes = {w.input_index: w.nbytes for u in ex.units for w in u.weights}
    expected = []
    carried = set(acts.carry)
    for b in acts.start:
        if b not in carried:
            expected += [(0, nbytes[w]) for w in acts.batches[b]]
    for u, ids in enumerate(acts.issue):
        for b in ids:
            expected += [(u, nbytes[w]) for w in acts.batches[b]]
        if u == acts.carry_unit:  # the next step's copies, after this unit's own
            expected += [(u, nbytes[w]) for b in acts.carry for w in acts.batches[b]]
    recorded_events = device.EVENT_STREAM
    copy_stream = ex.transfer.copy_stream.sid
    waits = [e for e in log if e[0] == "wait_event"]
    compute_waits = [w for w in waits if w[1] != copy_stream]
    copy_waits = [w for w in waits if w[1] == copy_stream]
    # gate of each copy: units launched when the event the copy stream last waited on was recorded
    launched = 0
    recorded_at: dict[int, int] = {}
    gate = None
    gates = []
    for e in log:
        if e[0] == "range_push" and e[1].startswith("magi.unit"):
            launched += 1
        elif e[0] == "event_record":
            recorded_at[e[1]] = launched
        elif e[0] == "wait_event" and e[1] == copy_stream:
            gate = recorded_at.get(e[2])
        elif e[0] == "copy":
            gates.append(gate)
    largest = sorted((u.nbytes for u in ex.units), reverse=True)[:2]
    return {
        "match": bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-5)),
        "copies": [[c[0], c[1]] for c in copies],
        "expected": [list(x) for x in expected],
        "distinct_sources": len({c[2] for c in copies}) == len(copies),
        "all_on_copy_stream": all(c[3] == copy_stream for c in copies),
        "all_non_blocking": all(c[4] for c in copies),
        "waits_on_copy_events_only": all(recorded_events.get(w[2]) == copy_stream for w in compute_waits),
        "copy_waits_on_compute_events_only": all(recorded_events.get(w[2]) != copy_stream for w in copy_waits),
        "copies_gated_at_their_unit": all(g == c[0] for g, c in zip(gates, copies, strict=True) if c[0] > 0),
        # copies issued at step start, before any unit: ordered after the compute stream's queued work (a fixed
        # place may still be read by the previous step's last units), so the copy stream waited on a compute event
        "start_copies_gated": all(g is not None for g, c in zip(gates, copies, strict=True) if c[0] == 0),
        "n_waits": len(compute_waits),
        "n_copy_waits": len(copy_waits),
        "peak": device.max_memory_allocated() - base0,
        "predicted_peak": int(ex.plan.notes["peak_device_bytes"]),
        "budget": int(ex.plan.notes["peak_device_bytes"]) + sum(largest),
        "resident_bytes": acts.resident_bytes,
        "alive_after": device.memory_allocated() - base0,
        "carry_bytes": sum(nbytes[w] for b in acts.carry for w in acts.batches[b]),
    }


def run(name: str, model: torch.nn.Module, args: tuple, policy: str, ratio: float, transfer: str = "auto") -> dict:
    torch._dynamo.reset()
    gc.collect()
    base0 = device.memory_allocated()
    h = OffloadHandle(name)
    f = torch.compile(model, backend=h.backend, options={
        "policy": policy, "gpu_resident_weight_ratio": ratio, "unit_compiler": "eager", "warmup_calls": 2,
        "transfer": transfer})
    with torch.no_grad():
        ref = model(*args)
    f(*args)
    f(*args)
    device.LOG.clear()
    out = f(*args)  # first call with the static plan: resident weights copied here
    first = [e for e in device.LOG if e[0] == "copy"]
    rt = h.runtime
    ex = rt.executor
    facts1 = steady_facts(f, args, ex, base0, ref)
    facts2 = steady_facts(f, args, ex, base0, ref)
    return {
        "model": name,
        "policy": policy,
        "ratio": ratio,
        "phase": rt.phase,
        "predicted_peak_bytes": rt.predicted_peak_bytes,
        "measured_peak_bytes": rt.measured_peak_bytes,
        "largest_unit": max(u.nbytes for u in ex.units),
        "allocates": bool(ex.transfer.allocates),
        "transfer": type(ex.transfer).__name__,
        "match": bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-5)),
        "resident_weights": len(ex.actions.resident),
        "first_planned_copies": len(first),
        "streamed_weights": sum(len(b) for b in ex.actions.batches),
        "steps": [facts1, facts2],
    }


def main() -> None:
    assert get_backend().name == "recording", "run with MAGI_BACKEND=recording"
    spec = TransformerSpec(layers=3, hidden=32, heads=2)
    tf = build_transformer(spec)
    x = example_input(spec, tokens=8)
    lm = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    for policy in ("BASE", "COST_EFFECTIVE", "HEURISTIC"):
        for ratio in (0.0, 0.5, 1.0):
            print(json.dumps(run("transformer", tf, (x,), policy, ratio)), flush=True)
    print(json.dumps(run("tied", lm, (ids,), "BASE", 0.0)), flush=True)
    print(json.dumps(run("tied", lm, (ids,), "HEURISTIC", 0.5)), flush=True)
    table = TableStack().eval()  # a small buffer every unit reads, owned by the first layer's unit
    print(json.dumps(run("table", table, (torch.randn(3, 64),), "HEURISTIC", 0.0)), flush=True)
    # fixed places in one buffer: the tied model's first unit cannot be carried over (its embedding is in use during
    # the last unit), so its copy is issued at step start and must be gated there
    print(json.dumps(run("transformer", tf, (x,), "HEURISTIC", 0.5, transfer="unit")), flush=True)
    print(json.dumps(run("tied", lm, (ids,), "BASE", 0.0, transfer="unit")), flush=True)


if __name__ == "__main__":
    main()
