"""Weight transfers: one copy per weight, or one copy per arena span with a view per weight."""

from __future__ import annotations

import pytest
import torch
from helpers.copying import CopyingSpanTransfer
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.execute import executor as executor_mod
from magi_core.execute.transfer import PerTensorTransfer, SpanTransfer, plan_span
from magi_core.plugin.manager import get_backend

SPEC = TransformerSpec(layers=3, hidden=32, heads=2)




def _arena(*shapes: tuple[int, ...], gap: int = 64, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    item = dtype.itemsize
    sizes = [int(torch.Size(s).numel()) * item for s in shapes]
    buf = torch.zeros(sum(sizes) + gap * len(shapes), dtype=torch.uint8)
    out, off = [], 0
    for s, n in zip(shapes, sizes, strict=True):
        out.append(buf[off:off + n].view(dtype).view(s))
        off += n + gap
    for k, t in enumerate(out):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(k)))
    return out


def test_span_covers_a_batch_of_one_arena_with_its_gaps() -> None:
    ws = _arena((8, 4), (16,), (3, 5))
    plan = plan_span(ws)
    assert plan is not None
    assert plan.host.numel() == ws[-1].data_ptr() + ws[-1].nbytes - ws[0].data_ptr()
    t = SpanTransfer(get_backend(), get_backend().device())
    outs, _ = t.fetch(ws)
    assert t.copy_calls == 1 and t.copies == 3
    for o, w in zip(outs, ws, strict=True):
        assert o.shape == w.shape and o.stride() == w.stride() and o.dtype == w.dtype
        assert torch.equal(o.cpu(), w)


def test_no_span_for_separate_storages_loose_layouts_or_one_weight() -> None:
    assert plan_span([torch.randn(4), torch.randn(4)]) is None  # two storages
    assert plan_span(_arena((4,), (4,), gap=10_000)) is None  # more gap than weights
    assert plan_span(_arena((4, 4))) is None  # one weight: nothing to merge
    buf = torch.zeros(64, dtype=torch.uint8)
    w = [buf[2:4].view(torch.int16), buf[4:20].view(torch.float32)]
    assert plan_span(w) is None  # the float32 starts 2 bytes into the span: no float32 view of it can hold it
    t = SpanTransfer(get_backend(), get_backend().device())
    outs, _ = t.fetch(w)
    assert t.copy_calls == 2 and all(torch.equal(o.cpu(), x) for o, x in zip(outs, w, strict=True))


@pytest.mark.parametrize("policy,ratio", [("BASE", 0.0), ("HEURISTIC", 0.0), ("HEURISTIC", 0.5)])
def test_offloaded_model_with_span_copies(shm_dir: str, monkeypatch: pytest.MonkeyPatch, policy: str,
                                          ratio: float) -> None:
    monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", CopyingSpanTransfer)
    torch._dynamo.reset()
    model, ref = build_transformer(SPEC), build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    magi_core.offload(model, magi_core.OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio,
                                                     unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-4, atol=1e-4)
            ex = magi_core.handle(model).runtime.executor
            assert isinstance(ex.transfer, SpanTransfer)
            calls, copies = ex.transfer.copy_calls, ex.transfer.copies
            model(x)
            per_step_calls = ex.transfer.copy_calls - calls
            per_step_weights = ex.transfer.copies - copies
            assert per_step_weights > per_step_calls >= 1, "a unit's weights come in one copy, not one each"
            for m in (model, ref):  # an edit is still seen through span copies
                with torch.no_grad():
                    m.blocks[1].mlp.up.weight.mul_(2.0)  # type: ignore[index, union-attr]
            torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-4, atol=1e-4)
    finally:
        magi_core.release(model)


def test_config_chooses_the_transfer(shm_dir: str) -> None:
    for kind, cls in (("per_tensor", PerTensorTransfer), ("span", SpanTransfer)):
        torch._dynamo.reset()
        model = build_transformer(SPEC)
        x = example_input(SPEC, tokens=5)
        magi_core.offload(model, magi_core.OffloadConfig(transfer=kind, unit_compiler="eager"))
        try:
            with torch.no_grad():
                model(x)
            t = magi_core.handle(model).runtime.executor.transfer
            assert type(t) is cls
            assert (t.copy_calls == t.copies) == (kind == "per_tensor")
        finally:
            magi_core.release(model)
    assert magi_core.OffloadConfig().transfer == "per_tensor"
    with pytest.raises(magi_core.ConfigError, match="transfer"):
        magi_core.OffloadConfig(transfer="bulk")


def test_release_hands_device_tensors_to_record_stream_and_host_tensors_to_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the CPU backend record_stream is never called; an accelerator facade over the host module (device type
    # meta) shows the release reaching Tensor.record_stream on the compute stream, exactly for device tensors.
    import dataclasses

    cpu = get_backend()
    if cpu.is_accelerator:
        pytest.skip("builds an accelerator facade from the CPU backend's")
    acc = dataclasses.replace(cpu, device_type="meta")
    calls: list[tuple[torch.Tensor, object]] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: calls.append((self, stream)))
    stream = cpu.device_module.current_stream()
    dev, host = torch.empty(4, device="meta"), torch.empty(4)
    for backend in (acc, cpu):
        PerTensorTransfer(backend, torch.device(backend.device_type)).release(dev, stream)
        backend.record_stream(host, stream)
    assert len(calls) == 1 and calls[0][0] is dev and calls[0][1] is stream
