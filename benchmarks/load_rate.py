"""Load rate of ``magi_core.host.materialize(meta_model, source=checkpoint)`` against reading the same safetensors
files from the page cache, and the anonymous memory each adds.

Writes a Llama-shaped checkpoint (bf16 shards and an index; ``--layers``, ``--hidden``, ``--ffn``, ``--vocab``)
into ``--dir`` (default: a temporary directory on disk), reads it once to warm the page cache, then measures:

``page_cache``   every file read in 64 MiB chunks into one reused buffer (the ceiling of reading)
``page_cache_fresh``  every file read into fresh memory of its own (what any loader that does not reuse one
                 buffer pays on top: the kernel's page allocation; freed after each file)
``accelerate``   ``init_empty_weights`` + ``load_checkpoint_and_dispatch(device_map={"": "cpu"})`` (when
                 installed): its seconds, the anonymous memory it adds and the resident memory once touched
``magi``         a model built on the meta device filled from the index into the shared arena (not pinned:
                 ``--pin`` to include it); the loader's own read time and the whole call, and ``--dtype float32``
                 to measure the converting path

Anonymous memory is sampled every 10 ms from /proc/self/status (``RssAnon``). One JSON document with hardware and
date:

    python benchmarks/load_rate.py --out benchmarks/results/<date>-load-rate-<host>.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from script_io import AnonPeak, emit_json
from torch import nn

from magi_core.bench.measure import cpu_name
from magi_core.host import HostOptions, materialize
from magi_core.host.memstat import process_memory

MB = 1 << 20


class _Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden))


class _Model(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)


def _write(path: str, args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = _Model(args.layers, args.hidden, args.ffn, args.vocab)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    weight_map, shard, size, n, total = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            name = f"model-{n + 1:05d}.safetensors"
            save_file(shard, os.path.join(path, name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for k, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16).uniform_(-0.02, 0.02)
        shard[k] = t
        size += t.nbytes
        total += t.nbytes
        if size >= args.shard_mb * MB:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _page_cache(path: str) -> tuple[float, int]:
    buf = bytearray(64 * MB)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return time.perf_counter() - t0, total


def _page_cache_fresh(path: str) -> tuple[float, int]:
    total = 0
    t0 = time.perf_counter()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            size = os.path.getsize(os.path.join(path, name))
            buf = torch.empty(size, dtype=torch.uint8)  # untouched: pages come with the read
            view = memoryview(buf.numpy()).cast("B")
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                done = 0
                while done < size:
                    n = f.readinto(view[done:])
                    if not n:
                        break
                    done += n
            total += done
            del view, buf
    return time.perf_counter() - t0, total


def _timed(fn: Callable[[], Any]) -> tuple[float, Any, AnonPeak]:
    gc.collect()
    with AnonPeak() as peak:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return seconds, out, peak


def _magi_row(model: torch.nn.Module, path: str, pin: bool, threads: int | None) -> dict[str, Any]:
    """Load ``model`` (on the meta device) from ``path`` into the host arena; timings, rates and memory."""
    opts = HostOptions(progress=False, pin=pin, load_threads=threads)
    seconds, hw, peak = _timed(lambda: materialize(model, options=opts, source=path))
    rep = hw.report["load"]
    row = {"seconds": seconds, "read_seconds": rep["read_seconds"], "bytes_read": rep["bytes_read"],
           "GBps_read": rep["bytes_read"] / rep["read_seconds"] / 1e9,
           "GBps_end_to_end": rep["bytes_read"] / seconds / 1e9, "weight_bytes": hw.weight_bytes,
           "anon_extra_bytes": peak.extra, "anon_extra_of_weights": peak.extra / hw.weight_bytes,
           "staging_bytes": rep["staging_bytes"], "threads": rep["threads"], "timings": hw.report["timings"]}
    hw.release()
    return row


def _accelerate_row(path: str, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any] | None:
    """accelerate's ``init_empty_weights`` + ``load_checkpoint_and_dispatch`` onto the CPU (its CPU-offload host
    copy), timed with the anonymous memory it adds; None when accelerate is not installed."""
    try:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    except ImportError:
        return None
    with init_empty_weights():
        model = _Model(args.layers, args.hidden, args.ffn, args.vocab).to(dtype)
    rss0 = process_memory().get("Rss", 0)
    seconds, model, peak = _timed(lambda m=model: load_checkpoint_and_dispatch(m, path, device_map={"": "cpu"},
                                                                              dtype=dtype))
    nbytes = sum(p.nbytes for p in model.parameters())
    t0 = time.perf_counter()
    for p in model.parameters():  # touch every page (a mapped checkpoint is read lazily): one byte per page
        p.detach().reshape(-1).view(torch.uint8)[::4096].sum()
    touch = time.perf_counter() - t0
    rss = process_memory().get("Rss", 0) - rss0
    row = {"seconds": seconds, "touch_seconds": touch, "weight_bytes": nbytes,
           "GBps_end_to_end": nbytes / (seconds + touch) / 1e9,
           "anon_extra_bytes": peak.extra, "anon_extra_of_weights": peak.extra / nbytes,
           "rss_after_touch_bytes": rss,  # GBps_end_to_end counts the load and the first touch of every weight
           "note": "anonymous memory hardly grows: accelerate's CPU weights stay in file-backed pages of the "
                   "checkpoint (resident memory grows by the weights once they are touched), per process; a pinned "
                   "copy for fast transfers would be extra"}
    del model
    gc.collect()
    return row


def main() -> int:
    """Measure and write or print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dir", default=None, help="checkpoint directory (written there if it has no index)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (float32: the converting path)")
    ap.add_argument("--pin", action="store_true", help="pin the arena too (the offload path does)")
    ap.add_argument("--threads", type=int, default=None, help="HostOptions.load_threads (default: auto)")
    ap.add_argument("--also-threads", default="", help="comma list: also load with these HostOptions.load_threads")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    also = [int(t) for t in args.also_threads.split(",") if t]
    own_dir = args.dir is None
    path = args.dir or tempfile.mkdtemp(prefix="magi-load-rate-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    try:
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            os.makedirs(path, exist_ok=True)
            _write(path, args)
        _page_cache(path)  # warm the page cache
        dtype = getattr(torch, args.dtype)
        rows: dict[str, list[dict[str, Any]]] = {"page_cache": [], "page_cache_fresh": [], "magi": []}
        for _ in range(args.repeats):
            seconds, nbytes = _page_cache(path)
            rows["page_cache"].append({"seconds": seconds, "bytes": nbytes, "GBps": nbytes / seconds / 1e9})
            seconds, nbytes = _page_cache_fresh(path)
            rows["page_cache_fresh"].append({"seconds": seconds, "bytes": nbytes, "GBps": nbytes / seconds / 1e9})
            with torch.device("meta"):
                model = _Model(args.layers, args.hidden, args.ffn, args.vocab).to(dtype)
            rows["magi"].append(_magi_row(model, path, args.pin, args.threads))
            del model
            for t in also:  # several threads reading into the arena's mapping
                with torch.device("meta"):
                    model = _Model(args.layers, args.hidden, args.ffn, args.vocab).to(dtype)
                rows.setdefault(f"magi_threads_{t}", []).append(_magi_row(model, path, args.pin, t))
                del model
            acc = _accelerate_row(path, args, dtype)
            if acc is not None:
                rows.setdefault("accelerate", []).append(acc)
        best = {k: max(v, key=lambda r: r.get("GBps", r.get("GBps_read", r.get("GBps_end_to_end", 0))))
                for k, v in rows.items()}
        ratio = best["magi"]["GBps_read"] / best["page_cache"]["GBps"]
        doc = {
            "what": "magi load (meta model + safetensors index -> shared arena) vs reading the files from the page "
                    "cache",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "hardware": {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
                         "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_avg_at_end": os.getloadavg(),
            "checkpoint": {"dir": path, "bytes": best["page_cache"]["bytes"], "model_dtype": args.dtype},
            "magi_read_vs_page_cache": ratio,
            "magi_end_to_end_vs_page_cache": best["magi"]["GBps_end_to_end"] / best["page_cache"]["GBps"],
            "magi_read_vs_page_cache_fresh": best["magi"]["GBps_read"] / best["page_cache_fresh"]["GBps"],
            "magi_end_to_end_vs_page_cache_fresh": best["magi"]["GBps_end_to_end"] / best["page_cache_fresh"]["GBps"],
            "magi_end_to_end_vs_accelerate": (best["magi"]["GBps_end_to_end"] / best["accelerate"]["GBps_end_to_end"]
                                              if "accelerate" in best else None),
            "threads_read_vs_page_cache": {t: best[f"magi_threads_{t}"]["GBps_read"] / best["page_cache"]["GBps"]
                                           for t in also},
            "threads_end_to_end_vs_page_cache": {
                t: best[f"magi_threads_{t}"]["GBps_end_to_end"] / best["page_cache"]["GBps"] for t in also},
            "host_memory_note": "magi's weights land in shared memory (one copy per node, counted in weight_bytes, "
                                "not in anon_extra_bytes); accelerate's are this process's anonymous memory",
            "rows": rows,
        }
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
