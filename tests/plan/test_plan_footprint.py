"""What a plan holds on the device: copies ahead only where they shorten the step, and always within a budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError
from magi_core.plan import build_plan
from magi_core.plan.contract import UnitProfile, make_profiles
from magi_core.plan.heuristic import fewest_copies_ahead, heuristic_plan
from magi_core.plan.simulate import simulate

BW = 100e3  # 100 bytes per ms
POLICIES = ("BASE", "COST_EFFECTIVE", "HEURISTIC")


def _cfg(policy: str = "HEURISTIC", **kw: object) -> OffloadConfig:
    return OffloadConfig(policy=policy, bandwidth_safety_factor=1.0, **kw)  # type: ignore[arg-type]


def _two_largest(profiles: list[UnitProfile]) -> int:
    sizes = sorted((p.weight_bytes for p in profiles), reverse=True)
    return sum(sizes[:2])


def _transfer_bound(sizes: list[int], shares: list[float]) -> list[UnitProfile]:
    """Units that each compute at most as long as their own copy and the next one's take (the next step's first
    unit after the last): the copy stream is the bottleneck everywhere."""
    n = len(sizes)
    ms = [b / BW * 1e3 for b in sizes]
    return make_profiles(sizes, [shares[i] * min(ms[i], ms[(i + 1) % n]) for i in range(n)])


transfer_bound = st.integers(2, 16).flatmap(
    lambda n: st.builds(_transfer_bound, st.lists(st.integers(50, 1000), min_size=n, max_size=n),
                        st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
)


@given(profiles=transfer_bound)
def test_transfer_bound_step_at_ratio_0_holds_two_largest_units(profiles: list[UnitProfile]) -> None:
    """Copies queued further ahead cannot shorten a transfer-bound step, so they hold no memory: at most the
    running unit and the next one's copy are on the device."""
    # the default safety factor: planned at 0.9 of the measured rate, so copies may run faster than planned
    plan = build_plan(profiles, BW, OffloadConfig(gpu_resident_weight_ratio=0.0))
    assert plan.notes["peak_device_bytes"] <= _two_largest(profiles)
    copy_ms = sum(p.weight_bytes for p in profiles) / (0.9 * BW) * 1e3
    assert plan.predicted_step_ms == pytest.approx(copy_ms, rel=1e-6)  # and the link is never idle


unit = st.tuples(st.sampled_from([0, 50, 100, 250, 1000]), st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 10.0]))
profile_lists = st.lists(unit, min_size=1, max_size=14).map(
    lambda us: make_profiles([b for b, _ in us], [c for _, c in us])
)


@given(profiles=profile_lists, margin=st.sampled_from([0.0, 0.1, 1.0]))
def test_fewer_copies_ahead_only_when_as_fast(profiles: list[UnitProfile], margin: float) -> None:
    """The plan kept never holds more than the latest-trigger plan, and is as fast at the planning rate and at a
    faster measured one (within the scheduler's tolerance)."""
    wide = heuristic_plan(profiles, frozenset(), BW, margin)
    kept = fewest_copies_ahead(wide, profiles, BW, margin, BW * 1.2)
    assert kept.notes["peak_device_bytes"] <= wide.notes["peak_device_bytes"]
    assert kept.predicted_step_ms <= wide.predicted_step_ms * 1.005 + 1e-9
    assert simulate(kept, profiles, BW * 1.2).step_ms <= simulate(wide, profiles, BW * 1.2).step_ms * 1.005 + 1e-9


def test_a_heavy_unit_keeps_the_copies_that_hide_behind_it() -> None:
    """Where copies ahead do shorten the step (a heavy unit hides the next two copies), they are kept."""
    profiles = make_profiles([100] * 5, [1.0, 10.0, 1.0, 1.0, 1.0])
    plan = build_plan(profiles, BW, _cfg(gpu_resident_weight_ratio=0.0, prefetch_margin_ms=0.1))
    assert plan.predicted_stall_ms == pytest.approx(0.0)
    assert plan.notes["peak_device_bytes"] > _two_largest(profiles)


@given(profiles=profile_lists, policy=st.sampled_from(POLICIES), share=st.floats(0.05, 1.5))
def test_predicted_peak_within_any_budget_that_plans(profiles: list[UnitProfile], policy: str, share: float) -> None:
    """Under a budget a plan's predicted device bytes never exceed it; a budget too small says what is needed."""
    total = sum(p.weight_bytes for p in profiles) or 1
    budget = max(1, int(share * total))
    try:
        plan = build_plan(profiles, BW, _cfg(policy, device_memory_budget_bytes=budget))
    except ConfigError as e:
        assert "too small" in str(e) and "at least" in str(e)
        return
    assert plan.notes["peak_device_bytes"] <= budget


def test_a_share_budget_must_be_bytes_to_plan() -> None:
    profiles = make_profiles([100] * 3, [1.0] * 3)
    with pytest.raises(ConfigError, match="share of the device"):
        build_plan(profiles, BW, _cfg(device_memory_budget_bytes="50%"))


def test_copies_queued_ahead_that_buy_nothing_are_dropped() -> None:
    """A latest-trigger plan that carries copies across a heavy unit for a step 0.4% shorter at most gives way to
    one holding 250 bytes less that is as fast within the tolerance."""
    profiles = make_profiles([100, 100, 100, 1000, 250, 50], [0.0, 1.0, 1.0, 10.0, 0.1, 10.0])
    wide = heuristic_plan(profiles, frozenset(), BW * 0.9, 0.1, fast_bandwidth_Bps=BW)
    kept = fewest_copies_ahead(wide, profiles, BW * 0.9, 0.1, BW)
    assert (wide.notes["peak_device_bytes"], kept.notes["peak_device_bytes"]) == (1600.0, 1350.0)
    assert kept.predicted_step_ms <= wide.predicted_step_ms * 1.005
    assert build_plan(profiles, BW, OffloadConfig(gpu_resident_weight_ratio=0.0)).notes["peak_device_bytes"] == 1350.0


def test_heuristic_notes_what_its_step_needs_resident() -> None:
    """HEURISTIC says how much of its residency shortens the step (the rest fills the budget): in a compute-bound
    step none of it does, and a budget without the filler plans a step as fast, which is what fitting the card
    relies on to hold the least memory."""
    profiles = make_profiles([100] * 6, [3.0] * 6)  # each copy (1 ms) hides behind the unit before it
    plan = build_plan(profiles, BW, _cfg(device_memory_budget_bytes=10_000))
    assert plan.notes["resident_bytes"] == 600 and plan.notes["needed_resident_bytes"] == 0
    lean = build_plan(profiles, BW, _cfg(device_memory_budget_bytes=200))
    assert lean.notes["resident_bytes"] == 0
    assert lean.predicted_step_ms == pytest.approx(plan.predicted_step_ms)
    # a transfer-bound step needs some of it: what it needs is noted, and no more than it holds
    slow = make_profiles([1000] * 6, [1.0] * 6)
    plan = build_plan(slow, BW, _cfg(device_memory_budget_bytes=4000))
    assert 0 < plan.notes["needed_resident_bytes"] <= plan.notes["resident_bytes"]
