"""Direct calls of Inductor unit code (no Dynamo / AOT wrapper layers): used only where verified, else wrapped."""

from __future__ import annotations

import torch
import torch.fx
from helpers.tracking import compile_tracked, newest
from torch._inductor.compile_fx import compile_fx

from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.execute.unit_compile import direct_call, output_code


def _run(model: torch.nn.Module, x: torch.Tensor, direct: bool) -> tuple[torch.Tensor, list[bool | None]]:
    torch._dynamo.reset()
    f = compile_tracked(model, options={"policy": "BASE", "unit_compiler": "inductor", "direct_unit_calls": direct})
    with torch.no_grad():
        outs = [f(x, 1e-5) for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    return outs[-1], list(newest().executor.direct_units)


def test_direct_unit_calls_match_the_wrapped_calls_bit_for_bit() -> None:
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    fast, kinds = _run(model, x, direct=True)
    slow, wrapped = _run(model, x, direct=False)
    assert kinds and all(kinds), kinds  # every unit (lifted eps included) is called directly
    assert wrapped == [False] * len(kinds)
    assert torch.equal(fast, slow)
    with torch.no_grad():
        # the offloaded output is on the device, the model's own weights (and this reference) on the host
        torch.testing.assert_close(fast.cpu(), model(x, 1e-5), rtol=1e-4, atol=1e-4)


def _compile(fn, *args: torch.Tensor):
    gm = torch.fx.symbolic_trace(fn)
    with torch.no_grad():
        compiled = compile_fx(gm, list(args))
        return compiled, compiled(*args)


def test_single_tensor_and_tuple_outputs_keep_their_structure() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def one(x, w):
        return torch.relu(x @ w)

    def two(x, w):
        return (x @ w, x.sum())

    for fn in (one, two):
        compiled, expected = _compile(fn, x, w)
        call = direct_call(compiled, [x, w], expected)
        assert call is not None, fn.__name__
        got = call([x, w])
        assert type(got) is type(expected)
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected)
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_unit_that_mutates_its_input_keeps_the_wrapped_call() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def mutates(x, w):
        x.add_(1.0)
        return (x @ w,)

    before = x.clone()
    compiled, expected = _compile(mutates, x, w)
    assert torch.equal(x, before + 1.0)  # the wrapped call applied the mutation once
    assert direct_call(compiled, [x, w], expected) is None
    assert torch.equal(x, before + 1.0)  # and the check did not apply it again


def test_wrong_structure_or_no_inductor_code_keeps_the_wrapped_call() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def two(x, w):
        return (x @ w, x.sum())

    compiled, expected = _compile(two, x, w)
    assert output_code(compiled) is not None
    assert direct_call(compiled, [x, w], (expected[0],)) is None  # fewer outputs than the code returns
    assert direct_call(compiled, [x, w], (expected[0] + 1, expected[1])) is None  # other values
    assert direct_call(lambda *a: expected, [x, w], expected) is None  # nothing compiled inside
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert direct_call(compiled, [x, w], expected) is None


def test_units_compiled_again_come_from_inductors_graph_cache() -> None:
    # without a shape environment Inductor bypasses its FX graph cache and every run compiles every unit again
    from torch._dynamo.utils import counters

    spec = TransformerSpec(layers=1, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    _run(model, x, direct=True)
    counters.clear()
    _, kinds = _run(model, x, direct=True)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] >= len(kinds)
    assert all(kinds), "units loaded from the cache are called directly too"


def test_units_of_identical_blocks_compile_once_and_keep_their_own_weights() -> None:
    """The blocks of a model differ only in names and weights: one Inductor compile serves them all, and every
    block still computes with its own weights (the output matches the eager model's)."""
    spec = TransformerSpec(layers=4, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    torch._dynamo.reset()
    f = compile_tracked(model, options={"policy": "BASE", "unit_compiler": "inductor"})
    with torch.no_grad():
        out = [f(x, 1e-5) for _ in range(3)][-1]
        want = model(x, 1e-5)
    cache = newest().executor.compiled_units
    n_units = newest().executor.n_units
    assert cache.compiles + cache.reused == n_units
    assert cache.reused >= spec.layers - 1 and cache.compiles <= n_units - (spec.layers - 1), (cache.compiles, n_units)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)  # a block on another's weights: O(1) off


def test_structure_key_ignores_names_only() -> None:
    from magi_core.execute.unit_compile import structure_key

    def block(x, w, s):
        return torch.nn.functional.gelu(x @ w) * s

    def tanh_gelu(x, w, s):
        return torch.nn.functional.gelu(x @ w, approximate="tanh") * s

    x, w, s = torch.randn(4, 8), torch.randn(8, 8), torch.randn(())
    a = torch.fx.symbolic_trace(block)
    b = torch.fx.symbolic_trace(block)
    for n in b.graph.nodes:  # another block's names
        n.name = n.name + "_blocks_7"
    b.recompile()
    key = structure_key(a, [x, w, s])
    assert key is not None and key == structure_key(b, [x, w, s])
    assert key != structure_key(a, [x, w.double(), s])  # dtype
    assert key != structure_key(a, [x, w.t(), s])  # stride
    assert key != structure_key(a, [torch.randn(5, 8), w, s])  # shape
    assert key != structure_key(torch.fx.symbolic_trace(tanh_gelu), [x, w, s])  # a constant keyword
    assert structure_key(_scaled(2.0), [x, w, s]) != structure_key(_scaled(3.0), [x, w, s])  # a constant
    assert structure_key(_scaled(2.0), [x, w, s]) == structure_key(_scaled(2.0), [x, w, s])
    assert structure_key(torch.fx.symbolic_trace(_WithBuffer()), [x, w]) is None  # its value is the module's


def _scaled(c: float) -> torch.fx.GraphModule:
    def f(x, w, s):
        return torch.nn.functional.gelu(x @ w) * c

    return torch.fx.symbolic_trace(f)


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w) * self.scale


def test_shared_unit_code_sees_weights_edited_after_offload_and_threads_on_the_first_call() -> None:
    """Blocks that share one compiled unit read their own host weights on every call: an in-place edit of one
    block's weight after offload changes the output exactly as in the eager model; four threads making the first
    calls at once get the eager model's output too."""
    import threading

    import magi_core

    spec = TransformerSpec(layers=4, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    with torch.no_grad():
        want = model(x, 1e-5)
    torch._dynamo.reset()
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=0.0, unit_compiler="inductor"))
    outs: list[torch.Tensor] = []

    def call() -> None:
        with torch.no_grad():
            outs.append(model(x, 1e-5).cpu())

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 4
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    cache = magi_core.handle(model).runtime.executor.compiled_units
    assert cache.reused >= spec.layers - 1
    weight = next(p for n, p in model.named_parameters() if p.dim() == 2 and ".2." in f".{n}")  # the third block's
    with torch.no_grad():
        weight.mul_(-2.0)
        edited = [model(x, 1e-5).cpu() for _ in range(2)][-1]
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    magi_core.release(model)
    assert not torch.allclose(edited, want, rtol=1e-3, atol=1e-3)
    reference = build_transformer(spec)
    reference.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(edited, reference(x, 1e-5), rtol=1e-4, atol=1e-4)
