"""Device inputs of offloaded models: host proxies for Dynamo, the real tensors swapped in by the executor.

On the CPU backend there are no device tensors, so "device" inputs here are distinct host tensors that the
wrapper is told to treat as device tensors; on an accelerator backend (e.g. the emulated magidev device of
examples/privateuse1) they are real device tensors (``.to(device)`` of the same host tensors). Proxies are
filled with NaN, so any read of one would show in the outputs.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from helpers.ranges import registered_ranges
from helpers.tracking import compile_tracked, newest
from test_executor_models import Breaks, PassThrough, TupleKw

from magi_core.api import handle, offload, release
from magi_core.compile.device_inputs import (
    ProxyPool,
    current_substitutions,
    replace_device_tensors,
    restore_device_tensors,
    substituting,
)
from magi_core.config import OffloadConfig
from magi_core.errors import MagiError
from magi_core.plugin.manager import get_backend

CFG = OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5, unit_compiler="eager", warmup_calls=2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the active backend's device (the same objects on the CPU backend)."""
    device = get_backend().device()
    return tuple(t.to(device) for t in tensors)


def _marked(*tensors: torch.Tensor):
    """A predicate that calls exactly these tensors "device" tensors."""
    ids = {id(t) for t in tensors}
    return lambda t: id(t) in ids


def test_replace_gives_distinct_proxies_reused_across_calls_and_restores():
    pool = ProxyPool()
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    scalar = torch.tensor(1.5)
    host = torch.randn(4)
    Pair = collections.namedtuple("Pair", "left right")
    value = (a, [b, a], {"k": Pair(b, host)}, scalar)
    is_dev = _marked(a, b)

    def once():
        subs, seen, used = {}, {}, {}
        out = replace_device_tensors(value, is_dev, pool, subs, seen, used)
        return out, subs

    out, subs = once()
    pa, (pb, pa2), inner, s = out
    assert pa is pa2, "the same device tensor twice gets the same proxy (aliasing kept)"
    assert pa is not pb and pa.device.type == "cpu"
    assert (pa.shape, pa.stride(), pa.dtype) == (a.shape, a.stride(), a.dtype)
    assert isinstance(inner["k"], Pair) and inner["k"].left is pb and inner["k"].right is host
    assert s is scalar, "0-dim host scalars are untouched"
    assert subs == {id(pa): a, id(pb): b}
    assert restore_device_tensors((pb, [pa, host]), subs) == (b, [a, host])
    out2, subs2 = once()
    assert out2[0] is pa and out2[1][0] is pb, "proxies are cached and reused across calls"
    assert len(pool) == 2
    t = torch.randn(3, 2).t()  # non-contiguous layout gets its own proxy with the same strides
    p = replace_device_tensors(t, _marked(t), pool, {}, {}, {})
    assert p.stride() == t.stride() and len(pool) == 3


def test_substitution_map_is_scoped_and_thread_local():
    import threading

    assert current_substitutions() is None
    x = torch.ones(1)
    seen = []
    with substituting({1: x}):
        assert current_substitutions() == {1: x}
        t = threading.Thread(target=lambda: seen.append(current_substitutions()))
        t.start()
        t.join()
        with substituting({2: x}):
            assert current_substitutions() == {2: x}
        assert current_substitutions() == {1: x}
    assert current_substitutions() is None
    assert seen == [None]


def test_executor_takes_the_substituted_tensor_never_the_proxy():
    model = TupleKw().eval()
    x, bias = torch.randn(2, 4, 16), torch.randn(16)
    with torch.no_grad():
        ref = model(x, bias=bias, scale=2.0)
    f = compile_tracked(model, options=CFG.to_dict())
    proxy = torch.full_like(x, math.nan)
    (xd,) = _on_device(x)
    for _ in range(4):
        with substituting({id(proxy): xd}):
            out = f(proxy, bias=bias, scale=2.0)
        torch.testing.assert_close(out[0].cpu(), ref[0])
        torch.testing.assert_close(out[1].cpu(), ref[1])
    ex = newest().executor
    assert ex.inputs.substituted == 4
    assert torch.isnan(proxy).all()


def test_offload_with_device_inputs_kwargs_and_pass_through_outputs():
    before = registered_ranges()
    model = PassThrough().eval()
    x, bias, skip = torch.randn(2, 4, 16), torch.randn(16), torch.randn(3)
    with torch.no_grad():
        ref = model(x, extra={"bias": bias, "skip": skip}, scale=0.5)
    xd, biasd, skipd = _on_device(x, bias, skip)
    try:
        offload(model, CFG)
        h = handle(model)
        assert h.host is not None
        fwd = h.forward
        assert fwd is not None and model._compiled_call_impl is fwd
        fwd.is_device = _marked(xd, biasd, skipd)  # on the CPU backend: treat these host tensors as device tensors
        fwd.pool = ProxyPool(fill_value=math.nan)  # any read of a proxy would produce NaN
        with torch.no_grad():
            for _ in range(5):
                out, x_out, skip_out = model(xd, extra={"bias": biasd, "skip": skipd}, scale=0.5)
                torch.testing.assert_close(out.cpu(), ref[0])
                assert x_out is xd and skip_out is skipd, "pass-through outputs are the device tensors"
        ex = h.runtime.executor
        assert h.compile_count == 1, "reused proxies: no recompiles"
        assert fwd.substituted_calls == 5
        assert ex.inputs.substituted >= 5 and ex.inputs.bytes_moved == 0
        assert len(fwd.pool) == 3 and all(torch.isnan(p).all() for p in fwd.pool.proxies())
    finally:
        release(model, restore=True)
    assert h.released and h.host is not None and h.host.released
    assert registered_ranges() == before


