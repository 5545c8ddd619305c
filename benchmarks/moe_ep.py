"""Expert parallelism with a real library MoE (transformers' ``MixtralForCausalLM``): host bytes per node and every
rank's output, under torchrun (one launch; tests/host_workers/moe_worker.py is the rank).

Every rank builds the model on the meta device and fills it through ``magi_core.load`` from a function seeded by
``zlib.crc32`` of each tensor's name: dense tensors (attention, norms, embeddings, router) identical on every rank,
expert tensors (``.experts.`` in the name) seeded also by the rank's EP group ``rank % ep``; ``MAGI_EP_SIZE`` is
set to the EP size. Each EP size given by ``--ep`` is one scenario (the first also takes the one-time costs:
imports, first compile; keep EP 1 first). Per scenario the JSON has, for the node:

- ``report``: the sharing report's ``node_bytes`` (``distinct`` against ``all_shared``, the predecessor's rule of
  rank 0's file for everyone, and ``all_private``, one copy per rank);
- ``measured``: the proportional set size of the arena mappings summed over the ranks
  (``handle(model).host.mapping_memory()``), the growth of ``Pss_Shmem`` and ``Anonymous`` in
  ``/proc/self/smaps_rollup`` summed over the ranks (``Anonymous`` across the load only: on the CPU backend the
  "device" copies made by the first call are process memory too), the bytes the shm file system allocated to the
  arena files (unlinked once mapped, so the shm dir itself lists nothing: found through /proc/self/map_files, by
  inode, union over the ranks), the growth of the shm file system's used bytes across the load (file-system wide:
  others' files count too) and the bytes of the files left in the shm dir (0);
- per rank: the offloaded logits against the same model filled the same way and run eagerly without offload
  (resident on the rank's device), and ``predecessor_rule``: what the rank computes with rank 0's expert values.

CPU (4 gloo ranks, float32, the tiny default shape; 2026-12-01, this machine)::

    python benchmarks/moe_ep.py --nproc 4 --ep 1 4 2 --out benchmarks/results/2026-12-01-moe-ep-cpu.json

For the device machines (the run tool runs the command in the repository root; NCCL between the ranks, bf16).
With ``--unit-compiler eager`` the offloaded units run the eager model's own kernels, so every rank's logits must
equal its resident eager model's bit for bit: the exact check. With compiled units (``auto``, ``inductor``) bf16
rounding differs from eager kernels and sends some tokens to other experts (top-2 routing is discontinuous), so
the worker also compares with the whole model compiled (``offloaded_vs_compiled``, ``compiled_vs_eager``); on
the 2x H200 (2026-12-01, ``auto``) the offloaded logits differed from eager by up to 17.5 of 18.1, 24% of argmax
changed, as whole-model compile does on the CPU. A Mixtral shape (hidden 4096, 14336 FFN, 8 experts top-2, 32/8
heads, vocab 32000) cut to 2 layers: 5.25 GiB of experts + 0.65 GiB dense per rank, so host bytes per node with
EP 2 on 2 ranks = dense + 2 expert shards = about 11.2 GiB (all-private 11.8, all-shared 5.9 and wrong).
2 x H200 (kind ``nvidia-h200-x2``)::

    python benchmarks/moe_ep.py --nproc 2 --backend nccl --dtype bfloat16 --unit-compiler eager --ep 1 2 \\
        --vocab 32000 --hidden 4096 --intermediate 14336 --layers 2 --heads 32 --kv-heads 8 --experts 8 \\
        --top-k 2 --batch 1 --seq 256 --timeout 540 --out benchmarks/results/<date>-moe-ep-2xh200.json

8 x H200 (kind ``nvidia-h200-x8``; EP 8: every rank's experts differ, about 42.7 GiB of host bytes per node
against 47.2 all-private; EP 2 for the mixed case, 11.2 GiB)::

    python benchmarks/moe_ep.py --nproc 8 --backend nccl --dtype bfloat16 --unit-compiler eager --ep 1 8 2 \\
        --vocab 32000 --hidden 4096 --intermediate 14336 --layers 2 --heads 32 --kv-heads 8 --experts 8 \\
        --top-k 2 --batch 1 --seq 256 --timeout 540 --out benchmarks/results/<date>-moe-ep-8xh200.json

(Each rank fills its tensors from a pool of about a million values drawn per tensor (seeded by the name, and for
experts by the EP group) and tiled over it, several times: the reference, the load, the check of its own values
and of rank 0's experts. The streaming figures of the issue, per-GPU copy rate and step time against the ideal
with every rank streaming at once and pin waves, are not measured by this script.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from script_io import emit_json

from magi_core.bench.measure import cpu_name
from magi_core.host import shm

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "host_workers" / "moe_worker.py"
MODEL_ARGS = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "experts", "top_k", "batch", "seq",
              "steps")


def launch(args: argparse.Namespace, out: str, shm_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One torchrun launch of the worker; every rank's record and the command line."""
    worker = [str(WORKER.relative_to(ROOT)), "--out", out, "--ep", *map(str, args.ep), "--backend", args.backend,
              "--dtype", args.dtype, "--unit-compiler", args.unit_compiler]
    for k in MODEL_ARGS:
        worker += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--log-dir", os.path.join(out, "logs"), "--redirects", "3", *worker]
    env = dict(os.environ, MAGI_SHM_DIR=shm_dir, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)

    def rank_logs() -> str:
        return "".join(f"--- {p}\n{p.read_text(errors='replace')}" for p in sorted(Path(out, "logs").rglob("*.log")))

    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"torchrun did not finish within --timeout {args.timeout:g} s (raise it for larger shapes); "
                         f"the ranks' output so far:\n{rank_logs()[-12000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{rank_logs()[-12000:]}")
    recs = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.nproc)]
    return recs, cmd


