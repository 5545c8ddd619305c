"""One rank of the share-by-content scenarios, started by torchrun from tests/host/test_host_content_sharing.py.

Every scenario runs in this one process, one after the other (a launch costs seconds on 2 cores); each writes
its record under ``<out>/rank<R>.json``. The model: a dense trunk, an expert shard, an embedding and a buffer.

``identical``     every tensor the same on every rank
``different``     every tensor seeded by rank
``experts``       dense/embedding identical, experts seeded by ``rank % 2`` (2 ranks: both differ; 4 ranks:
                  {0, 2} and {1, 3} hold the same experts)
``experts_hint``  the same with HostOptions(ep_size=2) (the hint)
``error``         experts differ, on_mismatch='error': every rank raises, nothing is left behind
``load_files``    a meta model loaded from a sharded safetensors checkpoint rank 0 wrote (index + 2 files)
``load_fn_same``  a meta model from a function declared identical across ranks
``load_fn_rank``  a meta model from an undeclared function whose experts depend on ``rank % 2``
``load_fail``     a function that has no value for one tensor on the last rank: every rank raises, clean
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from magi_core.host import CallableSource, HostOptions, materialize
from magi_core.plugin.cpu import registered_ranges


class Model(nn.Module):
    """~0.6 MiB of weights: dense (256 KiB), experts (128 KiB, bf16 + fp32 router), embedding (128 KiB)."""

    def __init__(self, dense_seed: int = 0, expert_seed: int = 1000) -> None:
        super().__init__()
        self.dense = nn.Linear(256, 256)
        self.experts = nn.Parameter(torch.empty(4, 128, 64, dtype=torch.bfloat16))
        self.router = nn.Linear(64, 4, bias=False)
        self.emb = nn.Embedding(512, 64)
        self.register_buffer("scale", torch.empty(64))
        if self.dense.weight.is_meta:
            return
        g = torch.Generator().manual_seed(dense_seed)
        e = torch.Generator().manual_seed(expert_seed)
        with torch.no_grad():
            for name, t in self.state_dict(keep_vars=True).items():
                t.copy_(torch.randn(t.shape, generator=e if name.startswith(("experts", "router")) else g))


def reference(dense_seed: int, expert_seed: int) -> Model:
    return Model(dense_seed, expert_seed)


def digests(m: nn.Module) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in m.state_dict().items()}


def arena_figures(hw: Any, m: nn.Module) -> dict[str, Any]:
    with torch.no_grad():  # touch every page so each rank's share of every mapping is resident
        for t in m.state_dict().values():
            t.float().sum()
    dist.barrier()
    mem = hw.mapping_memory()
    dist.barrier()
    return {"pss": mem["Pss"], "mappings": mem["mappings"], "arenas": [a.key for a in hw.arenas],
            "inodes": sorted(f["inode"] for f in hw.report["files"]), "mode": hw.report["mode"],
            "node_bytes": hw.report["node_bytes"], "own_bytes": hw.report["own_bytes"],
            "weight_bytes": hw.weight_bytes, "load": hw.report.get("load"), "pin": hw.report.get("pin")}


def finish(hw: Any, shm_dir: str) -> dict[str, Any]:
    hw.release()
    dist.barrier()
    out = {"registered_after": len(registered_ranges()), "dir_after": sorted(os.listdir(shm_dir))}
    dist.barrier()
    return out


def host_scenario(rank: int, shm_dir: str, dense_seed: int, expert_seed: int, **opts: Any) -> dict[str, Any]:
    m = Model(dense_seed, expert_seed)
    before = digests(m)
    hw = materialize(m, options=HostOptions(progress=False, **opts))
    rec = arena_figures(hw, m)
    rec["own_values"] = digests(m) == before
    rec.update(finish(hw, shm_dir))
    return rec


def meta_model() -> Model:
    with torch.device("meta"):
        return Model()


def load_scenario(rank: int, shm_dir: str, source: Any, ref: Model, **opts: Any) -> dict[str, Any]:
    m = meta_model()
    hw = materialize(m, options=HostOptions(progress=False, **opts), source=source)
    rec = arena_figures(hw, m)
    rec["own_values"] = digests(m) == digests(ref)
    rec["on_host"] = all(t.device.type == "cpu" for t in m.state_dict().values())
    rec.update(finish(hw, shm_dir))
    return rec


def failing(rank: int, shm_dir: str, fn: Callable[[], Any], model: nn.Module) -> dict[str, Any]:
    state = dict(model.state_dict(keep_vars=True))
    try:
        fn()
        rec: dict[str, Any] = {"error": None}
    except Exception as exc:
        rec = {"error": type(exc).__name__, "message": str(exc)}
    after = model.state_dict(keep_vars=True)
    rec["same_objects"] = all(after[k] is v for k, v in state.items())
    rec["registered_after"] = len(registered_ranges())
    dist.barrier()
    rec["dir_after"] = sorted(os.listdir(shm_dir))
    dist.barrier()
    return rec


def write_checkpoint(path: str, ref: Model) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    sd["dense.weight"] = sd["dense.weight"].to(torch.bfloat16)  # converted to the model's float32 on load
    halves = [dict(list(sd.items())[:3]), dict(list(sd.items())[3:])]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, os.path.join(path, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def seeded(dense_seed: int, expert_seed: int, missing: str | None = None) -> Callable[[str, torch.Tensor], Any]:
    ref = reference(dense_seed, expert_seed).state_dict()

    def fn(name: str, meta: torch.Tensor) -> torch.Tensor | None:
        return None if name == missing else ref[name].clone()

    return fn


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    shm_dir = os.environ["MAGI_SHM_DIR"]
    recs: dict[str, Any] = {"rank": rank, "world": world}
    recs["identical"] = host_scenario(rank, shm_dir, 0, 1000)
    recs["different"] = host_scenario(rank, shm_dir, rank, 1000 + rank)
    recs["experts"] = host_scenario(rank, shm_dir, 0, 1000 + rank % 2)
    recs["experts_hint"] = host_scenario(rank, shm_dir, 0, 1000 + rank % 2, ep_size=2)
    m = Model(0, 1000 + rank)
    before = digests(m)
    recs["error"] = failing(rank, shm_dir, lambda: materialize(
        m, options=HostOptions(progress=False, on_mismatch="error")), m)
    recs["error"]["values_unchanged"] = digests(m) == before

    ckpt = os.path.join(args.out, "checkpoint")
    ref = reference(0, 1000)
    if rank == 0:
        write_checkpoint(ckpt, ref)
    dist.barrier()
    ref.dense.weight.data = ref.dense.weight.data.to(torch.bfloat16).float()  # what the bf16 checkpoint holds
    recs["load_files"] = load_scenario(rank, shm_dir, ckpt, ref)
    same = CallableSource(seeded(0, 1000), identical_across_ranks=True)
    recs["load_fn_same"] = load_scenario(rank, shm_dir, same, reference(0, 1000))
    recs["load_fn_rank"] = load_scenario(rank, shm_dir, seeded(0, 1000 + rank % 2), reference(0, 1000 + rank % 2))
    meta = meta_model()
    fn = seeded(0, 1000, missing="router.weight" if rank == world - 1 else None)
    recs["load_fail"] = failing(rank, shm_dir, lambda: materialize(meta, options=HostOptions(progress=False),
                                                                     source=fn), meta)
    recs["load_fail"]["still_meta"] = all(t.is_meta for t in meta.state_dict().values())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(recs, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
