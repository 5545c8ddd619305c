"""The executor on a real accelerator with real streams (skipped without one): accuracy, memory, no round trips."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.tracking import compile_tracked, newest

from magi_core.api import handle, offload, release
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.config import OffloadConfig
from magi_core.execute.unit_compile import like_with_like
from magi_core.plugin.manager import get_backend

pytestmark = pytest.mark.accelerator


@pytest.fixture(scope="module")
def backend():
    b = get_backend()
    if not b.is_accelerator or int(b.device_module.device_count()) < 1:
        pytest.skip("needs a real accelerator (the active magi backend is the host)")
    return b


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("policy", ["BASE", "COST_EFFECTIVE", "HEURISTIC"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_relative_error_vs_resident(backend, dtype, tol, policy, ratio):
    spec = TransformerSpec(layers=4, hidden=512, heads=8, dtype=dtype)
    model = build_transformer(spec)
    x = example_input(spec, tokens=256)
    dev = backend.device()
    with torch.no_grad():
        ref = build_transformer(spec).to(dev)(x.to(dev))
    f = compile_tracked(model, options={"policy": policy, "gpu_resident_weight_ratio": ratio, "unit_compiler": "eager"})
    with torch.no_grad():
        for _ in range(4):
            out = f(x)
    assert out.device.type == backend.device_type
    assert _rel(out, ref) <= tol
    # weights stay on the host
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_inductor_units_match(backend):
    # like with like: Inductor-compiled units against the resident model compiled with Inductor
    spec = TransformerSpec(layers=3, hidden=256, heads=4, dtype=torch.bfloat16)
    model = build_transformer(spec)
    x = example_input(spec, tokens=128)
    dev = backend.device()
    with torch.no_grad(), like_with_like("inductor"):
        ref = torch.compile(build_transformer(spec).to(dev))(x.to(dev))
        torch._dynamo.reset()
        f = compile_tracked(model, options={"policy": "HEURISTIC", "unit_compiler": "inductor"})
        for _ in range(4):
            out = f(x)
    assert _rel(out, ref) <= 1e-2


def test_direct_unit_calls_on_the_device_match_wrapped_calls(backend):
    # the units' Inductor code called without Dynamo / AOT wrappers: same bits, every unit direct
    spec = TransformerSpec(layers=3, hidden=256, heads=4, dtype=torch.bfloat16)
    model = build_transformer(spec)
    x = example_input(spec, tokens=128)  # torch.compile(backend="magi_offload") takes host inputs
    outs, kinds = {}, {}
    with torch.no_grad():
        for direct in (True, False):
            torch._dynamo.reset()
            f = compile_tracked(model, options={
                "policy": "HEURISTIC", "gpu_resident_weight_ratio": 0.5, "unit_compiler": "inductor",
                "direct_unit_calls": direct})
            for _ in range(4):
                outs[direct] = f(x)
            kinds[direct] = list(newest().executor.direct_units)
    assert all(kinds[True]) and not any(kinds[False]), kinds
    assert torch.equal(outs[True], outs[False])


def test_peak_memory_at_ratio_zero_within_two_units_plus_activations(backend):
    dm = backend.device_module
    spec = TransformerSpec(layers=8, hidden=1024, heads=8, dtype=torch.bfloat16)
    model = build_transformer(spec)
    dev = backend.device()
    xd = example_input(spec, tokens=512).to(dev)  # device input: never copied to the host and back
    with torch.no_grad():
        ref = build_transformer(spec).to(dev)(xd)
    offload(model, OffloadConfig(policy="BASE", gpu_resident_weight_ratio=0.0, unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(3):
                model(xd)
            ex = handle(model).runtime.executor
            dm.synchronize()
            dm.reset_peak_memory_stats()
            base = dm.memory_allocated()
            out = model(xd)
            dm.synchronize()
            peak = dm.max_memory_allocated() - base
        assert out.device == xd.device
        assert ex.inputs.bytes_moved == 0, "device inputs must not be moved"
        assert ex.inputs.substituted >= 4, "the device input reaches the executor behind a host proxy"
        assert _rel(out, ref) <= 1e-2
        two_units = sum(sorted((u.nbytes for u in ex.units), reverse=True)[:2])
        act = 16 * xd.numel() * xd.element_size() + 4 * spec.ffn * 512 * 2  # generous activation allowance
        assert peak <= two_units + ex.actions.resident_bytes + act, (peak, two_units, act)
    finally:
        release(model)


class _KwTuple(torch.nn.Module):
    """Device input, a device tensor nested in keyword arguments, a lifted float, a tuple output."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.body = build_transformer(spec)

    def forward(self, x: torch.Tensor, *, extra: dict[str, torch.Tensor], eps: float = 1e-6):
        h = self.body(x + extra["shift"], eps)
        return h, h.float().mean(-1), extra["shift"]


@pytest.mark.parametrize("unit_compiler", ["eager", "inductor"])
def test_offload_device_inputs_kwargs_and_tuple_output(backend, unit_compiler):
    spec = TransformerSpec(layers=3, hidden=256, heads=4, dtype=torch.bfloat16)
    dev = backend.device()
    model = _KwTuple(spec).eval()
    ref_model = _KwTuple(spec).eval().to(dev)
    xd = example_input(spec, tokens=64).to(dev)
    shift = torch.randn(spec.hidden, generator=torch.Generator().manual_seed(5)).to(spec.dtype).to(dev)
    with torch.no_grad(), like_with_like(unit_compiler):
        run_ref = torch.compile(ref_model) if unit_compiler == "inductor" else ref_model
        refs = {eps: run_ref(xd, extra={"shift": shift}, eps=eps) for eps in (1e-6, 1e-3)}
    torch._dynamo.reset()
    offload(model, OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5, unit_compiler=unit_compiler))
    try:
        with torch.no_grad(), like_with_like(unit_compiler):
            for eps in (1e-6, 1e-3, 1e-6, 1e-3, 1e-6):
                h, m, s = model(xd, extra={"shift": shift}, eps=eps)
                assert h.device == xd.device and m.device == xd.device
                assert s is shift, "a pass-through device input comes back as itself"
                assert _rel(h, refs[eps][0]) <= 1e-2
                assert _rel(m, refs[eps][1]) <= 1e-2
        ex = handle(model).runtime.executor
        assert ex.inputs.bytes_moved == 0
        assert handle(model).runtime.phase == "planned"
    finally:
        release(model)


def test_host_inputs_are_moved_and_outputs_on_device(backend):
    spec = TransformerSpec(layers=2, hidden=128, heads=4)
    model = build_transformer(spec)
    x = example_input(spec, tokens=16)
    f = compile_tracked(model, options={"unit_compiler": "eager"})
    with torch.no_grad():
        for _ in range(3):
            out = f(x)
    assert out.device.type == backend.device_type
