"""One rank of the expert-parallel MoE scenarios (transformers' Mixtral), started by torchrun from
tests/host/test_moe_expert_parallel.py and benchmarks/moe_ep.py.

Every EP size given by ``--ep`` runs in this one process, one after the other (a launch costs seconds); the
records go to ``<out>/rank<R>.json``. In each, every rank builds ``MixtralForCausalLM`` on the meta device and
fills it through ``magi_core.load`` from a function ``(name, meta) -> tensor`` seeded by ``zlib.crc32`` of the
name: dense tensors (attention, norms, embeddings, router) are the same on every rank, expert tensors (names with
``.experts.``) are seeded also by the rank's expert-parallel group ``rank % ep`` (EP 4 on 4 ranks: every rank's
experts differ; EP 2: ranks {0, 2} and {1, 3} hold the same experts; EP 1: every tensor the same on every rank,
run first so that one-time costs (imports, first compile) stay out of the memory figures of the others).
``MAGI_EP_SIZE`` is set to the EP size.

Per rank and EP size it records: the offloaded model's logits against the same model filled the same way and run
eagerly without offload (``max_abs_diff``); the sharing report (``node_bytes``: distinct / all_shared /
all_private, ``mode``, ``own_bytes``, the arena files); measured memory: the proportional set size of the arena
mappings (``mapping_memory``), ``/proc/self/smaps_rollup`` before and after loading, the files in the shm dir
(arena files are unlinked once mapped, so the directory itself is empty), the shm files this rank maps with their
allocated bytes (stat of /proc/self/map_files: by inode, so the node's total is their union over the ranks), and
the growth of the shm file system's used bytes across the load (file-system wide: others' files count); and
what the predecessor's rule (rank 0's file for every rank) would have computed: the same eager model with rank
0's expert values (``wrong_*``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import hashlib
import json
import os
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import magi_core

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
POOL = (1 << 20) + 7  # values drawn per tensor, tiled beyond
ROLLUP = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Anonymous")


def mixtral_config(args: argparse.Namespace) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
                         num_experts_per_tok=args.top_k, max_position_embeddings=max(128, args.seq),
                         tie_word_embeddings=False)


def is_expert(name: str) -> bool:
    return ".experts." in name


def filler(group: int, scale: float = 0.05) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Values by name: dense ones identical on every rank, expert ones also seeded by the EP group."""

    def fn(name: str, meta: torch.Tensor) -> torch.Tensor:
        key = f"{name}@ep-group{group}" if is_expert(name) else name
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        n = meta.numel()
        # a seeded pool tiled over the tensor: drawing every value is minutes per rank at a Mixtral shape (the
        # pool's length is not a multiple of a row, so rows differ)
        pool = torch.randn(min(n, POOL), generator=g).mul_(scale)
        if name.endswith("norm.weight"):
            pool += 1.0
        pool = pool.to(meta.dtype)
        t = pool.repeat(-(-n // pool.numel()))[:n] if n > pool.numel() else pool
        return t.reshape(tuple(meta.shape))

    return fn


def build(config: Any, dtype: torch.dtype, device: torch.device | str) -> Any:
    from transformers import MixtralForCausalLM

    with torch.device(device):
        return MixtralForCausalLM(config).to(dtype).eval()


def fill_(model: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], only: Callable[[str], bool]) -> None:
    """Copy ``fn``'s values into the (real) model's parameters whose names pass ``only``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only(name):
                p.copy_(fn(name, p))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def smaps_rollup() -> dict[str, int]:
    """This process's totals; freed heap memory is given back first (malloc_trim) so that only what is held counts."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ROLLUP:
                out[name] = int(rest.split()[0]) * 1024
    return out


def fs_used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def mapped_files(path: str) -> dict[str, dict[str, int]]:
    """The files under ``path`` this process maps (unlinked ones too), by inode: size and allocated bytes (tmpfs
    pages actually held), read through /proc/self/map_files."""
    out: dict[str, dict[str, int]] = {}
    prefix = os.path.realpath(path) + os.sep
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith(prefix):
                continue
            try:
                st = os.stat(f"/proc/self/map_files/{parts[0]}")
            except OSError:
                continue
            out[str(st.st_ino)] = {"size": st.st_size, "allocated": st.st_blocks * 512}
    return out


def dir_files(path: str) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    a, b = a.float().cpu(), b.float().cpu()
    return {"max_abs_diff": (a - b).abs().max().item(), "max_abs": b.abs().max().item(),
            "argmax_changed": (a.argmax(-1) != b.argmax(-1)).float().mean().item()}


def scenario(args: argparse.Namespace, ep: int, rank: int, world: int, device: torch.device,
             shm_dir: str) -> dict[str, Any]:
    os.environ["MAGI_EP_SIZE"] = str(ep)
    group = rank % ep
    dtype = DTYPES[args.dtype]
    config = mixtral_config(args)
    fn = filler(group)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    # the reference: the same model filled the same way, run eagerly without offload (resident on the device)
    ref = build(config, dtype, device)
    fill_(ref, fn, lambda n: True)
    with torch.no_grad():
        want = ref(ids).logits
        # compiled units round differently from eager kernels: their reference is the whole model compiled
        want_compiled = torch.compile(ref)(ids).logits if args.unit_compiler != "eager" else None
        # the predecessor's rule: rank 0's file for everyone, i.e. this rank computing with rank 0's experts
        fill_(ref, filler(0), is_expert)
        wrong = ref(ids).logits
    del ref
    gc.collect()
    progress(rank, ep, "reference and predecessor's logits")

    dist.barrier()
    roll_before = smaps_rollup()
    fs_before = fs_used(shm_dir)
    dist.barrier()
    with torch.device("meta"):
        from transformers import MixtralForCausalLM

        model = MixtralForCausalLM(config).to(dtype).eval()
    t0 = time.perf_counter()
    model = magi_core.load(model, fn, magi_core.OffloadConfig(unit_compiler=args.unit_compiler))
    load_s = time.perf_counter() - t0
    progress(rank, ep, f"loaded in {load_s:.1f} s")
    roll_loaded = smaps_rollup()
    t0 = time.perf_counter()
    with torch.no_grad():
        got = model(ids).logits
    first_call_s = time.perf_counter() - t0
    progress(rank, ep, f"first call {first_call_s:.1f} s")
    stream = streaming(model, ids, args.steps, device) if args.steps and device.type != "cpu" else None
    hw = magi_core.handle(model).host
    with torch.no_grad():  # touch every page: each rank's share of every mapping is resident
        for t in model.state_dict().values():
            t.float().sum()
    dist.barrier()
    mem = hw.mapping_memory()
    roll_after = smaps_rollup()
    fs_after = fs_used(shm_dir)
    files_in_dir = dir_files(shm_dir)
    files_mapped = mapped_files(shm_dir)
    dist.barrier()

    params = dict(model.named_parameters())
    experts = {n: digest(p) for n, p in params.items() if is_expert(n)}
    rank0_experts = {n: digest(filler(0)(n, p)) for n, p in params.items() if is_expert(n)}
    own_values = all(digest(p) == digest(fn(n, p)) for n, p in params.items())
    locs = {n: (loc.arena if (loc := hw.locate(p)) is not None else None) for n, p in params.items()}
    rec = {
        "ep": ep, "group": group, "rank": rank, "world": world, "dtype": args.dtype, "device": str(device),
        "load_seconds": load_s, "first_call_seconds": first_call_s,
        "offloaded_vs_eager": diff(got, want), "logits_digest": digest(got.float()),
        "offloaded_vs_compiled": diff(got, want_compiled) if want_compiled is not None else None,
        "compiled_vs_eager": diff(want_compiled, want) if want_compiled is not None else None,
        "wrong_vs_eager": diff(wrong, want), "wrong_logits_digest": digest(wrong.float()),
        "own_values": own_values,
        "experts_digest": hashlib.sha256("".join(experts.values()).encode()).hexdigest()[:16],
        "experts_equal_rank0": experts == rank0_experts,
        "expert_arenas": sorted({locs[n] for n in experts}), "dense_arenas": sorted({locs[n] for n in params
                                                                                      if not is_expert(n)}),
        "mode": hw.report["mode"], "node_bytes": hw.report["node_bytes"], "own_bytes": hw.report["own_bytes"],
        "weight_bytes": hw.weight_bytes,
        "expert_bytes": sum(p.numel() * p.element_size() for n, p in params.items() if is_expert(n)),
        "files": [{k: f[k] for k in ("dtype", "nbytes", "inode", "shared_by", "writer", "mapping")}
                  for f in hw.report["files"]],
        "mapping_memory": mem, "smaps_rollup": {"before": roll_before, "loaded": roll_loaded, "after": roll_after},
        "shm_fs_used_delta": fs_after - fs_before, "shm_dir_files": files_in_dir,
        "shm_files_mapped": files_mapped, "stream": stream,
    }
    del got, want, want_compiled, wrong, params, hw
    magi_core.release(model)
    del model
    gc.collect()
    dist.barrier()
    rec["dir_after_release"] = sorted(os.listdir(shm_dir))
    dist.barrier()
    return rec


def streaming(model: Any, ids: torch.Tensor, steps: int, device: torch.device) -> dict[str, Any]:
    """Every rank steps at once: the median step, the bytes streamed per step and the step against the transfer
    ideal (those bytes at the link rate the runtimes measured; the compute of this short input is far less)."""
    dm = magi_core.get_backend().device_module
    with torch.no_grad():
        for _ in range(2):
            model(ids)
        times = []
        for _ in range(steps):
            dm.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            model(ids)
            dm.synchronize()
            times.append(time.perf_counter() - t0)
    stats = magi_core.handle(model).stats()
    streamed = sum(s.streamed_bytes_per_step or 0 for s in stats)
    rate = max((s.bandwidth_GBps or 0.0) for s in stats) * 1e9
    step = statistics.median(times)
    return {"step_ms": step * 1e3, "steps_ms": [t * 1e3 for t in times], "streamed_bytes": streamed,
            "runtimes": len(stats), "link_GBps": rate / 1e9, "copy_GBps": streamed / step / 1e9,
            "x_transfer_ideal": step / (streamed / rate) if streamed and rate else None}


def progress(rank: int, ep: int, what: str) -> None:
    """One line in the rank's log (what a run that outlives its timeout had reached)."""
    print(f"[rank {rank} ep {ep} {time.strftime('%H:%M:%S')}] {what}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 4, 2],
                    help="expert-parallel sizes, one scenario each (the first also warms up imports and compiling)")
    ap.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one accelerator per rank)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--unit-compiler", default="eager")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="timed steps with every rank at once (accelerators)")
    return ap.parse_args(argv)


@record
def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    shm_dir = os.environ.get("MAGI_SHM_DIR", "/dev/shm")
    recs = {"rank": rank, "world": world, "scenarios": [scenario(args, ep, rank, world, device, shm_dir)
                                                        for ep in args.ep]}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(recs, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