def test_graph_break_in_offloaded_forward_says_how_to_fix():
    model = Breaks().eval()
    try:
        offload(model, CFG)
        with pytest.raises(MagiError, match="one graph") as info, torch.no_grad():
            model(torch.randn(2, 16))
        assert "graph_break" in str(info.value) and "offload() the submodules" in str(info.value)
    finally:
        release(model, restore=True)


def test_offload_refuses_fullgraph_false():
    from magi_core.errors import ConfigError

    with pytest.raises(ConfigError, match="fullgraph"):
        offload(TupleKw().eval(), CFG, fullgraph=False)


# -- every kind of graph break gets magi's help, with advice for its kind -------------------------------------
class _Branchy(torch.nn.Module):
    """A forward that cannot compile to one graph, in the way ``kind`` says."""

    def __init__(self, kind: str, d: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.kind == "item":
            if y.sum().item() > 0:
                return y * 2
        elif self.kind == "bool":
            if y.sum() > 0:
                return y * 2
        elif self.kind == "int":
            for _ in range(int(y.abs().sum().item()) % 3 + 1):
                y = y + 1
        elif self.kind == "print":
            print("step")
        elif self.kind == "break":
            torch._dynamo.graph_break()
        return y


@pytest.mark.parametrize(
    ("kind", "advice", "cause"),
    [
        ("item", "a Python branch on a tensor value (.item(), bool(tensor)", "UserError"),
        ("bool", "use torch.where / torch.cond", "Unsupported"),
        ("int", "use torch.where / torch.cond", "UserError"),
        ("print", "a print / logging call", "Unsupported"),
        ("break", "an explicit graph break", "Unsupported"),
    ],
)
def test_graph_breaks_of_every_kind_get_specific_advice(kind, advice, cause):
    model = _Branchy(kind).eval()
    try:
        offload(model, CFG)
        with pytest.raises(MagiError, match="ONE graph") as info, torch.no_grad():
            model(torch.randn(2, 16))
        msg = str(info.value)
        assert advice in msg and "offload() the submodules" in msg and "Dynamo said:" in msg
        assert type(info.value.__cause__).__name__ == cause
    finally:
        release(model, restore=True)


def test_recompile_limit_gets_its_own_advice():
    model = _Branchy("none").eval()
    try:
        offload(model, CFG, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
            model(torch.randn(2, 16))
            with pytest.raises(MagiError, match="recompile_limit") as info:
                model(torch.randn(3, 16))
        assert "mark_dynamic" in str(info.value)
    finally:
        release(model, restore=True)


def test_graph_break_classes_and_advice_read_the_cause_chain():
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from magi_core.compile.device_inputs import (
        ADVICE_DATA_DEPENDENT,
        graph_break_advice,
        graph_break_classes,
        is_graph_break,
    )

    assert {torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError} <= set(graph_break_classes())
    for inner in (GuardOnDataDependentSymNode("u0 > 0"), DataDependentOutputException("aten._local_scalar_dense")):
        try:
            try:
                raise inner
            except RuntimeError as e:
                raise torch._dynamo.exc.TorchRuntimeError("while tracing") from e
        except RuntimeError as outer:
            assert is_graph_break(outer) and graph_break_advice(outer) == ADVICE_DATA_DEPENDENT
    assert not is_graph_break(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_errors_that_are_not_graph_breaks_pass_through_unwrapped():
    model = _Branchy("none").eval()
    try:
        offload(model, CFG)
        with pytest.raises(RuntimeError, match="must have same reduction dim") as info, torch.no_grad():
            model(torch.randn(2, 5))  # wrong feature size: the user's bug, not a graph break
        assert not isinstance(info.value, MagiError)
    finally:
        release(model, restore=True)


def test_magi_error_raised_by_the_backend_comes_out_unwrapped(monkeypatch):
    import magi_core.compile.handle as handle_module
    from magi_core.errors import ConfigError

    def refusing(*args, **kwargs):
        raise ConfigError("the backend refused this graph")

    monkeypatch.setattr(handle_module, "magi_offload_backend", refusing)
    model = _Branchy("none").eval()
    try:
        offload(model, CFG)
        with pytest.raises(ConfigError, match="refused this graph"), torch.no_grad():
            model(torch.randn(2, 16))  # not torch._dynamo.exc.BackendCompilerFailed
    finally:
        release(model, restore=True)
