"""Device inputs of offloaded models: host proxies for Dynamo, the real tensors swapped in by the executor.

On the CPU backend there are no device tensors, so "device" inputs here are distinct host tensors that the
wrapper is told to treat as device tensors; on an accelerator backend (e.g. the emulated magidev device of
examples/privateuse1) they are real device tensors (``.to(device)`` of the same host tensors). Proxies are
filled with NaN, so any read of one would show in the outputs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types

import pytest
import torch
from helpers.models import Breaks, PassThrough, TupleKw
from helpers.ranges import registered_ranges
from helpers.tracking import compile_tracked, newest

from magi_core.api import handle, offload, release
from magi_core.compile.device_inputs import ProxyPool, replace_device_tensors, restore_device_tensors
from magi_core.config import OffloadConfig
from magi_core.errors import MagiError
from magi_core.execute.inputs import current_substitutions, substituting
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


# -- device tensors inside argument objects: proxies in place for the call, the caller's tensors afterwards -------
class _Slotted:
    __slots__ = ("keys", "spare")

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


@dataclasses.dataclass(frozen=True)
class _Frozen:
    value: torch.Tensor
    label: str = "frozen"


class _Holder:
    """An object with every kind of place a device tensor can sit in."""

    def __init__(self, a, b, host) -> None:
        self.a = a
        self.pair = (a, host)
        self.items = [b, {"k": a}]
        self.slotted = _Slotted(b)
        self.frozen = _Frozen(b)
        self.module = torch.nn.Linear(2, 2)  # modules are never walked (their tensors are the offloaded weights)
        self.me = self  # a cycle


def _swap_for(is_dev, pool=None):
    from magi_core.compile.device_inputs import proxy_for
    from magi_core.compile.object_inputs import ObjectSwap

    pool = pool if pool is not None else ProxyPool(fill_value=math.nan)
    subs, seen, used = {}, {}, {}
    return ObjectSwap(lambda t: proxy_for(t, is_dev, pool, subs, seen, used)), subs


def test_object_swap_puts_proxies_in_the_callers_objects_and_restores_the_same_objects():
    a, b, host = torch.randn(2, 3), torch.randn(4), torch.randn(5)
    h = _Holder(a, b, host)
    pair, items, inner = h.pair, h.items, h.items[1]
    swap, subs = _swap_for(_marked(a, b))
    swap.enter(h)
    pa = h.a
    assert pa is not a and subs[id(pa)] is a and torch.isnan(pa).all()
    assert h.pair[0] is pa and h.pair[1] is host and h.pair is not pair, "a tuple holding one is rebuilt"
    assert h.items is items and inner["k"] is pa, "lists and dicts change in place: the caller's objects"
    pb = h.items[0]
    assert subs[id(pb)] is b and h.slotted.keys is pb and h.frozen.value is pb, "the same tensor, the same proxy"
    assert h.module.weight.device.type == "cpu" and not any(id(p) in subs for p in h.module.parameters())
    swap.restore(subs)
    assert h.a is a and h.pair is pair and h.items[0] is b and inner["k"] is a
    assert h.slotted.keys is b and h.frozen.value is b and h.me is h


def test_restore_keeps_what_the_forward_wrote_and_never_leaves_a_proxy():
    a, b, fresh = torch.randn(3), torch.randn(3), torch.randn(3)
    h = _Holder(a, b, torch.randn(1))
    swap, subs = _swap_for(_marked(a, b))
    swap.enter(h)
    h.a = fresh  # what the executor produced, written by the forward (Dynamo replays it on the object)
    h.slotted.spare = h.slotted.keys  # a proxy written elsewhere (a pass-through write)
    h.items.append(h.frozen.value)
    swap.restore(subs)
    assert h.a is fresh
    assert h.slotted.spare is b and h.slotted.keys is b and h.items[-1] is b


def test_object_swap_stops_at_the_depth_bound_and_says_where():
    from magi_core.compile.object_inputs import MAX_DEPTH

    t = torch.randn(2)
    chain = node = types.SimpleNamespace()
    for _ in range(MAX_DEPTH + 2):
        node.child = types.SimpleNamespace()
        node = node.child
    node.t = t
    swap, subs = _swap_for(_marked(t))
    swap.enter(chain)
    assert not subs and swap.too_deep == ["SimpleNamespace.child"]
    assert node.t is t


def test_proxy_pool_keeps_only_recent_layouts_and_never_one_in_use():
    pool = ProxyPool(max_layouts=2)
    used: dict = {}
    first = pool.take(torch.empty(1), used)
    pool.take(torch.empty(2), used)
    pool.take(torch.empty(3), used)  # all three in this call: none evicted
    assert len(pool) == 3
    pool.take(torch.empty(4), {})  # a new call: the least recently used layouts go
    assert len(pool) == 2 and all(p is not first for p in pool.proxies())
    assert torch.isnan(ProxyPool(fill_value=math.nan).take(torch.empty(2), {})).all()
    ints = ProxyPool(fill_value=math.nan).take(torch.empty(2, dtype=torch.long), {})
    assert (ints < 0).all(), "integer proxies hold an index no lookup takes"


@dataclasses.dataclass
class _Cache:
    """A cache as a model's caller passes it: a growing tensor, a preallocated one written in place, layers."""

    grown: torch.Tensor
    slab: torch.Tensor
    layers: list
    last: torch.Tensor | None = None


