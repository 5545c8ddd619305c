"""The offload executor end to end on the active backend (CPU in CI), through torch.compile(backend="magi_offload")."""

from __future__ import annotations

import gc
import re
from typing import Any

import pytest
import torch
from helpers.models import Layer, MixedStack, TableStack, TiedLM, TupleKw
from helpers.tracking import HANDLES, compile_tracked, compiles, newest

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.compile.runtime import default_planner
from magi_core.errors import ConfigError
from magi_core.execute import executor as executor_mod
from magi_core.execute.residency import RESIDENT
from magi_core.execute.transfer import PerTensorTransfer
from magi_core.plan import register_policy, unregister_policy
from magi_core.plan.common import assemble, fill, plan_with_limits
from magi_core.plan.contract import STEP_START, Plan
from magi_core.plan.lookahead import lookahead_plan
from magi_core.plugin.manager import get_backend

POLICIES = ("BASE", "COST_EFFECTIVE", "HEURISTIC")
RATIOS = (0.0, 0.5, 1.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model: torch.nn.Module, **options):
    opts = {"unit_compiler": "eager", "warmup_calls": 2, "gpu_resident_weight_ratio": 0.0, **options}
    return compile_tracked(model, options=opts)


def device():
    return get_backend().device()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def transformer():
    spec = TransformerSpec(layers=3, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=8)
    with torch.no_grad():
        ref = model(x)
    return model, x, ref


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_outputs_equal_eager(transformer, policy, ratio):
    model, x, ref = transformer
    f = compiled(model, policy=policy, gpu_resident_weight_ratio=ratio)
    for _ in range(4):  # two warm-up calls, then the static plan
        out = f(x)
        assert out.device.type == device().type
        close(out, ref)
    rt = newest()
    assert rt.phase == "planned"
    assert rt.plan is not None and str(rt.plan.policy) == policy
    total = rt.executor.split.weight_bytes
    acts = rt.executor.actions
    assert acts.resident_bytes + acts.streamed_bytes == total
    assert acts.resident_bytes <= ratio * total
    if ratio == 0.0:
        assert acts.resident_bytes == 0
    if ratio == 1.0:
        assert acts.streamed_bytes == 0


def test_tied_weights_copied_once_per_step():
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
    f = compiled(model, policy="BASE")
    for _ in range(4):
        close(f(ids), ref)
    ex = newest().executor
    tied = [i for i, w in ex.split.weights.items() if len(w.users) > 1]
    assert tied, "the tied embedding/head weight should be one graph input used by two units"
    order = ex.actions.copy_order()
    assert sorted(order) == sorted(set(order)), "each streamed weight is copied once per step"
    assert set(tied) <= set(order)
    before = ex.transfer.copies
    f(ids)
    assert ex.transfer.copies - before == len(order)


