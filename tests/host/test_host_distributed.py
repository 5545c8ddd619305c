"""Host materialisation across ranks (torchrun, gloo): one shared file for identical weights, full-content checks
(sampled and every byte), isolation of in-place writes, and cleanup after a rank is killed mid-materialisation.
Sharing per tensor by content (identical, all different, experts different + dense identical, EP hint, pin
waves, weights loaded from a source) is in test_host_content_sharing.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from host_workers.common import assert_ok, results, shm_dir_fixture, torchrun  # noqa: F401  (fixture)
from torch import nn

from magi_core.host import HostOptions, materialize, shm

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]


def _run(nproc: int, args: list[str], shm_dir: str, tmp_path: Path, **env: str) -> list[dict]:
    proc = torchrun(nproc, args, shm_dir, tmp_path, **env)
    assert_ok(proc, tmp_path)
    return results(tmp_path, nproc)


def test_shared_file_across_ep_corrupts_experts(shm_dir: str, tmp_path: Path) -> None:
    """The per-rank switch forced off: rank 1 silently gets rank 0's experts (the old bug the test above catches)."""
    recs = _run(2, ["--scenario", "ep", "--unsafe"], shm_dir, tmp_path, MAGI_EP_SIZE="2")
    assert recs[0]["mode"] == "shared" and recs[0]["inodes"] == recs[1]["inodes"]
    assert recs[1]["experts_after"] != recs[1]["experts_before"]
    assert recs[1]["experts_after"] == recs[0]["experts_before"]


