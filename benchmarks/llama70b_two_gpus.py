"""The 70B case of issue 16: two ranks, one host copy, weights filled straight into the shared arena.

On the 2-GPU machine (2x H200, ~251 GB host memory, /dev/shm 256 GB)::

    MAGI_PIN_CONCURRENCY=2 torchrun --nproc-per-node 2 benchmarks/llama70b_two_gpus.py \\
        --out benchmarks/results/<date>-llama70b-2xh200.json

Every rank builds transformers' ``LlamaForCausalLM`` at the Llama-3-70B shape (80 layers, hidden 8192, FFN
28672, 64 heads, 8 KV heads, vocab 128256; ~141 GB in bf16) on the meta device and calls ``magi_core.load``
with a function source declared identical across ranks (values tiled from a seeded pool at a name-dependent
offset, norms ones): one rank of the node fills each tensor into the shared arena, the other maps it, so the
node holds the weights once (two private copies would not fit). Each rank then runs the model (data
parallel, same inputs) with half the weights resident (``gpu_resident_weight_ratio=0.5``) and streams the
rest. Reported (rank 0 writes the JSON, with every rank's figures): load seconds and rate, the host bytes the
weights take (each rank's proportional share of the arena pages it maps, summed over the ranks: other jobs'
``/dev/shm`` files do not count) against the weight bytes, each rank's step time
against its ideal (the issue's: its streamed bytes / its own host-to-device rate, measured from a pinned probe
with every rank copying at once, or its profiled compute, whichever is larger; also against the rate of copying
the whole arena and against the planning probe's rate), time to first step. On the cpu backend
``--layers 2 --hidden 64`` runs a tiny version with two gloo ranks (a rehearsal, tested).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from script_io import emit_json, start_ranks

import magi_core
from magi_core.bench.measure import cpu_name, main_tensor
from magi_core.config import OffloadConfig
from magi_core.host import CallableSource, HostOptions

POOL = (1 << 24) + 4099  # not a multiple of a row length


def weights_fn(pool: torch.Tensor) -> Any:
    """``(name, meta) -> tensor``: norms ones, the rest the pool tiled from an offset that depends on the name."""

    def fn(name: str, meta: torch.Tensor) -> torch.Tensor:
        t = torch.empty(meta.shape, dtype=meta.dtype)
        if name.endswith("norm.weight"):
            return t.fill_(1.0)
        flat, start = t.view(-1), zlib.crc32(name.encode()) % pool.numel()
        tile = torch.cat([pool[start:], pool[:start]]).to(meta.dtype)
        rows = flat.numel() // tile.numel()
        if rows:
            flat[:rows * tile.numel()].view(rows, -1).copy_(tile.expand(rows, -1))
        rest = flat.numel() - rows * tile.numel()
        if rest:
            flat[flat.numel() - rest:].copy_(tile[:rest])
        return t

    return fn


def arena_rate(host: Any, dm: Any, device: torch.device, chunk: int = 256 << 20) -> float:
    """Bytes/s of copying every arena of ``host`` to the device in ``chunk``-byte pieces with all ranks at once:
    what the link gives from this memory (all of it, not a reused probe buffer)."""
    buf = torch.empty(chunk, dtype=torch.uint8, device=device)
    bounds = be_bounds()
    pieces = []
    for a in host.arenas:
        base = a.buf.data_ptr()
        # cut at every registration's bound too: one copy from two registrations is refused (CUDA: invalid argument)
        cuts = sorted({0, a.buf.numel(), *range(0, a.buf.numel(), chunk),
                       *(b - base for b in bounds if base < b < base + a.buf.numel())})
        pieces += [a.buf[lo:hi] for lo, hi in itertools.pairwise(cuts)]
    buf[: pieces[0].numel()].copy_(pieces[0], non_blocking=True)  # warm the path
    dm.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for p in pieces:
        buf[: p.numel()].copy_(p, non_blocking=True)
    dm.synchronize()
    return sum(p.numel() for p in pieces) / (time.perf_counter() - t0)


def be_bounds() -> tuple[int, ...]:
    """Every host range registered through magi-core in this process, as sorted start and end addresses."""
    return magi_core.get_backend().registered.bounds()


def link_rate_all_ranks(be: Any, device: torch.device) -> float:
    """This rank's host-to-device bytes/s from a pinned probe buffer, every rank copying at once (a barrier first)."""
    from magi_core.execute.profiler import measure_h2d_bandwidth

    dist.barrier()
    return measure_h2d_bandwidth(be, device=device, iters=8, broadcast=False)