class _ReleaseLog(PerTensorTransfer):
    """The executor's transfer, logging every weight handed back after its last use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, Any]] = []

    def release(self, t: torch.Tensor, compute_stream: Any) -> None:
        self.log.append(("release", t))  # the tensor itself: an id could be reused once it is freed
        super().release(t, compute_stream)


@pytest.mark.parametrize("policy,ratio", [("BASE", 0.0), ("HEURISTIC", 0.5)])
def test_each_streamed_weight_released_once_right_after_its_last_use(monkeypatch, policy, ratio):
    # On an accelerator the release is what lets the allocator reuse a weight's memory, ordered after the compute
    # stream's use (record_stream); nothing on the CPU backend fails without it, so the releases are logged here.
    monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", _ReleaseLog)
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    f = compiled(model, policy=policy, gpu_resident_weight_ratio=ratio)
    for _ in range(4):
        f(ids)
    ex = newest().executor
    assert isinstance(ex.transfer, _ReleaseLog)
    log: list[tuple[str, Any]] = []
    ex.transfer.log = log
    for i, fn in enumerate(ex.fns):
        ex.fns[i] = lambda args, fn=fn, i=i: (log.append(("unit", i, tuple(args))), fn(args))[1]
    streamed = sum(len(b) for b in ex.actions.batches)
    assert streamed > 0
    for _ in range(2):
        log.clear()
        f(ids)
        releases = [k for k, e in enumerate(log) if e[0] == "release"]
        assert len(releases) == streamed, "every streamed weight is handed back once per step"
        for k in releases:
            t = log[k][1]
            users = [j for j, e in enumerate(log) if e[0] == "unit" and any(a is t for a in e[2])]
            assert users and users[-1] < k, "released after the units that read it"
            assert not any(e[0] == "unit" for e in log[users[-1] + 1:k]), "released right after its last use"


def test_units_without_weights():
    model = MixedStack().eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = model(x)
    f = compiled(model, policy="HEURISTIC", gpu_resident_weight_ratio=0.5)
    for _ in range(4):
        close(f(x), ref)
    ex = newest().executor
    assert any(not u.weights for u in ex.units)


def test_lifted_eps_stays_on_host(transformer):
    model, x, _ = transformer
    f = compiled(model, policy="BASE")
    with torch.no_grad():
        refs = {eps: model(x, eps) for eps in (1e-5, 1e-3, 1e-2)}
    for eps in (1e-5, 1e-3, 1e-2, 1e-3, 1e-2):  # a changing float is lifted to a 0-dim host tensor input
        close(f(x, eps), refs[eps])
    ex = newest().executor
    phs = [n for n in ex.split.graph_module.graph.nodes if n.op == "placeholder"]
    scalars = [
        n for n in phs
        if isinstance(n.meta.get("example_value"), torch.Tensor) and n.meta["example_value"].dim() == 0
    ]
    assert scalars, "Dynamo should have lifted eps into a 0-dim graph input"
    assert all(n.meta["example_value"].device.type == "cpu" for n in scalars)


def test_tuple_outputs_and_keyword_inputs():
    model = TupleKw().eval()
    x = torch.randn(2, 4, 16)
    bias = torch.randn(16)
    with torch.no_grad():
        ref = model(x, bias=bias, scale=2.0)
    f = compiled(model, policy="COST_EFFECTIVE", gpu_resident_weight_ratio=0.5)
    for _ in range(4):
        out = f(x, bias=bias, scale=2.0)
        assert isinstance(out, tuple) and len(out) == 2
        close(out[0], ref[0])
        close(out[1], ref[1])


def test_zero_recompiles_after_warmup_and_second_shape(transformer):
    model, x, ref = transformer
    f = compiled(model, policy="HEURISTIC", gpu_resident_weight_ratio=0.5)
    for _ in range(3):
        f(x)
    n_compiles = compiles()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(5):
        close(f(x), ref)
    assert compiles() == n_compiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    spec = model.spec
    x2 = example_input(spec, tokens=5, batch=2, seed=3)
    with torch.no_grad():
        ref2 = model(x2)
    for _ in range(4):
        close(f(x2), ref2)
    assert compiles() == n_compiles + 1
    close(f(x), ref)


def test_weight_update_is_seen_by_resident_and_streamed_copies():
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    f = compiled(model, policy="COST_EFFECTIVE", gpu_resident_weight_ratio=0.5)
    for _ in range(4):
        f(ids)
    with torch.no_grad():
        for layer in model.layers:
            layer.lin.weight.data = layer.lin.weight.data * 0.5  # new storage, same Parameter object
        ref = model(ids)
    close(f(ids), ref)


def test_resident_weights_freed_with_the_runtime(transformer):
    model, x, _ = transformer
    gc.collect()
    before = len(RESIDENT)
    f = compiled(model, policy="BASE", gpu_resident_weight_ratio=1.0)
    for _ in range(3):
        f(x)
    assert len(RESIDENT) > before
    del f
    torch._dynamo.reset()
    gc.collect()
    assert len(RESIDENT) == before


def test_options_config_object_and_bad_option(transformer):
    from magi_core.config import OffloadConfig
    from magi_core.errors import ConfigError

    model, x, ref = transformer
    cfg = OffloadConfig(policy="BASE", unit_compiler="eager", warmup_calls=0)
    f = compile_tracked(model, options={"config": cfg})
    close(f(x), ref)
    assert newest().phase == "planned"  # warmup_calls=0 plans on the first call
    torch._dynamo.reset()
    g = compile_tracked(model, options={"polcy": "BASE"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="polcy") as info:  # Dynamo wraps the error
        g(x)
    assert isinstance(info.value.inner_exception, ConfigError)


def _inductor_compiles_for(device_type: str) -> bool:
    """True when Inductor has a code generator for ``device_type`` (not for an emulated device like magidev)."""
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()
    return get_scheduling_for_device(device_type) is not None


def test_inductor_units_with_lifted_eps():
    # Inductor units whose graph reads a lifted float with .item(): compiled under a shape environment
    device_type = get_backend().device_type
    if not _inductor_compiles_for(device_type):
        pytest.skip(f"Inductor has no code generator for device type {device_type!r} (e.g. the emulated magidev)")
    spec = TransformerSpec(layers=1, hidden=32, heads=2)
    model = build_transformer(spec)
    x = example_input(spec, tokens=4)
    with torch.no_grad():
        refs = {eps: model(x, eps) for eps in (1e-5, 1e-1)}
    f = compiled(model, policy="BASE", unit_compiler="inductor")
    for eps in (1e-5, 1e-1, 1e-5, 1e-1, 1e-1):
        close(f(x, eps), refs[eps])
    ex = newest().executor
    assert not any(type(fn).__name__ == "LazyUnit" for fn in ex.fns), "every unit ran compiled"


def test_everything_resident_compiles_the_graph_whole(transformer):
    # At ratio 1 nothing streams: unit boundaries would only cut fusions, so the graph is one unit; just below
    # it the blocks are units again (weights may stream).
    model, x, ref = transformer
    f = compiled(model, policy="HEURISTIC", gpu_resident_weight_ratio=1.0)
    for _ in range(3):
        close(f(x), ref)
    whole = newest()
    assert whole.executor.n_units == 1 and whole.executor.actions.streamed_bytes == 0
    torch._dynamo.reset()
    g = compiled(model, policy="HEURISTIC", gpu_resident_weight_ratio=0.99)
    for _ in range(3):
        close(g(x), ref)
    assert newest().executor.n_units > 1


class _CarryFirstTwo:
    """A test policy: look-ahead 1, the first two streamed units copied for the next step during the last unit."""

    def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
        base = lookahead_plan("CARRY_TWO", profiles, frozenset(), 1, bandwidth_Bps)
        head = tuple(base.streamed()[:2])
        at = {i: tuple(v for v in vs if v not in head) for i, vs in base.prefetch_at.items()}
        at[STEP_START] = head + at[STEP_START]
        return assemble("CARRY_TWO", profiles, frozenset(), at, head, bandwidth_Bps, {})


class _CarryThenWide:
    """A test policy: its first plan carries the first two streamed units into the next step (look-ahead 1), its
    later plans look three units ahead (more copy places: a larger copy buffer)."""

    plans = 0

    def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
        type(self).plans += 1
        if type(self).plans == 1:
            return _CarryFirstTwo().plan(profiles, bandwidth_Bps, config)
        return lookahead_plan("WIDE", profiles, frozenset(), 3, bandwidth_Bps)


def test_a_grown_shared_copy_buffer_is_freed_before_the_new_one_is_made():
    """A second input shape whose plan needs a larger shared copy buffer replaces it: the first shape's carried
    copies (views of the old buffer) are dropped with it, so the old buffer is gone, not kept beside the new one
    (on the H200 that doubled a 1.9 GB buffer), and the first shape copies them again at its next step."""
    _CarryThenWide.plans = 0
    register_policy("carry_then_wide", _CarryThenWide)
    try:
        model = TableStack(n=6).eval()
        xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
        f = compile_tracked(model, dynamic=False, options={
            "unit_compiler": "eager", "warmup_calls": 2, "policy": "carry_then_wide",
            "gpu_resident_weight_ratio": 0.0, "transfer": "unit"})
        with torch.no_grad():
            refs = [model(x) for x in xs]
            for _ in range(4):
                close(f(xs[0]), refs[0])
            (first,) = HANDLES[-1].runtimes
            shared = first.executor.transfer.shared
            assert shared is not None and first.executor._carry, "the first plan carries copies across calls"
            old_bytes, old_at = shared.nbytes, shared.tensor.data_ptr()
            dm = get_backend().device_module
            counts = get_backend().is_accelerator and hasattr(dm, "max_memory_allocated")
            if counts:
                dm.synchronize()
                before = dm.memory_allocated()
                dm.reset_peak_memory_stats()
            for _ in range(4):
                close(f(xs[1]), refs[1])
            assert shared.nbytes > old_bytes, "the second plan needs a larger buffer"
            kept = [t.data_ptr() for c in first.executor._carry.values() for t in c.devs]
            assert not any(old_at <= p < old_at + old_bytes for p in kept), "carried views keep the old buffer alive"
            if counts:  # on a device that counts its memory: never both buffers at once
                assert dm.max_memory_allocated() - (before - old_bytes) < shared.nbytes + old_bytes // 2
            for _ in range(2):  # both shapes stay exact on the new buffer, the first copying its carry again
                for x, ref in zip(xs, refs, strict=True):
                    close(f(x), ref)
    finally:
        unregister_policy("carry_then_wide")


def test_table_every_unit_reads_does_not_keep_its_first_unit_alive():
    """A small buffer all layers read (a rotary table) is owned by the first layer's unit: that unit's weights are
    still carried into the next step, the table is not (this step still reads it), and outputs stay exact."""
    register_policy("carry_two", _CarryFirstTwo)
    try:
        model = TableStack().eval()
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(x)
            f = compiled(model, policy="carry_two", gpu_resident_weight_ratio=0.0)
            for _ in range(5):  # warm-up, the planned step, then steady steps on the carried copies
                close(f(x), ref)
    finally:
        unregister_policy("carry_two")
    rt = newest()
    ex = rt.executor
    table = next(w.input_index for u in ex.units for w in u.weights if w.shape == (64,) and len(w.users) > 2)
    owner = next(u.index for u in ex.units if any(w.input_index == table for w in u.weights))
    assert owner in ex.plan.next_step, "the unit owning the table is carried"
    assert rt.profiles is not None and rt.profiles[owner].last_use is None
    carried = {w for b in ex.actions.carry for w in ex.actions.batches[b]}
    own = {w.input_index for w in ex.units[owner].weights} - {table}
    assert own <= carried and table not in carried
    assert any(ex.actions.batches[b] == (table,) for b in ex.actions.start)


class _EndsByTurn:
    """A test policy whose resident choice differs from plan to plan (as HEURISTIC's does between input shapes):
    the first plan keeps leading units, the next trailing ones, each within the config's cap or budget."""

    plans = 0
    share = 1.0  # of the cap it may use

    def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
        type(self).plans += 1
        order = list(range(len(profiles)))
        if type(self).plans % 2 == 0:
            order.reverse()

        def build(cap: int) -> Plan:
            kept = fill(order, profiles, int(cap * type(self).share))
            return lookahead_plan("ENDS", profiles, kept, 1, bandwidth_Bps)

        return plan_with_limits(profiles, config, build)


@pytest.fixture
def ends_policy():
    _EndsByTurn.plans, _EndsByTurn.share = 0, 1.0
    register_policy("ends", _EndsByTurn)
    yield
    unregister_policy("ends")


def _on_device(rts) -> int:
    """Device bytes the runtimes hold between steps: the union of their resident weights and their copy buffers."""
    held: dict = {}
    for r in rts:
        held.update(r.resident_hosts)
    bufs = {b.data_ptr(): b.numel() for r in rts if (b := getattr(r.executor.transfer, "device_buffer", None))
            is not None}
    return sum(held.values()) + sum(bufs.values())


def _two_shapes(model, **options):
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
    f = compile_tracked(model, dynamic=False, options={"unit_compiler": "eager", "warmup_calls": 2, **options})
    with torch.no_grad():
        refs = [model(x) for x in xs]
        for _ in range(4):
            for x, ref in zip(xs, refs, strict=True):
                close(f(x), ref)
    rts = HANDLES[-1].runtimes
    assert len(rts) == 2 and all(r.phase == "planned" for r in rts)
    return rts


def test_input_shapes_share_the_resident_ratio(ends_policy):
    """Each input shape compiles its own runtime; together they keep at most the ratio of the weights resident,
    and what one keeps resident the other uses too (one device copy)."""
    model = TableStack(n=6).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    first, second = _two_shapes(model, policy="ends", gpu_resident_weight_ratio=0.5)
    held = {**first.resident_hosts, **second.resident_hosts}
    assert first.resident_hosts and sum(held.values()) <= 0.5 * weights
    assert set(first.resident_hosts) <= set(second.resident_hosts)  # the second reuses the first's copies


def test_input_shapes_share_the_device_budget(ends_policy):
    """Both shapes stream under one budget: their resident weights and copy buffers together stay within it
    (on a device with its own memory the copy buffer counts too: tox's magidev run)."""
    _EndsByTurn.share = 0.5  # each plan keeps half of what it may: room for the second shape
    model = TableStack(n=20).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    budget = int(0.8 * weights)
    rts = _two_shapes(model, policy="ends", device_memory_budget_bytes=budget)
    assert all(r.resident_hosts and r.executor.actions.streamed_bytes for r in rts)
    assert _on_device(rts) <= budget


def test_one_graph_fits_the_budget_with_its_copy_buffer():
    """The copy buffer of fixed places can need a unit more than the plan's own peak: the plan is fitted again."""
    rt, budget = _one_graph_under_budget(6, 0.6, "BASE")
    assert rt.resident_hosts and _on_device([rt]) <= budget


def _one_graph_under_budget(layers: int, share: float, policy: str) -> tuple[Any, int]:
    """The planned runtime of a TableStack run under a budget of ``share`` of its weights, and the budget."""
    model = TableStack(n=layers).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    budget = int(share * weights)
    f = compile_tracked(model, options={"unit_compiler": "eager", "warmup_calls": 2, "policy": policy,
                                        "device_memory_budget_bytes": budget})
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(4):
            close(f(x), model(x))
    (rt,) = HANDLES[-1].runtimes
    return rt, budget


@pytest.mark.parametrize("policy", ["BASE", "COST_EFFECTIVE", "HEURISTIC"])
@pytest.mark.parametrize("share", [0.35, 0.55, 0.75])
def test_budget_fit_installs_a_measured_plan_that_keeps_what_fits(policy, share):
    """Under a budget, candidate plans are measured with the copy buffer they need before one is installed: the
    installed plan fits, its buffer is the one measured, and it keeps weights resident whenever a plan for some
    smaller planning budget would fit with resident weights (session 7's refit compared each round with an already
    shrunk budget and could end with nothing resident)."""
    rt, budget = _one_graph_under_budget(7, share, policy)
    ex = rt.executor
    assert _on_device([rt]) <= budget
    assert ex.footprint(ex.plan)[1] == getattr(ex.transfer, "buffer_bytes", 0)
    fitting_with_residency = False
    for b in range(budget, 0, -max(1, budget // 50)):
        try:
            plan = default_planner(rt.profiles, rt.bandwidth_Bps, rt.config.replace(device_memory_budget_bytes=b))
        except ConfigError:
            break
        actions, buffer = ex.footprint(plan)
        fitting_with_residency |= bool(actions.resident) and actions.resident_bytes + buffer <= budget
    if fitting_with_residency:
        assert ex.actions.resident_bytes > 0


def test_budget_fit_bisects_back_up_when_a_shrunk_budget_is_too_small_to_plan():
    """A first plan far over the budget shrinks the planning budget below what streaming needs, and the planner
    refuses it: the fit bisects back up and installs a plan that fits, with weights resident, instead of failing or
    streaming everything (seen in CI on magidev, where HEURISTIC's timings made a second input shape's first plan
    keep too much)."""
    model = TableStack(n=7).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    budget = int(0.55 * weights)
    f = compile_tracked(model, options={"unit_compiler": "eager", "warmup_calls": 2, "policy": "BASE",
                                        "device_memory_budget_bytes": budget})
    x = torch.randn(3, 64)
    refused: list[int] = []
    with torch.no_grad():
        close(f(x), model(x))
        (rt,) = HANDLES[-1].runtimes
        real = rt._planner

        def everything_first(profiles, bandwidth, config):
            if not hasattr(everything_first, "done"):  # the first round: all resident, far over the budget
                everything_first.done = True
                return real(profiles, bandwidth, config.replace(device_memory_budget_bytes=None,
                                                                gpu_resident_weight_ratio=1.0))
            try:
                return real(profiles, bandwidth, config)
            except ConfigError:
                refused.append(config.device_memory_budget_bytes)
                raise

        rt._planner = everything_first
        for _ in range(3):
            close(f(x), model(x))
    assert refused and max(refused) < budget  # the shrink went below what streaming needs
    assert rt.phase == "planned" and _on_device([rt]) <= budget
    assert rt.executor.actions.resident_bytes > 0, "bisected back up to a plan keeping weights, not streaming all"


@pytest.mark.parametrize("limit", ["ratio", "budget"])
def test_a_graph_left_warming_up_holds_nothing_while_another_plans(limit):
    """A graph called once (a first decoding step, a shape seen once) gives its warm-up copy buffer up when another
    graph of the model plans: the device then holds the planned graph's weights alone (under a budget of the
    weights' bytes the planned graph keeps them all). Called again, the idle graph warms up reading the weights
    the other keeps resident, plans, and its outputs stay right."""
    model = TableStack(n=4).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    config = {"gpu_resident_weight_ratio": 1.0} if limit == "ratio" else {"device_memory_budget_bytes": weights}
    xa, xb = (torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5))
    f = compile_tracked(model, dynamic=False,
                        options={"unit_compiler": "eager", "warmup_calls": 2, "transfer": "unit", **config})
    with torch.no_grad():
        close(f(xa), model(xa))
        (a,) = HANDLES[-1].runtimes
        assert a.phase == "warmup" and a.executor.transfer.buffer_bytes > 0
        for _ in range(4):
            close(f(xb), model(xb))
        a, b = HANDLES[-1].runtimes
        assert b.phase == "planned" and sum(b.resident_hosts.values()) == weights
        assert a.phase == "idle" and a.executor.transfer.buffer_bytes == 0 and a.executor.plan is None
        shared = b.executor.transfer.shared
        assert shared is None or shared.nbytes == 0
        assert _on_device([a, b]) == weights
        stats = HANDLES[-1].stats()
        assert [s.phase for s in stats] == ["idle", "planned"] and stats[0].transfer_buffer_bytes == 0
        for _ in range(4):
            close(f(xa), model(xa))
            close(f(xb), model(xb))
            assert _on_device([a, b]) == weights
    assert a.phase == "planned" and a.resident_hosts == b.resident_hosts


def test_a_graph_in_its_warm_up_call_keeps_its_copy_buffer_and_the_others_plan_around_it():
    """A graph in a warm-up call when another graph plans (another thread's call: its warm-up lock is held) keeps its
    copy buffer; the graph planning leaves room for that buffer within the model's budget."""
    model = TableStack(n=4).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    xa, xb = (torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5))
    f = compile_tracked(model, dynamic=False, options={"unit_compiler": "eager", "warmup_calls": 2, "transfer": "unit",
                                                       "device_memory_budget_bytes": weights})
    with torch.no_grad():
        close(f(xa), model(xa))
        (a,) = HANDLES[-1].runtimes
        with a._warmup_lock:  # as while another thread runs its call
            for _ in range(4):
                close(f(xb), model(xb))
        a, b = HANDLES[-1].runtimes
        assert a.phase == "warmup" and a.executor.transfer.buffer_bytes > 0 and b.phase == "planned"
        assert _on_device([a, b]) <= weights, "the planned graph left room for the running graph's buffer"
        for _ in range(3):
            close(f(xa), model(xa))
            close(f(xb), model(xb))
            assert _on_device([a, b]) <= weights
    assert a.phase == "planned"


def test_resident_copies_one_shape_made_and_another_refreshed_are_freed_in_stream_order():
    """A second input shape's first call takes over the first one's resident copies and refreshes them on its own
    copy stream; released, the last owner frees them after that stream's copies too (on magidev the stream checker
    fails the test otherwise)."""
    model = TableStack(n=3).eval()
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=1.0, unit_compiler="eager",
                                                     warmup_calls=1), dynamic=False)
    try:
        with torch.no_grad():
            for _ in range(4):
                close(model(xs[0]), refs[0])
            out = model(xs[1])  # not read back before the release: a read would wait for every stream
        a, b = magi_core.handle(model).runtimes
        assert a.phase == "planned" and b.phase == "profile"  # b: its one warm-up call
        assert b.executor.resident is not None and b.executor.resident.indices, "b reads a's copies resident"
    finally:
        magi_core.release(model, restore=True)
        gc.collect()
    close(out, refs[1])


