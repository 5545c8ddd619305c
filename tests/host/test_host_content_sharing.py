"""Share by content, per tensor, across the ranks of a node (torchrun, gloo; 2 and 4 ranks, one launch each).

Every scenario of tests/host_workers/content_worker.py runs in one process per rank: identical weights, all
different, experts different + dense identical (with and without the EP hint), on_mismatch='error', and a
model built on the meta device loaded from a sharded safetensors checkpoint, from a function declared
identical across ranks, from a function whose experts depend on the rank, and from one that fails on one rank.
Each rank's weights must equal its own model's; host bytes per node (the report, and the proportional set size
of the mappings measured in /proc) must be the bytes of the distinct tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from host_workers.common import LOG_DIR, WORKERS, child_env, failure_report, results, shm_dir_fixture  # noqa: F401

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

PAGE = 4096
# tensor bytes of the worker's model: what every rank holds alike ("dense") and what depends on its experts
DENSE = 256 * 256 * 4 + 256 * 4 + 512 * 64 * 4 + 64 * 4  # dense.weight, dense.bias, emb.weight, scale
EXPERTS = 4 * 128 * 64 * 2 + 4 * 64 * 4  # experts (bf16), router.weight
W = DENSE + EXPERTS
CHECKPOINT = W - 256 * 256 * 2  # dense.weight is stored in bf16 and converted to the model's float32


def _launch(nproc: int, shm_dir: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--log-dir", str(out / LOG_DIR), "--redirects", "3", str(WORKERS / "content_worker.py"), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=child_env(shm_dir, MAGI_PIN_CONCURRENCY="2"), capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("torchrun did not finish within 300s\n" + failure_report(exc, out)) from None
    assert proc.returncode == 0, failure_report(proc, out)
    return results(out, nproc)


def _check_memory(recs: list[dict], name: str, distinct: int) -> None:
    """The report's node bytes, and the measured proportional set size of every rank's arena mappings."""
    for r in recs:
        nb = r[name]["node_bytes"]
        assert nb["distinct"] == distinct, (name, r["rank"], nb)
        assert nb["all_shared"] == W and nb["all_private"] == len(recs) * W and nb["ranks"] == len(recs)
        assert r[name]["own_values"], f"{name}: rank {r['rank']} computes with other values than its own model's"
        assert r[name]["registered_after"] == 0 and r[name]["dir_after"] == []
    files = len({i for r in recs for i in r[name]["inodes"]})
    pss = sum(r[name]["pss"] for r in recs)  # a page mapped by k ranks counts 1/k on each: one copy in total
    assert distinct <= pss <= distinct + files * (PAGE + 8 * 256), (name, pss, distinct, files)


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_tensor_shared_once_per_distinct_content(nproc: int, shm_dir: str, tmp_path: Path) -> None:
    recs = _launch(nproc, shm_dir, tmp_path)

    _check_memory(recs, "identical", W)
    assert all(r["identical"]["mode"] == "shared" and r["identical"]["own_bytes"] == 0 for r in recs)
    assert len({tuple(r["identical"]["inodes"]) for r in recs}) == 1  # the same files on every rank

    _check_memory(recs, "different", nproc * W)
    assert all(r["different"]["mode"] == "per_rank" and r["different"]["own_bytes"] == W for r in recs)

    for name in ("experts", "experts_hint"):  # 2 distinct expert shards: rank % 2 (4 ranks: {0, 2} and {1, 3})
        _check_memory(recs, name, DENSE + 2 * EXPERTS)
        assert all(r[name]["mode"] == "mixed" and r[name]["own_bytes"] == EXPERTS for r in recs)
        # pinning in waves of MAGI_PIN_CONCURRENCY=2 ranks per node
        assert [(r[name]["pin"]["wave"], r[name]["pin"]["waves"]) for r in recs] == [(i // 2, nproc // 2)
                                                                                      for i in range(nproc)]
        if nproc == 4:  # ranks holding the same experts map one copy of them
            assert {a for a in recs[0][name]["arenas"] if "-r" in a} == {"bfloat16-r0.2", "float32-r0.2"}
            assert {a for a in recs[1][name]["arenas"] if "-r" in a} == {"bfloat16-r1.3", "float32-r1.3"}

    for r in recs:  # on_mismatch='error': every rank raises naming the tensors; nothing left, nothing changed
        e = r["error"]
        assert e["error"] == "WeightMismatchError" and "'experts'" in e["message"], e
        assert e["values_unchanged"] and e["same_objects"] and e["dir_after"] == [] and e["registered_after"] == 0

    _check_memory(recs, "load_files", W)  # one copy, each tensor read by one rank of the node
    assert sum(r["load_files"]["load"]["bytes_read"] for r in recs) == CHECKPOINT
    assert sum(r["load_files"]["load"]["tensors"] for r in recs) == 6  # dense.weight, dense.bias, ... (7 names)
    assert all(r["load_files"]["mode"] == "shared" and r["load_files"]["on_host"] for r in recs)

    _check_memory(recs, "load_fn_same", W)  # declared identical: one call per tensor per node, no comparison
    assert sum(r["load_fn_same"]["load"]["bytes_read"] for r in recs) == W
    assert all(r["load_fn_same"]["mode"] == "shared" for r in recs)

    _check_memory(recs, "load_fn_rank", DENSE + 2 * EXPERTS)  # undeclared: compared, shared where equal
    assert all(r["load_fn_rank"]["mode"] == "mixed" for r in recs)

    for r in recs:  # one rank's function has no value for a tensor: every rank raises, the model stays on meta
        f = r["load_fail"]
        assert f["error"] in ("WeightSourceError", "MagiError"), f
        assert "'router.weight'" in f["message"] or f"rank {nproc - 1}" in f["message"], f["message"]
        assert f["still_meta"] and f["same_objects"] and f["dir_after"] == [] and f["registered_after"] == 0
    last = recs[-1]["load_fail"]
    assert last["error"] == "WeightSourceError" and "'router.weight'" in last["message"]
