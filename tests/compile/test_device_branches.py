"""Device-type branches in model code: reported when the host and the target device decide them differently.

The CPU backend runs where it traces, so these tests make the run target another device type by replacing
:func:`magi_core.compile.device_branches.target_device_type` ("magidev" is a made-up accelerator; "cuda"
stands for a real one, as transformers / diffusers code names it).
"""

from __future__ import annotations

import logging
import types
import warnings

import pytest
import torch
from torch import nn

import magi_core.compile.device_branches as db
from magi_core.compile.device_branches import DeviceBranchWarning, device_branch_reasons, warn_device_branches


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(db, "_warned", set())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- the patterns, read from code objects ------------------------------------------------------------------
def type_eq(x):
    if x.device.type == "cuda":
        return x * 2
    return x


def type_in_tuple(x):
    if x.device.type in ("cuda", "xpu"):
        return x * 2
    return x


def type_in_set(x):
    if x.device.type in {"xpu", "cuda"}:
        return x * 2
    return x


def str_device(x):
    if str(x.device) == "cuda:0":
        return x * 2
    return x


def str_device_startswith(x):
    if str(x.device).startswith("cuda"):
        return x * 2
    return x


def device_eq_torch_device(x):
    if x.device == torch.device("cuda"):
        return x * 2
    return x


def get_device(x):
    if x.get_device() >= 0:
        return x * 2
    return x


def is_flag(x):
    if x.is_cuda:
        return x * 2
    return x


def not_cpu(x):
    if x.device.type != "cpu":
        return x * 2
    return x


def via_variable(x):
    kind = x.device.type
    if kind == "cuda":
        return x * 2
    return x


HAZARDS = [type_eq, type_in_tuple, type_in_set, str_device, str_device_startswith, device_eq_torch_device,
           get_device, is_flag, not_cpu, via_variable]


@pytest.mark.parametrize("fn", HAZARDS, ids=lambda f: f.__name__)
def test_each_pattern_is_a_hazard_for_its_device(fn: types.FunctionType) -> None:
    reasons = device_branch_reasons(fn.__code__, "cuda")
    assert reasons, f"{fn.__name__} branches on the device type"
    assert "on cuda" in reasons[0]
    assert not device_branch_reasons(fn.__code__, "cpu"), "on the host backend every branch runs as traced"


def mps_only(x):
    if x.device.type == "mps":  # transformers / diffusers style: False on the host and on "cuda"
        return x * 2
    if x.is_mps or str(x.device).startswith("mps") or x.device.type in ("mps", "meta"):
        return x * 3
    return x


def harmless(x):
    y = x.to("cuda") if x.device is not None else x  # no comparison with a device name
    return y + 1


@pytest.mark.parametrize("fn", [mps_only, harmless], ids=lambda f: f.__name__)
def test_decided_the_same_on_host_and_target_is_silent(fn: types.FunctionType) -> None:
    assert not device_branch_reasons(fn.__code__, "cuda")
    assert not device_branch_reasons(fn.__code__, "magidev")


def test_target_decides_what_matters() -> None:
    assert not device_branch_reasons(type_in_tuple.__code__, "magidev")
    assert device_branch_reasons(type_in_tuple.__code__, "xpu")
    assert device_branch_reasons(get_device.__code__, "magidev"), "get_device() differs on every accelerator"
    assert device_branch_reasons(not_cpu.__code__, "magidev"), "a test against 'cpu' differs on every accelerator"
    # no target known: every test that is not constant is reported
    assert device_branch_reasons(mps_only.__code__)


def test_warns_through_warnings_and_logging_once_per_function(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=db.__name__), pytest.warns(DeviceBranchWarning) as record:
        messages = warn_device_branches([type_eq.__code__, mps_only.__code__], target="cuda")
    assert len(messages) == 1 and "type_eq" in messages[0] and "device-type branch" in messages[0]
    assert record[0].filename == __file__ and record[0].lineno == type_eq.__code__.co_firstlineno
    assert any("type_eq" in r.getMessage() for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_device_branches([type_eq.__code__], target="cuda") == []  # once per function


# -- through a real compile ---------------------------------------------------------------------------------
class TargetBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "magidev":
            return self.lin(x) * 2
        return self.lin(x)


class MpsBranch(TargetBranch):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "mps":
            return self.lin(x) * 2
        return self.lin(x)


def _compile_and_run(model: nn.Module) -> list[warnings.WarningMessage]:
    f = torch.compile(model, backend="magi_offload", options={"unit_compiler": "eager"})
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        f(torch.randn(2, 4))
    return [w for w in record if issubclass(w.category, DeviceBranchWarning)]


def test_compile_warns_for_a_branch_on_the_target_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db, "target_device_type", lambda: "magidev")
    found = _compile_and_run(TargetBranch())
    assert len(found) == 1 and "'magidev'" in str(found[0].message) and "forward" in str(found[0].message)


def test_compile_is_silent_for_an_mps_test_on_another_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db, "target_device_type", lambda: "magidev")
    assert _compile_and_run(MpsBranch()) == []


def test_compile_on_the_cpu_backend_is_silent() -> None:
    if db.target_device_type() != "cpu":
        pytest.skip("runs on the CPU backend")
    assert _compile_and_run(TargetBranch()) == []