def test_a_second_shape_whose_weights_are_all_resident_already_fits_any_budget():
    """The first shape plans alone and keeps every weight; the second warms up and plans reading them resident:
    no copy buffer, the budget held throughout."""
    model = TableStack(n=3).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
    f = compile_tracked(model, dynamic=False,
                        options={"unit_compiler": "eager", "warmup_calls": 2, "device_memory_budget_bytes": weights})
    with torch.no_grad():
        for x in (xs[0],) * 4 + (xs[1],) * 4:
            close(f(x), model(x))
            assert _on_device(HANDLES[-1].runtimes) <= weights
    first, second = HANDLES[-1].runtimes
    assert sum(first.resident_hosts.values()) == weights and second.resident_hosts == first.resident_hosts
    assert second.executor.actions.streamed_bytes == 0


def test_a_budget_too_small_names_a_minimum_that_fits():
    """The error names what streaming every weight holds, copy buffer included: that budget then runs (a third-party
    probe on magidev got a minimum from the planner without the copy buffer, and a second error for it)."""
    model = TableStack(n=5).eval()
    x = torch.randn(3, 64)
    opts = {"unit_compiler": "eager", "warmup_calls": 2, "device_memory_budget_bytes": 1000}
    f = compile_tracked(model, options=opts)
    with torch.no_grad(), pytest.raises(ConfigError, match=r"too small.*at least (\d+)") as info:
        for _ in range(4):
            f(x)
    need = int(re.search(r"at least (\d+)", str(info.value)).group(1))
    torch._dynamo.reset()
    g = compile_tracked(model, options={**opts, "device_memory_budget_bytes": need})
    with torch.no_grad():
        for _ in range(4):
            close(g(x), model(x))
    (rt,) = HANDLES[-1].runtimes
    assert rt.phase == "planned" and _on_device([rt]) <= need


