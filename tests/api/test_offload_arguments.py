"""Wrong arguments to ``offload`` / ``load`` / ``compile_offloaded`` are errors naming the fix, raised before any
host work; the config is resolved once on its way in; the resident ratio keeps one meaning down to the planner."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ranges import registered_ranges
from torch import nn

import magi_core
import magi_core.api as api
import magi_core.compile.backend as compile_backend
import magi_core.config as config_module
from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError, MagiError
from magi_core.plan import register_policy, unregister_policy
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plan.registry import get_scheduler
from magi_core.plugin.manager import get_backend

CFG = OffloadConfig(unit_compiler="eager", warmup_calls=2)




class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return x


def _untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Nothing was done to the model: no handle, no host arena, the same tensors."""
    assert "_magi_offload_handle" not in model.__dict__ and model.__dict__.get("_compiled_call_impl") is None
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == {k: v.data_ptr() for k, v in before.items()}


@pytest.mark.parametrize(("call", "fix"), [
    (lambda m: magi_core.offload(m, {"policy": "BASE"}), "pass OffloadConfig(policy='BASE')"),
    (lambda m: magi_core.offload(m, "BASE"), "pass OffloadConfig(policy='BASE')"),
    (lambda m: magi_core.offload(m, policy="BASE"), "pass offload(model, OffloadConfig(policy='BASE'))"),
    (lambda m: magi_core.offload(m, CFG, pin=False), "host_options=magi_core.host.HostOptions(pin=False)"),
    (lambda m: magi_core.offload(m, CFG, no_such_argument=1), "passes only disable, dynamic, fullgraph"),
    (lambda m: magi_core.load(m, "model.safetensors", {"lookahead": 2}), "pass OffloadConfig(lookahead=2)"),
    (lambda m: magi_core.load(m, "model.safetensors", policy="BASE"),
     "pass load(model, source, OffloadConfig(policy='BASE'))"),
    (lambda m: magi_core.load(m, OffloadConfig()), "the source comes first"),
    (lambda m: api.compile_offloaded(m, {"policy": "BASE"}), "pass OffloadConfig(policy='BASE')"),
    (lambda m: api.compile_offloaded(m, policy="BASE"), "pass compile_offloaded(fn, OffloadConfig(policy='BASE'))"),
])
def test_wrong_arguments_name_the_fix_before_any_host_work(call: Any, fix: str) -> None:
    model = Stack().eval()
    before = dict(model.state_dict())
    ranges = registered_ranges()
    with pytest.raises(ConfigError) as info:
        call(model)
    assert fix in str(info.value), str(info.value)
    _untouched(model, before)
    assert registered_ranges() == ranges


def test_a_typo_in_the_policy_fails_where_the_config_is_built() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'HEURISTIC'\?"):
        magi_core.offload(Stack().eval(), OffloadConfig(policy="heuristc"))


# -- the config is resolved once on its way in -------------------------------------------------------------------

@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> list[OffloadConfig | None]:
    """Every call of the resolver (:func:`magi_core.config.resolve_config`), wherever it is imported."""
    calls: list[OffloadConfig | None] = []
    real = config_module.resolve_config

    def counting(config: OffloadConfig | None = None, *args: Any, **kwargs: Any) -> OffloadConfig:
        calls.append(config)
        return real(config, *args, **kwargs)

    for module in (config_module, api, compile_backend):
        monkeypatch.setattr(module, "resolve_config", counting)
    return calls


def test_offload_resolves_the_config_once(shm_dir: Path, resolutions: list[Any]) -> None:
    model = Stack().eval()
    magi_core.offload(model, CFG, methods=())
    try:
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(2, 16))
        assert len(resolutions) == 1, resolutions
        h = magi_core.handle(model)
        assert h.runtime.config is h.config  # the resolved object itself reaches the runtime
    finally:
        magi_core.release(model)


def test_load_resolves_the_config_once(shm_dir: Path, tmp_path: Path, resolutions: list[Any]) -> None:
    from safetensors.torch import save_file

    src = Stack().eval()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Stack().eval()
    magi_core.load(model, str(tmp_path / "model.safetensors"), CFG)
    try:
        x = torch.randn(2, 16)
        with torch.no_grad():
            torch.testing.assert_close(model(x).cpu(), src(x))
        assert len(resolutions) == 1, resolutions
    finally:
        magi_core.release(model)


def test_torch_compile_with_the_backend_resolves_once(resolutions: list[Any]) -> None:
    torch._dynamo.reset()
    model = Stack().eval()
    f = torch.compile(model, backend="magi_offload", options={"unit_compiler": "eager", "warmup_calls": 1})
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(f(x).cpu(), ref)
        torch.testing.assert_close(f(x).cpu(), ref)
    assert len(resolutions) == 1, resolutions
    torch._dynamo.reset()


