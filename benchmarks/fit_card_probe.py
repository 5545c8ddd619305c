"""What the fit-the-card plan holds against what a capped device really allocates, call by call.

    python benchmarks/fit_card_probe.py --model flux --cap 12GiB --out fit-probe.json

Caps the process's device memory (``magi_core.limit_device_memory``) before the first allocation, offloads the
bench's real workload with the default ``OffloadConfig()`` (fit the card), and records for every call: the
device's allocated and reserved bytes before and after, the call's peak, the runtime's phase, activation bytes,
budget, predicted peak and copy buffer, and every room planning measured (free, held, activations, reserve). On an
out-of-memory error it records the allocator's summary and its segments grouped by stream, so a gap between the
plan's prediction and the device can be told apart from fragments of the caching allocator.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from typing import Any

import torch

import magi_core
from magi_core import OffloadConfig, handle, offload
from magi_core.bench.real import real_workload
from magi_core.compile import device_room as room_mod
from magi_core.compile import runtime as runtime_mod

GIB = 2**30


def _gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def main() -> None:
    """Run the probe and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux", choices=("flux", "llama8b", "wan14b"))
    parser.add_argument("--cap", default="12GiB")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--preset", default="full", choices=("full", "quick", "tiny"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("fit_card_probe")
    backend = magi_core.get_backend()
    dm = backend.device_module
    dev = backend.device()
    magi_core.limit_device_memory(args.cap)
    rooms: list[dict[str, Any]] = []
    real_room = room_mod.device_room

    def logged_room(*a: Any, **k: Any) -> Any:
        room = real_room(*a, **k)
        if room is not None:
            rooms.append({"free": _gib(room.free), "held": _gib(room.held), "activations": _gib(room.activations),
                          "reserve": _gib(room.reserve), "spare": _gib(room.spare), "total": _gib(room.total),
                          "allocated": _gib(dm.memory_allocated(dev)), "reserved": _gib(dm.memory_reserved(dev))})
            log.info("room: %s", rooms[-1])
        return room

    runtime_mod.device_room = logged_room  # type: ignore[assignment]
    w = real_workload(args.model, torch.bfloat16, args.preset)
    w.materialize_base()
    tokens = args.tokens or (w.tokens[0] if w.tokens else 2048)
    model = offload(w.fresh(), OffloadConfig(), dynamic=False)
    a, k = w.make_inputs(tokens, dev)
    calls: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"model": args.model, "cap": args.cap, "tokens": tokens, "weight_bytes": w.weight_bytes,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
                           "alloc_conf": __import__("os").environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                           "calls": calls, "rooms": rooms}
    try:
        for n in range(args.calls):
            before = (dm.memory_allocated(dev), dm.memory_reserved(dev))
            dm.reset_peak_memory_stats(dev)
            entry: dict[str, Any] = {"call": n + 1, "allocated_before": _gib(before[0]),
                                     "reserved_before": _gib(before[1])}
            calls.append(entry)
            with torch.no_grad():
                model(*a, **k)
            dm.synchronize()
            entry.update(allocated_after=_gib(dm.memory_allocated(dev)), reserved_after=_gib(dm.memory_reserved(dev)),
                         peak_in_call=_gib(dm.max_memory_allocated(dev)))
            for i, rt in enumerate(handle(model).runtimes):
                entry[f"runtime{i}"] = {
                    "phase": rt.phase, "activation": _gib(rt.activation_bytes), "budget": _gib(rt.device_budget_bytes),
                    "predicted_peak": _gib(rt.predicted_peak_bytes), "measured_peak": _gib(rt.measured_peak_bytes),
                    "buffer": _gib(getattr(rt.executor.transfer, "buffer_bytes", 0)),
                    "resident": _gib(rt.executor.actions.resident_bytes) if rt.executor.actions else None}
            log.info("call %d: %s", n + 1, entry)
    except torch.OutOfMemoryError as e:
        doc["oom"] = str(e)[:600]
        doc["oom_call"] = len(calls)
        doc["summary"] = dm.memory_summary(dev, abbreviated=True)
        by_stream: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for seg in dm.memory_snapshot():
            s = by_stream[str(seg.get("stream"))]
            s["segments"] += 1
            s["total_gib"] += seg["total_size"] / GIB
            s["allocated_gib"] += seg["allocated_size"] / GIB
            s["largest_free_gib"] = max(s["largest_free_gib"], max(
                (b["size"] / GIB for b in seg["blocks"] if b["state"] == "inactive"), default=0.0))
        doc["segments_by_stream"] = by_stream
        for i, rt in enumerate(handle(model).runtimes):
            doc[f"runtime{i}"] = {"phase": rt.phase, "activation": _gib(rt.activation_bytes),
                                  "budget": _gib(rt.device_budget_bytes),
                                  "predicted_peak": _gib(rt.predicted_peak_bytes),
                                  "buffer": _gib(getattr(rt.executor.transfer, "buffer_bytes", 0)),
                                  "resident": _gib(rt.executor.actions.resident_bytes) if rt.executor.actions else None,
                                  "plan_notes": {key: v for key, v in (rt.plan.notes if rt.plan else {}).items()
                                                 if isinstance(v, int | float | str)}}
        log.error("out of memory at call %d: %s", len(calls), doc["oom"])
    finally:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
