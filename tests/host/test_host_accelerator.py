"""Host weights on a real accelerator: in-place pinning through the backend, copies, moves, cycles, two ranks.

Bandwidth targets (shared mapping >= 0.97x pinned memcpy, per-GPU rate with two ranks) are measured by
``benchmarks/host_bandwidth.py``, not asserted here.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from host_workers.common import assert_ok, results, shm_dir_fixture, torchrun  # noqa: F401  (fixture)
from torch import nn

from magi_core import get_backend
from magi_core.host import HostOptions, HostWeights, materialize

pytestmark = pytest.mark.accelerator
OPTS = HostOptions(progress=False)


@pytest.fixture
def dev() -> torch.device:
    """The accelerator device 0 (skips without one)."""
    be = get_backend()
    if not be.is_accelerator or be.device_module.device_count() < 1:
        pytest.skip(f"needs an accelerator (backend {be.name!r})")
    return be.device(0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)  # ~16 MiB


def _copies_exact(hw: HostWeights, m: nn.Module, ref: dict[str, torch.Tensor], dev: torch.device) -> None:
    """Every weight is pinned (for us and for the runtime) and its non_blocking copy on a side stream is exact."""
    dm = get_backend().device_module
    stream = dm.Stream()
    with dm.stream(stream):
        on_dev = {k: v.to(dev, non_blocking=True) for k, v in m.state_dict().items()}
    stream.synchronize()
    for k, v in m.state_dict().items():
        assert hw.is_pinned(v), k
        assert v.is_pinned(), k  # the runtime itself sees the registered range as pinned
        assert torch.equal(on_dev[k].cpu(), ref[k]), k


def test_weights_pinned_in_place_and_copy_non_blocking(dev: torch.device, shm_dir: str) -> None:
    m = _model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    with materialize(m, options=OPTS) as hw:
        assert hw.pinned_bytes >= hw.weight_bytes
        _copies_exact(hw, m, ref, dev)


def test_pieces_pinned_while_filling_copy_non_blocking(dev: torch.device, shm_dir: str,
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An arena registered in many pieces while a checkpoint is read into it by four threads (each tensor in one
    piece): the runtime sees every tensor as pinned and copies it exactly, asynchronously."""
    from safetensors.torch import save_file

    from magi_core.host import pinning

    monkeypatch.setattr(pinning, "AHEAD_GROUP", 64 << 10)
    ref = _model().state_dict()
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in ref.items()}, str(path))
    with torch.device("meta"):
        m = _model()
    with materialize(m, options=HostOptions(progress=False, load_threads=4), source=str(path)) as hw:
        assert hw.report["pin"]["ahead_bytes"] == hw.pinned_bytes >= hw.weight_bytes
        assert len(hw.pinned_ranges) >= 8  # about one piece per 2 MiB weight with its bias
        _copies_exact(hw, m, ref, dev)


def test_model_to_device_keeps_host_weights(dev: torch.device, shm_dir: str) -> None:
    m = _model()
    with materialize(m, options=OPTS) as hw:
        m.register_buffer("extra", torch.ones(3))  # added after offloading: moves
        m.to(dev)
        assert all(p.device.type == "cpu" and hw.owns(p) for p in m.parameters())
        assert m.extra.device.type == dev.type


def test_device_resident_model_materialises_to_host(dev: torch.device, shm_dir: str) -> None:
    m = _model().to(dev)
    ref = {k: v.cpu() for k, v in m.state_dict().items()}
    with materialize(m, options=OPTS):
        for k, v in m.state_dict().items():
            assert v.device.type == "cpu" and torch.equal(v, ref[k]), k


def test_five_materialise_release_cycles(dev: torch.device, shm_dir: str) -> None:
    m = _model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    for _ in range(5):
        hw = materialize(m, options=OPTS)
        x = m[0].weight.to(dev, non_blocking=True)
        get_backend().device_module.synchronize()
        assert torch.equal(x.cpu(), ref["0.weight"])
        del x
        hw.release(restore=True)
        gc.collect()
        assert hw.unmapped()
        probe = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)  # failed when a mapping leaked registered
        probe.fill_(1)
        del probe
    assert all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("shared_writes", ["read_only", "copy_on_write"])
def test_two_ranks_share_one_file(dev: torch.device, shm_dir: str, tmp_path: Path, shared_writes: str) -> None:
    """Two ranks on the accelerator (one device each, or both on one through gloo) map one file; with the default
    read_only isolation the node holds the weights once, pinned; copy_on_write's private mappings are copied by a
    registration that writes (CUDA's), and the rank is told so (private_copy_bytes)."""
    proc = torchrun(2, ["--scenario", "shared", "--dense-mb", "64", "--device", "--shared-writes", shared_writes],
                    shm_dir, tmp_path)
    assert_ok(proc, tmp_path)
    recs = results(tmp_path, 2)
    assert recs[0]["inodes"] == recs[1]["inodes"] and all(r["mode"] == "shared" for r in recs)
    weights = recs[0]["weight_bytes"]
    if shared_writes == "copy_on_write":
        for r in recs:  # what pinning made private is what the rank was told (CUDA: every page, 2 copies)
            assert r["private_copy_bytes"] is not None, r
            assert abs(r["private_copy_bytes"] - r["arena_smaps"]["Anonymous"]) <= 2**20, r
            assert r["dense_after"] == r["dense_before"] and r["dir_after"] == []
        return
    for r in recs:
        assert r["device_copy_ok"] and r["host_after_to"]
        assert r["pinned_bytes"] >= r["weight_bytes"]
        assert r["dense_after"] == r["dense_before"] and r["dir_after"] == []
    # Only the arena mappings: Pss_Shmem of the whole process also counts the driver's pinned staging and IPC
    # mappings on a GPU host (that made a 64 MiB model look like 110 MB here).
    for r in recs:
        assert r["arena_smaps"]["Anonymous"] == 0 and r["private_copy_bytes"] in (0, None), r
        assert r["arena_mappings"] >= r["arenas"] >= 1, r  # registering may split a mapping in two
        assert r["arena_rss"] >= weights, r
    pss = sum(r["arena_pss"] for r in recs)
    assert 0.9 * weights <= pss <= 1.2 * weights, (pss, weights, [{k: r.get(k) for k in (
        "pss_shmem", "arena_smaps", "meminfo", "thp_shmem", "shm_mount")} for r in recs])