# -- the resident ratio keeps its meaning: a share of all the model's weights -------------------------------------

class _Recording:
    """COST_EFFECTIVE, recording the config and the planned weight bytes of every plan it makes."""

    seen: list[tuple[float | None, float, int]] = []

    def plan(self, profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
        _Recording.seen.append((config.gpu_resident_weight_ratio, config.planned_resident_share,
                                sum(p.weight_bytes for p in profiles)))
        return get_scheduler("COST_EFFECTIVE").plan(profiles, bandwidth_Bps, config)


def test_a_second_input_shape_plans_with_the_same_ratio(shm_dir: Path) -> None:
    """A graph planned next to another of its model gets the user's ratio unchanged; the share of its remaining
    weights it may keep resident is a quantity of its own (``planned_resident_share``)."""
    register_policy("recording_ratio", _Recording, replace=True)
    _Recording.seen = []
    model = Stack(n=6).eval()
    total = sum(p.nbytes for p in model.parameters())
    try:
        magi_core.offload(model, OffloadConfig(policy="recording_ratio", gpu_resident_weight_ratio=0.5,
                                               unit_compiler="eager", warmup_calls=1), dynamic=False)
        with torch.no_grad():
            for _ in range(3):
                for rows in (2, 3):
                    x = torch.randn(rows, 16)
                    torch.testing.assert_close(model(x).cpu(), model.forward(x))
        assert magi_core.handle(model).compile_count == 2
        ratios = {ratio for ratio, _, _ in _Recording.seen}
        assert ratios == {0.5}, _Recording.seen  # never rewritten as a share of what is left
        later = [(share, planned) for _, share, planned in _Recording.seen if planned < total]
        assert later, _Recording.seen  # the second shape planned only what the first does not keep resident
        for share, planned in later:
            assert share != 0.5 and share * planned <= 0.5 * total
    finally:
        magi_core.release(model)
        unregister_policy("recording_ratio")


def test_planning_rest_keeps_every_field() -> None:
    cfg = OffloadConfig(gpu_resident_weight_ratio=0.5)
    rest = cfg.planning_rest(0.25)
    assert rest == cfg and rest.gpu_resident_weight_ratio == 0.5 and rest.resident_ratio == 0.5
    assert (cfg.planned_resident_share, rest.planned_resident_share) == (0.5, 0.25)
    assert rest.replace(lookahead=2).planned_resident_share == 0.5  # a replaced copy plans with the ratio again



# -- backward through an offloaded model says it is inference only ------------------------------------------------

class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.argmax(-1), {"sum": h.sum(-1)}  # type: ignore[return-value]


def test_backward_through_an_offloaded_model_says_inference_only(shm_dir: Path) -> None:
    model = Stack().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
    magi_core.offload(model, CFG)
    try:
        out = model(x)  # grad enabled, as a training loop would call it
        torch.testing.assert_close(out.detach().cpu(), ref)
        with pytest.raises(MagiError, match=r"Stack is offloaded, which is inference only.*Train without offloading"):
            out.pow(2).mean().backward()
        assert all(p.grad is None for p in model.parameters())
        out.add_(1)  # the output is still an ordinary tensor to compute with
        with torch.no_grad():
            assert not model(x).requires_grad  # no marking where no gradient is asked for
    finally:
        magi_core.release(model)


def test_every_floating_output_carries_the_error(shm_dir: Path) -> None:
    model = TwoOut().eval()
    x = torch.randn(2, 16)
    magi_core.offload(model, CFG)
    try:
        h, idx, extra = model(x)
        assert h.requires_grad and extra["sum"].requires_grad and not idx.requires_grad
        for t in (h, extra["sum"]):
            with pytest.raises(MagiError, match="inference only"):
                t.sum().backward()
    finally:
        magi_core.release(model)


def test_a_budget_share_without_a_device_size_is_refused_before_any_host_work(shm_dir: Path) -> None:
    """``device_memory_budget_bytes="40%"`` on a backend that cannot say how much memory its device has (the host
    backend) is a ConfigError from ``offload`` naming bytes instead, not one at the first planning call."""
    backend = get_backend()
    if backend.device_memory(backend.device()) is not None:
        pytest.skip(f"backend {backend.name!r} reports its device's memory: a share of it is a budget")
    model = Stack().eval()
    before = registered_ranges()
    with pytest.raises(ConfigError, match=r"'40%' is a share of the device's memory.*give bytes"):
        magi_core.offload(model, OffloadConfig(device_memory_budget_bytes="40%"))
    assert registered_ranges() == before and list(shm_dir.iterdir()) == []
    assert "_magi_offload_handle" not in model.__dict__

