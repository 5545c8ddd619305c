"""Streamed blocks of a stack spread along the step: under a budget every copy hides behind the compute before it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_core.config import OffloadConfig
from magi_core.plan import build_plan
from magi_core.plan.common import streamed_units
from magi_core.plan.contract import Plan, UnitProfile, make_profiles
from magi_core.plan.heuristic import _spread_if_faster, heuristic_plan
from magi_core.plan.simulate import simulate, transfer_ms
from magi_core.plan.spread import SLACKS, proportional_residency, spread_residencies

BW = 55e9  # bytes per second, an H200's host link
BLOCK = 436_224_000  # a Llama-3-8B decoder layer in bf16


def _llm(layers: int = 32, block_ms: float = 1.4) -> list[UnitProfile]:
    """A language model's units: a large embedding, a stack of equal layers, a norm, an LM head of the embedding's
    size and a weightless tail."""
    sizes = [1_050_673_152, *([BLOCK] * layers), 8192, 1_050_673_152, 0]
    return make_profiles(sizes, [0.05, *([block_ms] * layers), 0.02, 1.2, 0.05])


def _floor(profiles: list[UnitProfile], resident: frozenset[int], bw: float) -> float:
    """No step is shorter than its compute or its copies."""
    return max(sum(p.compute_ms for p in profiles),
               sum(transfer_ms(profiles[j].weight_bytes, bw) for j in streamed_units(profiles, resident)))


@pytest.mark.parametrize("share", [0.95, 0.9])
def test_a_budget_that_streams_a_few_layers_streams_them_apart(share: float) -> None:
    """Under a budget that leaves a few of 32 equal layers streamed (a card a little smaller than the model), the
    copy buffer holds two layers: streamed side by side, each waits for the one before; spread along the step,
    every copy runs during the resident layers before it and the step stays within 10% of its floor (a step
    whose copies take as long as its compute, at 0.9, stalls a little with two layers in the buffer)."""
    profiles = _llm()
    budget = int(sum(p.weight_bytes for p in profiles) * share)
    cfg = OffloadConfig(policy="HEURISTIC", bandwidth_safety_factor=1.0, device_memory_budget_bytes=budget)
    plan = build_plan(profiles, BW, cfg)
    assert plan.notes["peak_device_bytes"] <= budget
    layers = [j for j in plan.streamed() if profiles[j].weight_bytes == BLOCK]
    assert len(layers) >= 3
    assert all(b - a >= 3 for a, b in zip(layers, layers[1:], strict=False)), layers
    assert plan.predicted_step_ms <= 1.1 * _floor(profiles, plan.resident, BW)
    # the same resident bytes with the streamed layers at the end of the stack: the plan it replaced stalls
    tail = frozenset(range(len(profiles))) - {j for j in range(len(profiles)) if profiles[j].weight_bytes == 0}
    tail -= set(range(32 - len(layers) + 1, 33))
    tail |= plan.resident - {j for j in range(1, 33)}
    clumped = heuristic_plan(profiles, tail, BW, cfg.prefetch_margin_ms, window=1)
    assert clumped.predicted_step_ms > 1.2 * plan.predicted_step_ms


@st.composite
def stacks(draw: st.DrawFn) -> tuple[list[UnitProfile], frozenset[int]]:
    """Profiles of glue units and one to three stacks of equal blocks, and a resident set."""
    sizes: list[int] = []
    ms: list[float] = []
    for _ in range(draw(st.integers(1, 3))):
        sizes.append(draw(st.sampled_from([0, 10, 300])))
        ms.append(draw(st.sampled_from([0.0, 0.2, 2.0])))
        n, size, block_ms = draw(st.integers(2, 10)), draw(st.sampled_from([100, 200, 400])), draw(
            st.sampled_from([0.0, 0.5, 1.0, 3.0]))
        sizes += [size] * n
        ms += [block_ms] * n
    profiles = make_profiles(sizes, ms)
    weighted = [p.index for p in profiles if p.weight_bytes]
    resident = frozenset(draw(st.lists(st.sampled_from(weighted), unique=True))) if weighted else frozenset()
    return profiles, resident


@given(case=stacks())
def test_spread_sets_hold_what_the_set_held(case: tuple[list[UnitProfile], frozenset[int]]) -> None:
    """Every spread set keeps the same number of units of each size resident (so the same bytes), only swaps units
    of a size among themselves, and differs from the set it came from."""
    profiles, resident = case
    sizes = Counter(profiles[u].weight_bytes for u in resident)
    for alt in spread_residencies(profiles, resident):
        assert alt != resident
        assert Counter(profiles[u].weight_bytes for u in alt) == sizes
        assert all(profiles[u].weight_bytes > 0 for u in alt)


def test_spread_leaves_kept_units_and_lone_sizes_alone() -> None:
    """Units named in ``keep`` and a size no other unit shares stay as they were."""
    profiles = make_profiles([500, 100, 100, 100, 100, 100, 100, 700], [0.1, *([1.0] * 6), 0.1])
    resident = frozenset({0, 1, 2, 3})  # 4, 5, 6 and 7 streamed: clumped at the end
    alts = spread_residencies(profiles, resident, keep={1})
    assert alts
    for alt in alts:
        assert 0 in alt and 7 not in alt and 1 in alt
        streamed = [u for u in range(2, 7) if u not in alt]
        assert len(streamed) == 3 and streamed != [4, 5, 6]


@given(case=stacks(), budgeted=st.booleans())
def test_spreading_never_makes_a_plan_slower_or_larger(case: tuple[list[UnitProfile], frozenset[int]],
                                                       budgeted: bool) -> None:
    """HEURISTIC's spreading step returns its plan or one predicted faster (or as fast and faster at the measured
    rate, or as fast at both in less memory), holding no more resident bytes and no more than the budget (without
    one: than the plan)."""
    profiles, resident = case
    bw, fast, margin = 90e3, 100e3, 0.1

    def full(r: frozenset[int]) -> Plan:
        return heuristic_plan(profiles, r, bw, margin, fast_bandwidth_Bps=fast)

    def screen(r: frozenset[int]) -> Plan:
        return heuristic_plan(profiles, r, bw, margin, window=1)

    plan = full(resident)
    budget = int(plan.notes["peak_device_bytes"] * 1.1) if budgeted else None
    out = _spread_if_faster(plan, profiles, bw, fast, budget, full, screen)
    assert out.notes["resident_bytes"] <= plan.notes["resident_bytes"]
    assert out.predicted_step_ms <= plan.predicted_step_ms * (1 + 1e-9) + 1e-9
    assert out.notes["peak_device_bytes"] <= (budget if budget is not None else plan.notes["peak_device_bytes"])
    if out is not plan:
        assert out.resident != plan.resident
        out_fast, plan_fast = simulate(out, profiles, fast).step_ms, simulate(plan, profiles, fast).step_ms
        assert (out.predicted_step_ms < plan.predicted_step_ms or out_fast < plan_fast
                or (out_fast <= plan_fast * 1.005 and out.notes["peak_device_bytes"] < plan.notes["peak_device_bytes"]))


def test_a_ratio_plan_as_fast_either_way_keeps_two_streamed_layers_in_flight_not_four() -> None:
    """At ratio 0.9 the four streamed layers hide behind compute wherever they are, but side by side at the end of
    the stack their copies must run four layers ahead; spread along the step, one ahead is enough: the same step,
    half the copy buffer."""
    profiles = _llm()
    plan = build_plan(profiles, BW, OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.9))
    layers = [j for j in plan.streamed() if profiles[j].weight_bytes == BLOCK]
    assert len(layers) == 4 and all(b - a >= 3 for a, b in zip(layers, layers[1:], strict=False)), layers
    assert plan.predicted_step_ms == pytest.approx(sum(p.compute_ms for p in profiles))
    assert plan.notes["peak_device_bytes"] - plan.notes["resident_bytes"] <= 2 * BLOCK


def _dit(double: int = 19, single: int = 38) -> list[UnitProfile]:
    """A dual-stream DiT's units (FLUX.1-dev's shape): embedders, double-stream blocks, a small glue unit,
    single-stream blocks of less than half their size, the output layers."""
    sizes = [200_000_000, *([680_000_000] * double), 1_000_000, *([283_000_000] * single), 60_000_000]
    return make_profiles(sizes, [0.3, *([3.2] * double), 0.1, *([1.6] * single), 0.2])


def test_two_stacks_of_different_sizes_stream_in_step_with_compute() -> None:
    """Under a budget of 80% of a dual-stream DiT's weights, streaming only single blocks (the same count of each
    size, however spread) leaves more copy time in the single-block half of the step than its compute hides; streamed
    bytes in step with compute, double blocks included, keep the step within 12% of its floor."""
    profiles = _dit()
    budget = int(sum(p.weight_bytes for p in profiles) * 0.8)
    cfg = OffloadConfig(policy="HEURISTIC", bandwidth_safety_factor=1.0, device_memory_budget_bytes=budget)
    plan = build_plan(profiles, BW, cfg)
    assert plan.notes["peak_device_bytes"] <= budget
    sizes = {profiles[j].weight_bytes for j in plan.streamed()}
    assert {680_000_000, 283_000_000} <= sizes
    assert plan.predicted_step_ms <= 1.12 * _floor(profiles, plan.resident, BW)


@given(case=stacks(), share=st.floats(0.0, 1.0), slack=st.sampled_from(SLACKS))
def test_a_proportional_set_holds_at_most_the_cap(case: tuple[list[UnitProfile], frozenset[int]], share: float,
                                                  slack: float) -> None:
    """Whatever the profiles and the cap, the set keeps at most ``cap`` bytes resident, only units with weights, and
    streams no more than the bytes that must stream plus one unit's and the slack's (the line it follows)."""
    profiles, _ = case
    total = sum(p.weight_bytes for p in profiles)
    cap = int(total * share)
    resident = proportional_residency(profiles, cap, slack)
    held = sum(profiles[u].weight_bytes for u in resident)
    assert held <= cap
    assert all(profiles[u].weight_bytes > 0 for u in resident)
    largest = max((p.weight_bytes for p in profiles), default=0)
    assert total - held <= (total - cap) + (1 + slack) * largest
