"""Each small model of :mod:`helpers.models` runs offloaded as it runs eagerly, whatever share of it stays
resident; tied weights stay one tensor; a graph break is an error naming the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import Breaks, MixedStack, PassThrough, TableStack, TiedLM, TupleKw
from torch import nn

import magi_core
from magi_core.config import OffloadConfig
from magi_core.errors import MagiError

# -- each model runs offloaded as it runs eagerly ---------------------------------------------------------------------

def _inputs(name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g)
    if name == "TiedLM":
        return (torch.randint(0, 50, (2, 5), generator=g),), {}
    if name == "TableStack":
        return (torch.randn(3, 64, generator=g),), {}
    if name == "TupleKw":
        return (x,), {"bias": torch.randn(16, generator=g), "scale": 0.5}
    if name == "PassThrough":
        return (x,), {"extra": {"bias": torch.randn(16, generator=g), "skip": torch.randn(4, generator=g)},
                      "scale": 2.0}
    return (x,), {}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "TiedLM": TiedLM, "MixedStack": MixedStack, "TableStack": TableStack, "TupleKw": TupleKw,
    "PassThrough": PassThrough,
}




def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_host(v) for v in value)
    return value


@pytest.mark.parametrize("ratio", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_runs_offloaded_as_eagerly(name: str, ratio: float, shm_dir: Path) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    args, kwargs = _inputs(name)
    with torch.no_grad():
        ref = model(*args, **kwargs)
    magi_core.offload(model, OffloadConfig(policy="BASE", gpu_resident_weight_ratio=ratio, unit_compiler="eager",
                                           warmup_calls=1))
    try:
        with torch.no_grad():
            for _ in range(3):  # warm-up, profiling, then the planned step
                torch.testing.assert_close(_host(model(*args, **kwargs)), ref, rtol=1e-5, atol=1e-5)
        stats = magi_core.handle(model).stats()[-1]
        assert stats.phase == "planned"
        assert (stats.streamed_bytes_per_step == 0) if ratio == 1.0 else (stats.streamed_bytes_per_step or 0) > 0
    finally:
        magi_core.release(model)


def test_tied_weights_stay_one_tensor(shm_dir: Path) -> None:
    model = TiedLM().eval()
    magi_core.offload(model, OffloadConfig(unit_compiler="eager", gpu_resident_weight_ratio=0.0))
    try:
        assert model.head.weight is model.emb.weight
        assert len(magi_core.handle(model).host.arenas) >= 1
        with torch.no_grad():
            model.emb.weight.mul_(2)  # an edit through one name is seen through the other
            ids, = _inputs("TiedLM")[0]
            out = model(ids).cpu()
        twin = TiedLM().eval()
        twin.load_state_dict({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            torch.testing.assert_close(out, twin(ids), rtol=1e-5, atol=1e-5)
    finally:
        magi_core.release(model)


def test_a_graph_break_is_an_error_naming_the_fix(shm_dir: Path) -> None:
    model = Breaks().eval()
    magi_core.offload(model, OffloadConfig(unit_compiler="eager"))
    try:
        with pytest.raises(MagiError, match="graph break"), torch.no_grad():
            model(torch.randn(2, 16))
    finally:
        magi_core.release(model)
