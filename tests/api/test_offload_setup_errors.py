"""One rank's bad argument to ``offload`` / ``load`` raises on every rank at once (torchrun, gloo, 2 ranks): a
dict for the config, a policy from the environment no scheduler answers to, an OffloadConfig setting passed as a
keyword, a method the model lacks, the config where the checkpoint belongs. The workers use a 20 s process-group
timeout, so a rank left waiting in a collective fails the test instead of hanging it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_workers.common import assert_ok, results, shm_dir_fixture, torchrun  # noqa: F401  (fixture)
from safetensors.torch import save_file

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

#: What every rank raises, and what the message holds.
EXPECT = {"dict": ("ConfigError", "pass OffloadConfig(policy='BASE')"),
          "env": ("ConfigError", "MAGI_OFFLOAD_POLICY"),
          "kwarg": ("ConfigError", "pass offload(model, OffloadConfig(policy='BASE'))"),
          "methods": ("ConfigError", "has no method 'decode'"),
          "load": ("ConfigError", "the source comes first")}
BAD_RANK = {"dict": lambda w: 0, "env": lambda w: w - 1, "kwarg": lambda w: 1, "methods": lambda w: 0,
            "load": lambda w: w - 1}


def test_one_ranks_bad_argument_raises_on_every_rank_at_once(shm_dir: str, tmp_path: Path) -> None:
    nproc = 2
    ckpt = tmp_path / "model.safetensors"
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(ckpt))
    proc = torchrun(nproc, ["--ckpt", str(ckpt)], shm_dir, tmp_path, timeout=200, worker="offload_setup_worker.py")
    assert_ok(proc, tmp_path)
    for r in results(tmp_path, nproc):
        for scenario, (cls, text) in EXPECT.items():
            bad = BAD_RANK[scenario](nproc)
            out = r[scenario]
            assert out["error"] == cls, (scenario, r["rank"], out)
            assert text in out["message"], (scenario, r["rank"], out["message"])
            if r["rank"] != bad:  # names the rank whose argument failed
                assert f"rank {bad}: {cls}" in out["message"] and "every rank raises" in out["message"], out
            assert out["seconds"] < 10, f"{scenario}: rank {r['rank']} waited {out['seconds']:.1f}s"
            assert out["registered"] == 0 and out["files"] == [], (scenario, out)
        assert r["offloaded"] and r["dir_after"] == [] and r["registered_after"] == 0