def numa_facts(host: Any, device_index: int, be: Any) -> dict[str, Any]:
    """The device's NUMA node (from its PCI address) and the arena pages' nodes (from /proc/self/numa_maps)."""
    facts: dict[str, Any] = {}
    try:
        props = be.device_module.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            facts["device_numa_node"] = int(f.read())
        facts["device_pci"] = bus
    except (AttributeError, OSError, ValueError) as exc:
        facts["device_numa_node"] = f"unknown ({exc})"
    paths = {a.path for a in host.arenas if a.path}
    pages: dict[str, int] = {}
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                if any(p in line for p in paths):
                    for tok in line.split():
                        if tok.startswith("N") and "=" in tok:
                            node, n = tok[1:].split("=")
                            pages[node] = pages.get(node, 0) + int(n)
    except OSError:
        pass
    facts["arena_pages_per_node"] = pages
    try:
        facts["numa_nodes_online"] = open("/sys/devices/system/node/online").read().strip()
    except OSError:
        pass
    return facts


def main() -> None:
    """Load, run, measure, report (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    be, device, rank, world = start_ranks()
    dm = be.device_module
    full = args.hidden == 8192
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                      intermediate_size=28672 if full else 4 * args.hidden, num_attention_heads=64 if full else 4,
                      num_key_value_heads=8 if full else 2, vocab_size=128256 if full else 512, rope_theta=500000.0,
                      max_position_embeddings=8192, use_cache=False)
    dtype = torch.bfloat16 if be.is_accelerator else torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.eval()
    pool = torch.randn(POOL, generator=torch.Generator().manual_seed(0)) * 0.02
    dist.barrier()
    t0 = time.perf_counter()
    source = CallableSource(weights_fn(pool), identical_across_ranks=True, thread_safe=True)
    model = magi_core.load(model, source, OffloadConfig(gpu_resident_weight_ratio=args.ratio),
                           host_options=HostOptions(progress=False))
    dist.barrier()
    load_s = time.perf_counter() - t0
    host = magi_core.handle(model).host
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        main_tensor(model(input_ids=ids, logits_to_keep=1))
        dm.synchronize()
        first_s = time.perf_counter() - t0
        for _ in range(3):
            model(input_ids=ids, logits_to_keep=1)
        times = []
        for _ in range(args.steps):
            dm.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            out = main_tensor(model(input_ids=ids, logits_to_keep=1))
            dm.synchronize()
            times.append(time.perf_counter() - t0)
    rt = magi_core.handle(model).runtime
    step = statistics.median(times)
    whole_arena = arena_rate(host, dm, device) if be.is_accelerator else None
    link = link_rate_all_ranks(be, device)
    streamed = rt.executor.actions.streamed_bytes
    compute_ms = sum(p.compute_ms for p in rt.profiles or [])
    ideal_ms = max(streamed / link * 1e3, compute_ms)
    mine = {"rank": rank, "step_ms": step * 1e3, "first_step_s": first_s, "load_s": load_s,
            "streamed_bytes": streamed, "resident_bytes": rt.executor.actions.resident_bytes,
            # the ideal: this rank's streamed bytes at its own rate with every rank copying, or its compute
            "link_GBps": link / 1e9, "compute_ms": compute_ms, "ideal_ms": ideal_ms, "x_ideal": step * 1e3 / ideal_ms,
            # the planning probe's rate (this rank's own, measured when it planned)
            "planning_link_GBps": rt.bandwidth_Bps / 1e9, "x_planning_ideal": step / (streamed / rt.bandwidth_Bps),
            "finite": bool(torch.isfinite(out).all()),
            "load": host.report.get("load"), "node_bytes": host.report.get("node_bytes"),
            # the link from the whole arena, every rank at once, and where its pages and this device sit
            "arena_copy_GBps": whole_arena / 1e9 if whole_arena else None,
            "x_arena_ideal": step / (streamed / whole_arena) if whole_arena else None,
            "numa": numa_facts(host, device.index or 0, be) if be.is_accelerator else None,
            # the plan's own view: its predicted step and stall at the planning rate, per compiled graph
            "plans": [s.to_dict() for s in magi_core.handle(model).stats()],
            # this rank's proportional share of the arena pages it maps: summed over the node's ranks it is the
            # host memory the weights take, whatever other processes keep in /dev/shm
            "arena_pss_bytes": host.mapping_memory()["Pss"]}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    weight_bytes = host.weight_bytes
    host_bytes = sum(r["arena_pss_bytes"] for r in everyone)
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "hardware": dm.get_device_name() if be.is_accelerator else cpu_name(), "gpus": world,
           "torch": torch.__version__, "magi_core": magi_core.__version__, "layers": args.layers,
           "hidden": args.hidden, "tokens": args.tokens, "ratio": args.ratio, "weight_bytes": weight_bytes,
           "host_pss_bytes": host_bytes, "host_over_weights": host_bytes / weight_bytes,
           "ranks": everyone, "targets": {"host weights <= 1.02 W": host_bytes <= 1.02 * weight_bytes,
                                          "step <= 1.02x ideal": all(r["x_ideal"] <= 1.02 for r in everyone)},
           "command": "MAGI_PIN_CONCURRENCY=2 torchrun --nproc-per-node 2 benchmarks/llama70b_two_gpus.py"}
    if rank == 0:
        emit_json(doc, args.out)
    magi_core.release(model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