def _first_graph_planned(a: torch.nn.Module, b: torch.nn.Module, budget: int) -> tuple[Any, Any, torch.Tensor]:
    """``a`` and ``b`` compiled on one handle under ``budget`` (two graphs of one model), ``a`` called until planned."""
    opts = {"unit_compiler": "eager", "warmup_calls": 2, "device_memory_budget_bytes": budget}
    fa = compile_tracked(a, options=opts)
    fb = torch.compile(b, backend=HANDLES[-1].backend, options=opts)
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(3):
            close(fa(x), a(x))
    return fa, fb, x


def test_a_graph_that_does_not_fit_next_to_the_first_takes_its_memory_back():
    """A second graph of the model whose weights the first graph left no room to stream (the first keeps all of its
    own resident, the whole budget): the first gives its device memory back and plans again at its next call, next
    to the second's plan, which kept the room the first needs to stream. Both run right, within the budget, and
    each keeps planning the same from then on (no turns)."""
    a, b = Layer(64).eval(), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).eval()  # two graphs
    weights = sum(t.nbytes for t in a.parameters())
    budget = weights + 1024  # a keeps all of its weights resident; a copy buffer's alignment fits the rest
    fa, fb, x = _first_graph_planned(a, b, budget)
    with torch.no_grad():
        ra = HANDLES[-1].runtimes[0]
        assert _on_device([ra]) == weights and ra.resident_hosts
        for _ in range(3):
            close(fb(x), b(x))
        rb = HANDLES[-1].runtimes[1]
        assert rb.phase == "planned" and ra.phase == "yielded" and ra.executor.plan is None and not ra.resident_hosts
        assert _on_device(HANDLES[-1].runtimes) <= budget
        for _ in range(3):
            close(fa(x), a(x))
            close(fb(x), b(x))
            assert _on_device(HANDLES[-1].runtimes) <= budget
        assert ra.executor.plan is not None and rb._evictions == 1 and ra._evictions == 0
        plans = (ra.plan, rb.plan)
        for _ in range(2):
            close(fa(x), a(x))
            close(fb(x), b(x))
        assert (ra.plan, rb.plan) == plans