@pytest.mark.parametrize("writes", ["read_only", "copy_on_write"])
def test_ep1_one_shared_file_one_copy_in_memory(writes: str, shm_dir: str, tmp_path: Path) -> None:
    """Either isolation keeps one copy per node while nobody writes (CPU backend: pinning is bookkeeping)."""
    recs = _run(2, ["--scenario", "shared", "--dense-mb", "16", "--shared-writes", writes], shm_dir, tmp_path)
    assert recs[0]["mode"] == recs[1]["mode"] == "shared"
    assert recs[0]["mappings"] == recs[1]["mappings"] == [writes]
    assert recs[0]["inodes"] == recs[1]["inodes"]
    weights = recs[0]["weight_bytes"]
    if writes == "copy_on_write" and any(r["private_copy_bytes"] for r in recs):
        # a backend that pins for write (CUDA) gave each rank its own copy: reported
        assert all(r["private_copy_bytes"] >= weights // 2 for r in recs)
        return
    for r in recs:  # each rank has all of the one file resident, mapped once per arena
        assert r["arena_mappings"] == r["arenas"] >= 1 and r["arena_rss"] >= weights, r
    pss = sum(r["arena_pss"] for r in recs)  # proportional share: a page mapped by both counts once in total
    assert 0.9 * weights <= pss <= 1.2 * weights, (pss, weights)
    for r in recs:
        assert r["dense_after"] == r["dense_before"] and r["experts_after"] == r["experts_before"]
        assert r["file_modes"] == [0o600] and r["files_unlinked"] and r["dir_after"] == []
        assert r["registered_after_release"] == 0


def test_ep1_pin_that_copies_shared_pages_is_reported(shm_dir: str, tmp_path: Path) -> None:
    """copy_on_write with a backend that pins for write (CUDA registers for writing): each rank ends up with its
    own copy; that is measured and reported (with the way out), never silent."""
    recs = _run(2, ["--scenario", "shared", "--privatising-pin", "--shared-writes", "copy_on_write"], shm_dir,
                tmp_path)
    for r in recs:
        assert r["mode"] == "shared" and r["mappings"] == ["copy_on_write"]
        assert r["private_copy_bytes"] >= r["weight_bytes"] // 2, r["private_copy_bytes"]
        assert r["dense_after"] == r["dense_before"]
    logs = "".join(p.read_text() for p in (tmp_path / "torchrun-logs").rglob("*.log"))
    assert logs.count("made this rank a private copy") == 2 and "shared_writes='read_only'" in logs
    clean = _run(2, ["--scenario", "shared"], shm_dir, tmp_path / "plain")
    assert all(r["private_copy_bytes"] == 0 for r in clean)  # the CPU backend's pin copies nothing


def test_ep1_sparse_difference_found_by_full_check(shm_dir: str, tmp_path: Path) -> None:
    """One embedding row (64 of 262144 elements) differs on rank 1: the sampled fingerprint agrees, the full
    comparison does not. on_mismatch='error': every rank raises naming the tensor and the fix, nothing left behind;
    'copy' (the default): rank 1 keeps its own embedding in a file of its own, every other tensor stays shared
    (before: it silently computed with rank 0's)."""
    recs = _run(2, ["--scenario", "sparse"], shm_dir, tmp_path)
    assert recs[0]["emb_before"] != recs[1]["emb_before"]
    for r in recs:
        assert r["error"] == "WeightMismatchError", r.get("message")
        assert "'emb.weight'" in r["message"] and "rank 1 differs from rank 0" in r["message"], r["message"]
        assert "MAGI_EP_SIZE" in r["message"] and "on_mismatch='copy'" in r["message"]
        assert r["values_unchanged_after_error"] and r["files_after_error"] == [] and r["registered_after_error"] == 0
        assert r["emb_after"] == r["emb_before"], f"rank {r['rank']} computes with another rank's embedding"
        assert r["dense_after"] == r["dense_before"] and r["mode"] == "mixed"
        assert r["dir_after"] == [] and r["registered_after_release"] == 0
    assert set(recs[0]["inodes"]) < set(recs[1]["inodes"])  # the node's files, and rank 1's own for its embedding


def test_a_problem_of_one_ranks_model_raises_on_every_rank(shm_dir: str, tmp_path: Path) -> None:
    """Rank 0's model holds a meta tensor: rank 0 raises its HostStateError and rank 1 one naming rank 0, at once
    (before: rank 1 waited in the first gather until the process group's timeout), nothing left behind."""
    recs = _run(2, ["--scenario", "meta"], shm_dir, tmp_path)
    assert [r["error"] for r in recs] == ["HostStateError", "HostStateError"], [r.get("message") for r in recs]
    assert "meta" in recs[0]["message"] and "rank 0: HostStateError" in recs[1]["message"]
    for r in recs:
        assert r["values_unchanged_after_error"] and r["files_after_error"] == [] and r["registered_after_error"] == 0
        assert r["dir_after"] == [] and r["registered_after_release"] == 0


def test_ranks_call_their_models_independently(shm_dir: str, tmp_path: Path) -> None:
    """Rank 0 calls its offloaded model seven times with two shapes (planning both), rank 1 twice: neither waits
    for the other inside a call (before: planning broadcast rank 0's timings and rank 0's link rate, so rank 0's
    third call waited for rank 1's, which never came, until the process group's timeout)."""
    proc = torchrun(2, [], shm_dir, tmp_path, timeout=150, worker="calls_worker.py")
    assert_ok(proc, tmp_path)
    recs = results(tmp_path, 2)
    assert [r["calls"] for r in recs] == [7, 2] and all(r["max_abs_diff"] <= 1e-6 for r in recs), recs
    assert recs[0]["phases"] == ["planned", "planned"] and recs[1]["phases"] == ["profile"]


def test_ep1_sampled_check_alone_misses_a_sparse_difference(shm_dir: str, tmp_path: Path) -> None:
    """verify_shared='sampled' (the old check, kept as an opt-out): the same run shares silently and rank 1
    computes with rank 0's embedding. This is why 'full' is the default."""
    recs = _run(2, ["--scenario", "sparse", "--verify", "sampled"], shm_dir, tmp_path)
    assert [r["error"] for r in recs] == [None, None] and recs[1]["mode"] == "shared"
    assert recs[1]["emb_after"] == recs[0]["emb_before"] != recs[1]["emb_before"]


def test_ep1_reader_refuses_a_shared_file_changed_after_it_was_written(shm_dir: str, tmp_path: Path) -> None:
    """Another process rewrites the shared file between the writer's copy and rank 1's map: rank 1's sampled check
    (verify_shared='sampled', which has no full comparison behind it) refuses it before swapping anything in, and
    every rank fails instead of rank 1 computing with the rewritten weights. (The writer's own weights live in the
    file by then: a rewrite reaches them whatever a reader checks.)"""
    recs = _run(2, ["--scenario", "tamper", "--verify", "sampled"], shm_dir, tmp_path)
    assert recs[1]["error"] == "WeightMismatchError", recs[1].get("message")
    assert "the shared file holds other values" in recs[1]["message"]
    assert recs[1]["values_unchanged_after_error"] and recs[1]["files_after_error"] == []
    assert recs[0]["error"] is not None and "rank 1" in recs[0]["message"]
    assert recs[1]["dense_after"] == recs[1]["dense_before"] and recs[1]["emb_after"] == recs[1]["emb_before"]


@pytest.mark.parametrize("mode", ["read_only", "copy_on_write"])
def test_ep1_write_on_one_rank_never_reaches_another(mode: str, shm_dir: str, tmp_path: Path) -> None:
    """Rank 0 writes in place into a shared parameter (add_(100)) and a buffer (+= 1) after materialising.
    read_only: the write kills the writing process (SIGSEGV, here in forked children of rank 0) and changes
    nothing anywhere. copy_on_write: rank 0 sees its own write, rank 1 does not. Before: rank 1 saw it."""
    recs = _run(2, ["--scenario", "write", "--shared-writes", mode], shm_dir, tmp_path)
    assert recs[0]["mode"] == recs[1]["mode"] == "shared" and recs[0]["inodes"] == recs[1]["inodes"]
    assert recs[1]["bias_delta"] == 0.0 and recs[1]["router_delta"] == 0.0, "rank 0's write reached rank 1"
    if mode == "read_only":
        assert recs[0]["mappings"] == recs[1]["mappings"] == ["read_only"]
        assert recs[0]["param_write_child"] == recs[0]["buffer_write_child"] == -signal.SIGSEGV
        assert recs[0]["bias_delta"] == 0.0 and recs[0]["router_delta"] == 0.0
        # each rank was told with the way to edit weights that works: the workers configure no logging, so
        # only records of WARNING and above reach their output (Python's last-resort handler)
        logs = "".join(p.read_text() for p in (tmp_path / "torchrun-logs").rglob("*.log"))
        told = [line for line in logs.splitlines() if "are read-only: an in-place write" in line]
        assert len(told) == 2 and all("shared_writes='copy_on_write'" in line and "MAGI_EP_SIZE" not in line
                                      for line in told), told
        # one read-only file: the bytes are the same on both ranks, so the exchange may treat them as one
        assert recs[0]["bias_identity"] == recs[1]["bias_identity"] != "None"
    else:
        assert recs[0]["mappings"] == recs[1]["mappings"] == ["copy_on_write"]
        assert recs[0]["bias_delta"] == pytest.approx(100.0, rel=1e-5)  # rank 0 sees its own writes
        assert recs[0]["router_delta"] == pytest.approx(1.0, rel=1e-5)
        # same file and offset, other bytes: copy-on-write pages have no identity, so rank 0's edited bias is never
        # exchanged with rank 1 (which holds the original) as if it were the file's
        assert recs[0]["bias_identity"] == recs[1]["bias_identity"] == "None", recs
    for r in recs:
        assert r["dense_after"] == r["dense_before"] and r["dir_after"] == [] and r["registered_after_release"] == 0


def test_killed_rank_files_removed_at_next_start_live_ones_kept(shm_dir: str, tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        start = shm.process_start_time(sleeper.pid)
        assert start is not None
        live = os.path.join(shm_dir, shm.file_name(shm.Owner(sleeper.pid, start, "other", "abc123"), "node0-float32"))
        with open(live, "wb") as f:
            f.write(b"x")
        proc = torchrun(2, ["--scenario", "crash"], shm_dir, tmp_path)
        assert proc.returncode != 0
        left = sorted(set(os.listdir(shm_dir)) - {os.path.basename(live)})
        assert left, "the killed writer should have left its file behind"
        for name in left:
            fields = shm.parse_name(name)
            assert fields is not None and not shm.pid_alive(int(fields["pid"]), int(fields["start"]))
        model = nn.Linear(4, 4)
        with materialize(model, options=HostOptions(progress=False)) as hw:
            removed = sorted(os.path.basename(p) for p in hw.report["stale_removed"])
        assert removed == left
        assert os.listdir(shm_dir) == [os.path.basename(live)]
    finally:
        sleeper.kill()
        sleeper.wait()
    deadline = time.monotonic() + 10
    while shm.process_start_time(sleeper.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm.cleanup_stale(shm_dir) == [live]
