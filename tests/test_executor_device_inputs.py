"""Device inputs of offloaded models: host proxies for Dynamo, the real tensors swapped in by the executor.

CPU CI has no device tensors, so "device" inputs here are distinct host tensors that the wrapper is told to
treat as device tensors; proxies are filled with NaN, so any read of one would show in the outputs.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
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
from magi_core.plugin.cpu import registered_ranges

CFG = OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5, unit_compiler="eager", warmup_calls=2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
    for _ in range(4):
        with substituting({id(proxy): x}):
            out = f(proxy, bias=bias, scale=2.0)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])
    ex = newest().executor
    assert ex.inputs.substituted == 4
    assert torch.isnan(proxy).all()


def test_offload_with_device_inputs_kwargs_and_pass_through_outputs():
    before = registered_ranges()
    model = PassThrough().eval()
    x, bias, skip = torch.randn(2, 4, 16), torch.randn(16), torch.randn(3)
    with torch.no_grad():
        ref = model(x, extra={"bias": bias, "skip": skip}, scale=0.5)
    try:
        offload(model, CFG)
        h = handle(model)
        assert h.host is not None
        fwd = h.forward
        assert fwd is not None and model._compiled_call_impl is fwd
        fwd.is_device = _marked(x, bias, skip)  # treat these host tensors as device tensors
        fwd.pool = ProxyPool(fill_value=math.nan)  # any read of a proxy would produce NaN
        with torch.no_grad():
            for _ in range(5):
                out, x_out, skip_out = model(x, extra={"bias": bias, "skip": skip}, scale=0.5)
                torch.testing.assert_close(out, ref[0])
                assert x_out is x and skip_out is skip, "pass-through outputs are the device tensors"
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
