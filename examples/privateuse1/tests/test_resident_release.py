"""Issue 14, item 4: a resident copy dropped because its host tensor was replaced is freed stream-ordered.

At ratio 1 every weight is resident: copied once on the copy stream, read by every unit on the compute stream.
When ``param.data`` is replaced, ``ResidentSet.fill`` drops the old host tensor's device copy and copies the new
one. The old copy must go back to the allocator ordered after the compute stream's queued reads
(``transfer.release``: ``record_stream`` on the compute stream); dropped bare, the caching allocator of a real
device could hand its block to the next copy while the previous step's kernels still read it. On magidev the
stream-ordering checker (``torch_magidev.checker``) flags that as a ``free`` violation.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch_magidev
from torch import nn
from torch_magidev import checker

import magi_core
from magi_core.plugin.manager import use_backend


@pytest.fixture
def backend():
    b = use_backend("magidev")
    checker.clear()
    try:
        yield b
    finally:
        use_backend(None)
        checker.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def test_a_replaced_resident_weight_is_freed_after_the_compute_streams_reads(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("MAGI_SHM_DIR", str(tmp_path))
    torch._dynamo.reset()
    gc.collect()
    model = _model()
    x = torch.randn(4, 16)
    cfg = magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=1.0, unit_compiler="eager",
                                  bandwidth_probe_bytes=1 << 20)
    magi_core.offload(model, cfg)
    try:
        with torch.no_grad():
            for _ in range(3):  # warm-up, then steady state: every weight resident, nothing streamed
                out = model(x)
            del out
            gc.collect()
            assert checker.violations() == [], "steady state is already out of order (see the checker's messages)"
            before = torch_magidev.memory_allocated()
            lin = model[2]
            new_weight = lin.weight.detach() * -1.0 + 0.25
            lin.weight.data = new_weight  # a new host tensor: the resident copy of the old one is dropped
            reference = _model()
            reference[2].weight.data = new_weight.clone()
            ref = reference(x)
            for _ in range(2):
                out = model(x)
                torch.testing.assert_close(out.cpu(), ref)
            del out
        gc.collect()
        found = checker.violations()
        assert found == [], "\n".join(str(v) for v in found)
        assert torch_magidev.memory_allocated() <= before, "the old resident copy was not freed"
    finally:
        magi_core.release(model, restore=True)
        torch._dynamo.reset()
        gc.collect()
    checker.assert_clean()


@pytest.mark.parametrize("transfer", ["unit", "per_tensor"])
def test_release_leaves_no_mapping_held_by_the_last_steps_copies(backend, tmp_path, monkeypatch, caplog, transfer):
    """The copy transfer keeps the host views its queued copies read until they are done; closing the model must
    wait for them and drop those views, or ``release`` finds the mappings still viewed and leaves them mapped."""
    monkeypatch.setenv("MAGI_SHM_DIR", str(tmp_path))
    torch._dynamo.reset()
    gc.collect()
    model = _model()
    x = torch.randn(4, 16)
    ref = model(x)
    cfg = magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.0, unit_compiler="eager",
                                  bandwidth_probe_bytes=1 << 20, transfer=transfer)
    magi_core.offload(model, cfg)
    host = magi_core.handle(model).host
    try:
        with torch.no_grad():
            for _ in range(3):
                out = model(x)
            torch.testing.assert_close(out.cpu(), ref)
            del out
    finally:
        with caplog.at_level("WARNING", logger="magi_core.host.materialize"):
            magi_core.release(model, restore=True)
        torch._dynamo.reset()
        gc.collect()
    assert host.report["released"]["still_mapped"] == 0
    assert not [r for r in caplog.records if "stay mapped" in r.getMessage()]
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(model(x), ref)  # restored: the model runs on the host as before
    checker.assert_clean()
