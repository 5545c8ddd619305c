"""Expert parallelism with a real library MoE (transformers' Mixtral) on 4 gloo ranks on CPU, one torchrun launch.

tests/host_workers/moe_worker.py builds a tiny ``MixtralForCausalLM`` on the meta device on every rank and fills
it through ``magi_core.load`` from a function seeded by name: dense tensors identical on every rank, expert
tensors seeded by the rank's expert-parallel group (EP 1, 4 and 2 in turn; EP 2: ranks {0, 2} and {1, 3} hold
the same experts). Each rank's offloaded logits must equal its own eager fp32 model's; host bytes per node must
be the dense tensors once plus every distinct expert shard once: in the sharing report and measured (the
proportional set size of the arena mappings and ``Pss_Shmem`` of /proc/self/smaps_rollup summed over the ranks,
the bytes the shm file system allocated to the arena files), with no private (anonymous) copy. The predecessor's
rule (rank 0's file for everyone) would have given the ranks outside rank 0's EP group other logits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch
from host_workers.common import LOG_DIR, WORKERS, child_env, failure_report, results

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

NPROC = 4
PAGE = 4096
# the worker's default Mixtral: vocab 256, hidden 64, intermediate 128, 2 layers, 4 heads (dim 16), 2 kv heads,
# 8 experts; float32
V, H, FF, L, E, HEAD, KV = 256, 64, 128, 2, 8, 16, 2
EXPERTS = 4 * L * E * (2 * FF * H + H * FF)  # experts.gate_up_proj + experts.down_proj
DENSE = 4 * (2 * V * H + L * (2 * H * H + 2 * KV * HEAD * H + E * H + 2 * H) + H + 2 * HEAD // 2)  # + rotary buffers
W = DENSE + EXPERTS


@pytest.fixture(scope="module")
def recs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, list[dict]]]:
    """Every rank's record per EP size, from one launch of 4 ranks; the shm dir must be empty afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    shm_dir = os.path.join(base, f"magi-test-moe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(shm_dir)
    out = tmp_path_factory.mktemp("moe")
    env = child_env(shm_dir)
    for var in ("MAGI_EP_SIZE", "MAGI_SKIP_SHM", "MAGI_PIN_CONCURRENCY", "MAGI_PIN_BUDGET_GB"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           "--log-dir", str(out / LOG_DIR), "--redirects", "3", str(WORKERS / "moe_worker.py"), "--out", str(out),
           "--ep", "1", "4", "2"]
    try:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError("torchrun did not finish within 300s\n" + failure_report(exc, out)) from None
        assert proc.returncode == 0, failure_report(proc, out)
        assert os.listdir(shm_dir) == [], "files left under the shm dir"
        per_rank = results(out, NPROC)
        yield {s["ep"]: [r["scenarios"][i] for r in per_rank] for i, s in enumerate(per_rank[0]["scenarios"])}
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.parametrize("ep", [1, 4, 2])
def test_every_rank_computes_with_its_own_experts(recs: dict[int, list[dict]], ep: int) -> None:
    for r in recs[ep]:
        assert r["group"] == r["rank"] % ep
        assert r["own_values"], f"rank {r['rank']} holds other values than its own model's"
        assert r["offloaded_vs_eager"]["max_abs_diff"] <= 1e-5 * max(1.0, r["offloaded_vs_eager"]["max_abs"]), r
        assert r["experts_equal_rank0"] == (r["group"] == 0)
    digests = {r["rank"]: r["logits_digest"] for r in recs[ep]}  # same inputs: same EP group, same logits
    for a in range(NPROC):
        for b in range(NPROC):
            assert (digests[a] == digests[b]) == (a % ep == b % ep), (ep, digests)


@pytest.mark.parametrize("ep", [1, 4, 2])
def test_host_bytes_per_node_are_the_distinct_tensors(recs: dict[int, list[dict]], ep: int) -> None:
    rs = recs[ep]
    distinct = DENSE + ep * EXPERTS
    for r in rs:
        assert r["weight_bytes"] == W and r["expert_bytes"] == EXPERTS
        assert r["node_bytes"] == {"distinct": distinct, "all_shared": W, "all_private": NPROC * W, "ranks": NPROC}
        assert r["mode"] == ("shared" if ep == 1 else "mixed")
        assert r["own_bytes"] == (0 if ep == 1 else EXPERTS)
        assert r["shm_dir_files"] == {} and r["dir_after_release"] == []  # arena files are unlinked once mapped
    files = len({f["inode"] for r in rs for f in r["files"]})
    slack = files * PAGE + 8 * 256
    pss = sum(r["mapping_memory"]["Pss"] for r in rs)  # a page mapped by k ranks counts 1/k on each
    rounding = 1024 * sum(r["mapping_memory"]["mappings"] for r in rs)  # smaps rounds each mapping's Pss to kB
    assert distinct - rounding <= pss <= distinct + slack, (pss, distinct)
    shmem = sum(r["smaps_rollup"]["after"]["Pss_Shmem"] - r["smaps_rollup"]["before"]["Pss_Shmem"] for r in rs)
    assert abs(shmem - distinct) <= slack + 64 * 1024, (shmem, distinct)
    mapped = {i: f for r in rs for i, f in r["shm_files_mapped"].items()}  # the (unlinked) arena files, by inode
    assert len(mapped) == files
    allocated = sum(f["allocated"] for f in mapped.values())
    assert distinct <= allocated <= distinct + slack, (allocated, distinct)
    if ep > 1:  # the per-tensor layout against one private copy per rank and against rank 0's file for everyone
        assert pss < 0.95 * NPROC * W and distinct > W
    if ep != 1:  # after the warm-up (EP 1): loading leaves no private copy of the weights
        for r in rs:
            anon = r["smaps_rollup"]["loaded"]["Anonymous"] - r["smaps_rollup"]["before"]["Anonymous"]
            assert anon < W // 2, (r["rank"], anon, W)


@pytest.mark.parametrize("ep", [4, 2])
def test_rank0_file_for_everyone_gives_wrong_outputs(recs: dict[int, list[dict]], ep: int) -> None:
    """The predecessor's rule (all-shared bytes: rank 0's file mapped by every rank) computes rank 0's experts."""
    for r in recs[ep]:
        wrong = r["wrong_vs_eager"]
        if r["group"] == 0:
            assert wrong["max_abs_diff"] == 0.0 and r["wrong_logits_digest"] == r["logits_digest"]
        else:
            assert wrong["max_abs_diff"] > 0.05 * wrong["max_abs"] and wrong["argmax_changed"] > 0, r
            assert r["wrong_logits_digest"] != r["logits_digest"]