def test_a_graph_that_gave_its_memory_back_sees_weights_edited_meanwhile():
    """Weights edited in place while a graph holds nothing (it gave its memory to another graph) reach its next
    call, which plans again; later edits keep reaching both graphs."""
    a, b = Layer(64).eval(), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).eval()
    budget = sum(t.nbytes for t in a.parameters()) + 1024
    fa, fb, x = _first_graph_planned(a, b, budget)
    with torch.no_grad():
        for _ in range(3):
            close(fb(x), b(x))
        ra = HANDLES[-1].runtimes[0]
        assert ra.phase == "yielded"
        a.lin.weight.mul_(-2.0)
        b[0].bias.add_(1.0)
        for _ in range(3):
            close(fa(x), a(x))
            close(fb(x), b(x))
        a.lin.bias.add_(0.5)
        close(fa(x), a(x))


def test_a_call_that_finds_its_graph_suspended_plans_it_again_and_runs():
    """A planned call that passed the fast path just before another graph took this graph's memory back (the other
    thread's eviction lands between the check and the step) plans again and runs right, never on a dropped plan."""
    model = Layer(64).eval()
    f = compile_tracked(model, options={"unit_compiler": "eager", "warmup_calls": 2})
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(3):
            close(f(x), model(x))
        rt = newest()
        assert rt._planned and not rt._replan
        assert rt.executor.suspend() and rt.executor.plan is None  # as _evict_peers does, without the replan flag
        close(f(x), model(x))
        assert rt.executor.plan is not None and rt.phase == "planned"


