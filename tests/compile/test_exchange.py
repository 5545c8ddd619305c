"""Weight exchange across the ranks of a node (OffloadConfig.exchange): shards from the host, the rest gathered.

Two ranks under torchrun with gloo on the CPU backend run every scenario of tests/helpers/exchange_worker.py in
one launch; single-process tests cover the plan digest, the shard arithmetic and the config.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from host_workers.common import LOG_DIR, child_env, failure_report, shm_dir_fixture  # noqa: F401  (fixture)

import magi_core
from magi_core.compile.exchange import exchange_transfer
from magi_core.execute.actions import StepActions
from magi_core.execute.transfer.exchange import plan_fingerprint
from magi_core.plugin.manager import get_backend

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "exchange_worker.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("exchange")
    shm = out / "shm"
    shm.mkdir()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    shm_dir = base / f"magi-exchange-{out.name}"
    shm_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir",
           str(out / LOG_DIR), "--redirects", "3", str(WORKER), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=child_env(str(shm_dir), MAGI_EXCHANGE_TIMEOUT_S="20"), capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the exchange ranks did not finish in 300 s\n" + failure_report(exc, out)) from None
    assert proc.returncode == 0, failure_report(proc, out)
    try:
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        for f in shm_dir.iterdir():  # a rank that left on purpose may leave its files for the next start
            f.unlink()
        shm_dir.rmdir()


def test_identical_weights_are_exchanged_and_equal_the_plain_path_bit_for_bit(two_ranks: list[dict]) -> None:
    for rec in two_ranks:
        same = rec["same"]
        assert same["type"] == "ExchangeTransfer" and same["exchanges"] > 0
        assert same["equal_plain"] and same["err"] < 1e-5
        # each rank read about half of what the plain path read from the host; the rest came from the other
        assert same["bytes_copied"] < 0.6 * same["plain_bytes_copied"]
        assert same["bytes_gathered"] >= 0.4 * same["plain_bytes_copied"]


def test_weights_that_differ_between_ranks_are_copied_whole(two_ranks: list[dict]) -> None:
    for rec in two_ranks:
        differ = rec["differ"]
        assert differ["err"] < 1e-5, "each rank computes with its own weights"
        assert differ["type"] == "ExchangeTransfer"


def test_a_weight_rebound_on_one_rank_after_planning_is_agreed_again(two_ranks: list[dict]) -> None:
    for rec in two_ranks:
        assert "error" not in rec["rebind"], rec["rebind"]
        assert rec["rebind"]["err"] < 1e-5, "each rank computes with its own weights after the rebind"


def test_ratio_one_ranks_split_alike_when_one_card_cannot_hold_the_graph_whole(two_ranks: list[dict]) -> None:
    for rec in two_ranks:
        whole = rec["whole"]
        assert "error" not in whole, whole
        assert whole["err"] < 1e-5 and whole["type"] == "ExchangeTransfer"
    assert two_ranks[0]["whole"]["units"] == two_ranks[1]["whole"]["units"] > 1


def test_ranks_that_disagree_on_the_plan_fail_instead_of_hanging(two_ranks: list[dict]) -> None:
    for rec in two_ranks:
        assert "different offload plan" in rec["disagree"], rec["disagree"]


def test_a_rank_that_leaves_is_an_error_on_the_other(two_ranks: list[dict]) -> None:
    rec = two_ranks[0]
    assert rec["dead"].startswith("ExchangeDisagreement: rank 0") and rec["dead_after_s"] < 60, rec


def test_plan_digest_sees_every_difference_that_changes_the_collectives() -> None:
    def acts(batches: tuple[tuple[int, ...], ...], issue: tuple[tuple[int, ...], ...]) -> StepActions:
        return StepActions(resident=(), batches=batches, batch_unit=tuple(range(len(batches))), start=(),
                           carry=(), issue=issue, wait=tuple(() for _ in issue),
                           free=tuple((w,) for ws in batches for w in ws)[: len(issue)],
                           streamed_bytes=0, resident_bytes=0)

    a = acts(((0,), (1,)), ((0,), (1,)))
    assert plan_fingerprint(a, [[8], [8]]) == plan_fingerprint(a, [[8], [8]])
    assert plan_fingerprint(a, [[8], [8]]) != plan_fingerprint(a, [[8], [16]])  # bytes
    assert plan_fingerprint(a, [[8], [8]]) != plan_fingerprint(acts(((0,), (1,)), ((0, 1), ())), [[8], [8]])


def test_exchange_config(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    backend = get_backend()
    assert magi_core.OffloadConfig().exchange == "off"
    with pytest.raises(magi_core.ConfigError, match="exchange"):
        magi_core.OffloadConfig(exchange="always")
    # one process, no process group: "auto" does not exchange (and says why on the host backend), "on" says
    # what it needs
    with caplog.at_level(logging.INFO, logger="magi_core.compile.exchange"):
        assert exchange_transfer(magi_core.OffloadConfig(exchange="auto"), backend, backend.device(), None) is None
    assert backend.is_accelerator or "only between accelerators" in caplog.text
    with pytest.raises(magi_core.ConfigError, match="torchrun"):
        exchange_transfer(magi_core.OffloadConfig(exchange="on"), backend, backend.device(), None)
    assert not torch.distributed.is_initialized()


def test_without_a_device_all_gather_auto_falls_back_and_on_says_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An accelerator whose process group is gloo (no device all-gather magi-core knows): "auto" copies per rank
    # with a warning, "on" is a config error naming the backends that work.
    import dataclasses

    import magi_core.compile.exchange as exchange_mod

    cpu = get_backend()
    if cpu.is_accelerator:
        pytest.skip("builds an accelerator facade from the CPU backend's")
    acc = dataclasses.replace(cpu, device_type="meta")
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(exchange_mod, "node_groups", lambda: (dist.group.WORLD, dist.group.WORLD))
        with caplog.at_level(logging.WARNING, logger="magi_core.compile.exchange"):
            cfg = magi_core.OffloadConfig(exchange="auto")
            assert exchange_transfer(cfg, acc, torch.device("meta"), None) is None
        assert "no device all-gather" in caplog.text and "nccl" in caplog.text
        with pytest.raises(magi_core.ConfigError, match="nccl"):
            exchange_transfer(magi_core.OffloadConfig(exchange="on"), acc, torch.device("meta"), None)
    finally:
        dist.destroy_process_group()
