"""``magi_core.api.offload``: host weights, forward through magi_offload, model stays a usable nn.Module."""

from __future__ import annotations

import torch

from magi_core.api import handle, offload, release
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.config import OffloadConfig
from magi_core.plugin.cpu import registered_ranges
from magi_core.plugin.manager import get_backend


def test_offload_keeps_module_and_runs_through_backend():
    torch._dynamo.reset()
    before = registered_ranges()
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec)
    keys = set(model.state_dict())
    x = example_input(spec, tokens=6)
    with torch.no_grad():
        ref = model(x)
    try:
        out_model = offload(model, OffloadConfig(policy="COST_EFFECTIVE", gpu_resident_weight_ratio=0.5,
                                                 unit_compiler="eager"))
        assert out_model is model and type(model).__name__ == "SyntheticTransformer"
        assert len(registered_ranges()) > len(before), "weights should sit in registered host arenas"
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(model(x), ref)
        assert handle(model).compile_count == 1
        rt = handle(model).runtime
        assert rt.phase == "planned" and str(rt.config.policy) == "COST_EFFECTIVE"
        assert set(model.state_dict()) == keys
        model.to(get_backend().device())  # offloaded weights stay on the host
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        release(model, restore=True)
        torch._dynamo.reset()
    assert registered_ranges() == before
    torch.testing.assert_close(model.state_dict()["norm.weight"], model.norm.weight)