def test_graphs_of_one_model_past_its_budget_say_what_to_do():
    """A second graph whose weights do not fit the budget even with the first graph's memory given back."""
    a = Layer(64).eval()
    b = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).eval()
    budget = sum(t.nbytes for t in a.parameters())  # less than b's largest layer
    fa, fb, x = _first_graph_planned(a, b, budget)
    with torch.no_grad():
        assert _on_device(HANDLES[-1].runtimes) == budget
        with pytest.raises(ConfigError, match="too small.*raise it to at least"):
            for _ in range(3):
                fb(x)
        assert len(HANDLES[-1].runtimes) == 2
        for _ in range(2):
            close(fa(x), a(x))  # the first graph plans again and runs


class _LookaheadByTurn:
    """A test policy: look-ahead 1 for the first plan, 2 for the next (so their copies land in other places)."""

    plans = 0

    def plan(self, profiles, bandwidth_Bps, config):  # type: ignore[no-untyped-def]
        type(self).plans += 1
        return lookahead_plan("TURN", profiles, frozenset(), 1 + (type(self).plans % 2 == 0), bandwidth_Bps)


def test_input_shapes_take_turns_in_one_copy_buffer():
    """Runtimes of one model place their copies in one buffer (the largest plan's size); called in turns, each
    finds what it carried over overwritten by the other and copies it again: outputs stay exact."""
    model = TableStack(n=4).eval()
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
    _LookaheadByTurn.plans = 0
    register_policy("turn", _LookaheadByTurn)
    try:
        f = compile_tracked(model, dynamic=False, options={"unit_compiler": "eager", "warmup_calls": 2,
                                                           "policy": "turn", "transfer": "unit"})
        with torch.no_grad():
            refs = [model(x) for x in xs]
            for _ in range(6):  # warm-up and planning of both, then steady calls alternating shapes
                for x, ref in zip(xs, refs, strict=True):
                    close(f(x), ref)
    finally:
        unregister_policy("turn")
    rts = HANDLES[-1].runtimes
    assert len(rts) == 2 and all(r.phase == "planned" for r in rts)
    bufs = [r.executor.transfer.device_buffer for r in rts]
    assert all(r.executor.actions.carry for r in rts)  # each carries copies into its next call
    assert bufs[0] is not None and bufs[0].data_ptr() == bufs[1].data_ptr()
    assert bufs[0].numel() == max(r.executor.transfer.buffer_bytes for r in rts)
    with torch.no_grad():  # the same shape twice: its carried copies survive
        close(f(xs[1]), refs[1])
        close(f(xs[1]), refs[1])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_second_shape_streams_in_the_shared_buffer_under_a_budget_the_first_filled(policy):
    """The first shape fills the budget (resident weights and its copy buffer); the second keeps the same weights
    resident and streams the rest through the copy buffer it shares: no more than the budget on the device."""
    model = TableStack(n=8).eval()
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    budget = int(0.7 * weights)
    rts = _two_shapes(model, policy=policy, device_memory_budget_bytes=budget, transfer="unit")
    assert _on_device(rts) <= budget
    assert rts[0].resident_hosts and set(rts[0].resident_hosts) <= set(rts[1].resident_hosts)
