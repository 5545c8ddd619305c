"""One rank's bad input raises on every rank at once (torchrun, gloo, 2 and 4 ranks): a missing or truncated
checkpoint, options that do not resolve (the environment) or are not HostOptions. Before, that rank raised alone
and the others waited in the first collective until the process group's timeout. The workers use a 20 s timeout,
so a regression fails instead of hanging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_workers.common import assert_ok, results, shm_dir_fixture, torchrun  # noqa: F401  (fixture)
from safetensors.torch import save_file

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

#: What the bad rank raises, and what its message holds.
EXPECT = {"missing": ("WeightSourceError", "absent.safetensors"),
          "truncated": ("WeightSourceError", "truncated"),
          "env": ("ConfigError", "MAGI_PIN_CONCURRENCY"),
          "object": ("ConfigError", "takes a magi_core.host.HostOptions, got dict")}
BAD_RANK = {"missing": lambda w: w - 1, "truncated": lambda w: 0, "env": lambda w: 1, "object": lambda w: w - 1}


@pytest.mark.parametrize("nproc", [2, 4])
def test_one_ranks_bad_input_raises_on_every_rank_at_once(nproc: int, shm_dir: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt" / "model.safetensors"
    ckpt.parent.mkdir()
    sd = {"0.weight": torch.ones(16, 16), "0.bias": torch.arange(16, dtype=torch.float32),
          "1.weight": torch.ones(4, 16), "1.bias": torch.zeros(4)}
    save_file(sd, str(ckpt))
    (ckpt.parent / "truncated.safetensors").write_bytes(ckpt.read_bytes()[:-8])
    proc = torchrun(nproc, ["--ckpt", str(ckpt)], shm_dir, tmp_path, timeout=200, worker="setup_worker.py")
    assert_ok(proc, tmp_path)
    recs = results(tmp_path, nproc)
    for scenario, (cls, text) in EXPECT.items():
        bad = BAD_RANK[scenario](nproc)
        for r in recs:
            out = r[scenario]
            assert out["error"] == cls, (scenario, r["rank"], out)
            if r["rank"] == bad:
                assert text in out["message"], (scenario, out["message"])
            else:  # names the rank whose input failed, and its error
                assert f"rank {bad}: {cls}" in out["message"] and text in out["message"], (scenario, out["message"])
            assert out["seconds"] < 10, f"{scenario}: rank {r['rank']} waited {out['seconds']:.1f}s"
            assert out["still_meta"] and out["registered"] == 0 and out["files"] == [], (scenario, out)
    for r in recs:
        assert r["loaded"] and r["dir_after"] == [] and r["registered_after"] == 0