def node_row(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's figures of one scenario (``rs``: every rank's record)."""
    nb = rs[0]["node_bytes"]

    def rollup(key: str, stage: str) -> int:
        return sum(r["smaps_rollup"][stage][key] - r["smaps_rollup"]["before"][key] for r in rs)

    pss = sum(r["mapping_memory"]["Pss"] for r in rs)
    return {
        "ep": rs[0]["ep"], "ranks": len(rs), "dtype": rs[0]["dtype"],
        "weight_bytes_per_rank": rs[0]["weight_bytes"], "expert_bytes_per_rank": rs[0]["expert_bytes"],
        "report": {**nb, "distinct_vs_all_private": nb["distinct"] / nb["all_private"],
                   "distinct_vs_all_shared": nb["distinct"] / nb["all_shared"]},
        "measured": {
            "arena_pss_sum": pss, "arena_pss_vs_distinct": pss / nb["distinct"],
            "smaps_rollup_pss_shmem_growth_sum": rollup("Pss_Shmem", "after"),
            "smaps_rollup_anonymous_growth_over_load_sum": rollup("Anonymous", "loaded"),
            "smaps_rollup_anonymous_growth_incl_first_call_sum": rollup("Anonymous", "after"),
            "shm_arena_files_allocated_bytes": sum({i: f["allocated"] for r in rs
                                                    for i, f in r["shm_files_mapped"].items()}.values()),
            "shm_fs_used_growth": rs[0]["shm_fs_used_delta"],
            "shm_dir_file_bytes": sum(sum(r["shm_dir_files"].values()) for r in rs[:1]),
            "arena_files": len({f["inode"] for r in rs for f in r["files"]}),
            "arena_file_bytes": sum({f["inode"]: f["nbytes"] for r in rs for f in r["files"]}.values()),
        },
        "modes": [r["mode"] for r in rs], "own_bytes": [r["own_bytes"] for r in rs],
        "load_seconds_max": max(r["load_seconds"] for r in rs),
        "first_call_seconds_max": max(r["first_call_seconds"] for r in rs),
        "files_left_after_release": sorted({f for r in rs for f in r["dir_after_release"]}),
        "per_rank": [{
            "rank": r["rank"], "ep_group": r["group"], "own_values": r["own_values"],
            "offloaded_vs_eager": r["offloaded_vs_eager"], "experts_equal_rank0": r["experts_equal_rank0"],
            "offloaded_vs_compiled": r.get("offloaded_vs_compiled"), "compiled_vs_eager": r.get("compiled_vs_eager"),
            "predecessor_rule": {"logits_vs_eager": r["wrong_vs_eager"],
                                 "gives_other_logits": r["wrong_logits_digest"] != r["logits_digest"]},
            "expert_arenas": r["expert_arenas"], "mapping_memory": r["mapping_memory"], "stream": r.get("stream"),
        } for r in rs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 4, 2])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--unit-compiler", default="eager")
    ap.add_argument("--shm-dir", default=os.environ.get("MAGI_SHM_DIR", "/dev/shm"))
    ap.add_argument("--timeout", type=float, default=600)
    defaults = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
                "experts": 8, "top_k": 2, "batch": 2, "seq": 16, "steps": 5}
    for k, v in defaults.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    args = ap.parse_args()
    shm_dir = tempfile.mkdtemp(prefix="magi-bench-moe-", dir=args.shm_dir)
    out = tempfile.mkdtemp(prefix="magi-moe-ep-")
    try:
        recs, cmd = launch(args, out, shm_dir)
    finally:
        left = os.listdir(shm_dir)
        if not left:
            os.rmdir(shm_dir)
        shutil.rmtree(out, ignore_errors=True)
    rows = [node_row([r["scenarios"][i] for r in recs]) for i in range(len(args.ep))]
    doc = {
        "what": "expert parallelism with transformers' MixtralForCausalLM: host bytes per node (per-tensor sharing "
                "by content) vs all-shared (rank 0's file for everyone) and all-private; every rank's logits vs "
                "its own eager model; what rank 0's experts would give the other ranks",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "torchrun_command": shlex.join([os.path.basename(cmd[0]), *cmd[1:]]).replace(out, "<tmp>"),
        "hardware": {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
                     "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                     "accelerators": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                                      if torch.cuda.is_available() else [])},
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "shm_fs": shm.fs_type(args.shm_dir),
        "backend": args.backend, "unit_compiler": args.unit_compiler,
        "model": {"class": "transformers.MixtralForCausalLM", "dtype": args.dtype,
                  **{k: getattr(args, k) for k in MODEL_ARGS}},
        "results": rows, "files_left": left,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