class _UsesCache(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cache: _Cache, step: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        cache.slab.index_copy_(0, step, y[:1])  # in place into a tensor the caller holds
        cache.grown = torch.cat([cache.grown, y[:1]])  # a new tensor assigned to the attribute
        for layer in cache.layers:
            layer.keys.mul_(2.0)
        cache.last = cache.layers[0].keys  # a pass-through write
        return y + cache.slab.sum(0) + cache.grown.mean(0)


def _new_cache(d: int, device: torch.device | None = None) -> _Cache:
    torch.manual_seed(1)
    c = _Cache(torch.randn(1, d), torch.zeros(6, d), [types.SimpleNamespace(keys=torch.randn(d)) for _ in range(2)])
    if device is not None:
        c.grown, c.slab = c.grown.to(device), c.slab.to(device)
        for layer in c.layers:
            layer.keys = layer.keys.to(device)
    return c


def _cache_tensors(c: _Cache) -> list[torch.Tensor]:
    return [c.grown, c.slab, *(layer.keys for layer in c.layers), *([c.last] if c.last is not None else [])]


def test_offloaded_forward_updates_a_cache_object_of_device_tensors_in_place():
    """Device tensors inside an argument object: read through proxies never filled, written in place on the real
    tensors (``index_copy_``, ``mul_``), new tensors assigned to attributes come back as the executor's, and no proxy
    is left in the caller's object."""
    backend = get_backend()
    d = 8
    model = _UsesCache(d).eval()
    ref_model = _UsesCache(d).eval()
    ref_model.load_state_dict(model.state_dict())
    ref_cache, cache = _new_cache(d), _new_cache(d, backend.device() if backend.is_accelerator else None)
    slab = cache.slab
    xs = [torch.randn(3, d) for _ in range(4)]
    try:
        offload(model, CFG)
        fwd = handle(model).forward
        fwd.pool = ProxyPool(fill_value=math.nan)  # any read of a proxy would produce NaN
        if not backend.is_accelerator:  # on the CPU backend: the cache's tensors count as device tensors
            fwd.is_device = lambda t: any(t is c for c in _cache_tensors(cache))
        with torch.no_grad():
            for i, x in enumerate(xs):
                step = torch.tensor([i])
                expect = ref_model(x, ref_cache, step)
                if backend.is_accelerator:
                    out = model(x.to(backend.device()), cache, step.to(backend.device()))
                else:
                    out = model(x, cache, step)
                torch.testing.assert_close(out.cpu(), expect)
                assert cache.slab is slab, "the preallocated tensor stays the caller's, written in place"
                for got, want in zip(_cache_tensors(cache), _cache_tensors(ref_cache), strict=True):
                    torch.testing.assert_close(got.cpu(), want)
                proxies = {id(p) for p in fwd.pool.proxies()}
                assert not any(id(t) in proxies for t in _cache_tensors(cache)), "no proxy left behind"
                if backend.is_accelerator:
                    assert all(t.device.type == backend.device_type for t in _cache_tensors(cache))
                assert cache.last is cache.layers[0].keys
        assert fwd.substituted_calls == len(xs)
    finally:
        release(model, restore=True)


def test_device_tensors_inside_an_object_argument_are_handed_over(accelerator):
    """A caller's state object holding device tensors (what a KV cache is) runs offloaded, state left as it was."""

    class State:
        def __init__(self, keys: torch.Tensor) -> None:
            self.keys = keys

    class UsesState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, state: State) -> torch.Tensor:
            return self.lin(x) + state.keys

    model = UsesState().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model.lin(x) + 1
    keys = torch.ones(2, 16, device=accelerator.device())
    state = State(keys)
    try:
        offload(model, CFG)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(model(x, state).cpu(), ref)
                assert state.keys is keys
    finally:
        release(model, restore=True)


def test_device_tensors_nested_past_the_depth_bound_are_a_clear_error(accelerator):
    from magi_core.compile.object_inputs import MAX_DEPTH

    class Deep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, state) -> torch.Tensor:
            node = state
            while hasattr(node, "child"):
                node = node.child
            return self.lin(x) + node.t

    chain = node = types.SimpleNamespace()
    for _ in range(MAX_DEPTH + 2):
        node.child = types.SimpleNamespace()
        node = node.child
    node.t = torch.ones(4, device=accelerator.device())
    model = Deep().eval()
    try:
        offload(model, CFG)
        with pytest.raises(MagiError, match=r"SimpleNamespace\.child holds lies more than 8 levels"), torch.no_grad():
            model(torch.randn(2, 4), chain)
    finally:
        release(model, restore=True)


def test_a_failing_call_leaves_the_callers_objects_as_they_were():
    class Mismatched(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, state) -> torch.Tensor:
            return self.lin(x) @ state.keys  # (2, 4) @ (3, 4): the model's bug

    backend = get_backend()
    keys = torch.ones(3, 4, device=backend.device())
    state = types.SimpleNamespace(keys=keys, items=[keys])
    model = Mismatched().eval()
    try:
        offload(model, CFG)
        fwd = handle(model).forward
        if not backend.is_accelerator:
            fwd.is_device = _marked(keys)
        with pytest.raises(RuntimeError), torch.no_grad():
            model(torch.randn(2, 4), state)
        assert state.keys is keys and state.items[0] is keys
    finally:
        release(model, restore=True)
