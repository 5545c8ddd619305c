"""Pure pieces of the executor: action lists from a plan, scheduler profiles, device-branch detection."""

from __future__ import annotations

import dataclasses
import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from magi_core.compile.device_branches import device_branch_reasons
from magi_core.config import OffloadConfig
from magi_core.execute.actions import batch_lifetimes, build_actions, unit_profiles
from magi_core.passes.units import OffloadUnit, WeightSlot
from magi_core.plan import build_plan
from magi_core.plan.contract import Plan


def units(spec: list[list[tuple[int, int]]]) -> list[OffloadUnit]:
    """Units from [[(input_index, nbytes), ...] per unit]; users filled from the spec."""
    users: dict[int, list[int]] = {}
    for u, ws in enumerate(spec):
        for i, _ in ws:
            users.setdefault(i, []).append(u)
    return [
        OffloadUnit(
            index=u, attr=f"u{u}", node=None, module=None,  # type: ignore[arg-type]
            weights=tuple(WeightSlot(i, f"w{i}", (n,), torch.uint8, n, tuple(users[i])) for i, n in ws),
        )
        for u, ws in enumerate(spec)
    ]


# unit 0 and unit 3 share weight 1 (tied); unit 2 has no weights
SPEC = [[(1, 100), (2, 10)], [(3, 50)], [], [(4, 70), (1, 100)]]


def plan(resident=(), at=None, next_step=()) -> Plan:
    prefetch = {i: () for i in range(-1, 4)}
    prefetch.update(at or {})
    return Plan(policy="T", resident=frozenset(resident), prefetch_at=prefetch, next_step=tuple(next_step))


def test_every_streamed_weight_copied_once_and_freed_after_last_user():
    us = units(SPEC)
    a = build_actions(us, plan(at={-1: (0,), 0: (1,), 1: (3,)}, next_step=()))
    order = a.copy_order()
    assert sorted(order) == [1, 2, 3, 4]
    assert a.streamed_bytes == 230 and a.resident_bytes == 0
    assert a.free[3] == (1, 4) and a.free[0] == (2,) and a.free[1] == (3,)
    assert a.issue[0] and a.issue[1] and not a.issue[2]
    # unit 3 waits only on its own new batch (weight 1 was waited on before unit 0)
    assert [w for b in a.wait[3] for w in a.batches[b]] == [4]


def test_units_the_plan_forgets_are_copied_on_demand():
    a = build_actions(units(SPEC), plan())
    assert [sorted(w for b in ids for w in a.batches[b]) for ids in a.issue] == [[1, 2], [3], [], [4]]


def test_resident_tied_weight_belongs_to_first_user():
    us = units(SPEC)
    a = build_actions(us, plan(resident=(0,), at={0: (1,), 1: (3,)}))
    assert a.resident == (1, 2)
    assert sorted(a.copy_order()) == [3, 4]
    profiles = unit_profiles(us)
    assert [p.weight_bytes for p in profiles] == [110, 50, 0, 70]
    assert profiles[0].last_use == 3 and profiles[1].last_use is None


def test_next_step_batches_are_carried():
    a = build_actions(units(SPEC), plan(at={-1: (1,), 1: (3,)}, next_step=(1,)) )
    assert a.carry == a.start[:1]
    order = a.copy_order()
    assert order[-1] == 3 and order.count(3) == 1


def test_next_step_batches_issued_earlier_live_from_there():
    # unit 0 resident; unit 1's weight 3 is carried, issued before unit 2 (after its own last use in unit 1)
    # rather than before the last unit; unit 3's weight 4 is the step's only other copy, issued at unit 0
    us = units(SPEC)
    early_plan = Plan("T", frozenset({0}), {-1: (1,), 0: (3,), 1: (), 2: (), 3: ()}, next_step=(1,), next_step_at=2)
    early_plan.validate(unit_profiles(us))
    early = build_actions(us, early_plan)
    assert early.carry_at == 2 and early.carry_unit == 2
    (carried,) = early.carry
    assert early.batches[carried] == (3,)
    assert early.copy_order() == [4, 3]  # the step's own copy, then the next step's
    lives = batch_lifetimes(early)
    assert lives[carried] == ((0, 3), (4, 7))  # this step until unit 1; from unit 2's issue to the step end
    late = build_actions(us, Plan("T", frozenset({0}), early_plan.prefetch_at, next_step=(1,)))
    assert late.carry_unit == 3 and batch_lifetimes(late)[late.carry[0]] == ((0, 3), (6, 7))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.lin(x) * 2
        return self.lin(x)


def test_device_branch_detected_in_code_and_warned_at_compile(caplog, monkeypatch):
    import magi_core.compile.device_branches as device_branches

    # the CPU backend runs every branch as traced (silent); pretend the run targets "cuda"
    monkeypatch.setattr(device_branches, "target_device_type", lambda: "cuda")
    assert device_branch_reasons(Branchy.forward.__code__)

    def plain(x):
        return x.to("cpu") + 1

    assert not device_branch_reasons(plain.__code__)
    torch._dynamo.reset()
    f = torch.compile(Branchy(), backend="magi_offload", options={"unit_compiler": "eager"})
    with caplog.at_level(logging.WARNING, logger="magi_core.compile.device_branches"), torch.no_grad():
        f(torch.randn(2, 4))
    assert any("device-type branch" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()


# unit 0 owns a big weight (1) and a small table (2) that units 1 and 2 also read
TABLE_SPEC = [[(1, 1000), (2, 10)], [(3, 1000), (2, 10)], [(4, 1000), (2, 10)]]


def test_small_weight_later_units_read_is_its_own_batch_and_never_carried_in_use():
    us = units(TABLE_SPEC)
    profiles = unit_profiles(us)
    assert profiles[0].last_use is None and profiles[0].weight_bytes == 1010  # the table does not keep unit 0
    p = Plan("T", frozenset(), {-1: (0, 1), 0: (), 1: (2,), 2: ()}, next_step=(0, 1))
    p.validate(profiles)
    a = build_actions(us, p)
    assert a.batches[:2] == ((1,), (3,)) and a.carry == (0, 1)  # the table, read by the last unit, is not carried
    assert a.start[2:] == (2,) and a.batches[2] == (2,)
    assert a.free == ((1,), (3,), (2, 4))
    life = batch_lifetimes(a)
    assert life[0] == ((0, 1), (4, 5)) and life[2] == ((0, 5),)  # unit 0's place is free after unit 0
    # without a carry the table is still its own batch, copied with its unit and freed after its last reader
    a = build_actions(us, Plan("T", frozenset(), {-1: (0,), 0: (1,), 1: (2,), 2: ()}))
    assert [a.batches[b] for b in a.start] == [(1,), (2,)]


def test_weights_later_units_read_keep_their_unit_when_they_are_most_of_it():
    # a tied embedding: the shared weight is the unit's bulk, so the unit lives until its last reader
    us = units([[(1, 100), (2, 10)], [(3, 50)], [(1, 100)]])
    assert unit_profiles(us)[0].last_use == 2
    # several long-lived weights: left out only while together within MINOR_SHARE of the unit
    us = units([[(1, 1000), (2, 40), (3, 40)], [(2, 40)], [(3, 40)]])
    assert unit_profiles(us)[0].last_use == 1  # the one read until unit 2 is dropped; both (8%) would not be


@st.composite
def shared_specs(draw):
    """Units of a few weights each, some read again by later units (tables, tied weights), some weightless."""
    n = draw(st.integers(2, 7))
    spec: list[list[tuple[int, int]]] = []
    sizes: dict[int, int] = {}
    nxt = 1
    for u in range(n):
        ws = []
        for _ in range(draw(st.integers(0, 3))):
            sizes[nxt] = draw(st.sampled_from([8, 100, 1000, 5000]))
            ws.append((nxt, sizes[nxt]))
            nxt += 1
        if u and sizes and draw(st.integers(0, 3)):  # read a weight an earlier unit owns (a small one: a table)
            w = draw(st.sampled_from(sorted(sizes, key=lambda i: (sizes[i], i))[:2]))
            if all(w != i for i, _ in ws):
                ws.append((w, sizes[w]))
        spec.append(ws)
    return spec


@given(spec=shared_specs(), compute=st.lists(st.floats(0.01, 5.0), min_size=7, max_size=7),
       policy=st.sampled_from(["BASE", "COST_EFFECTIVE", "HEURISTIC"]), ratio=st.sampled_from([0.0, 0.3]))
@settings(max_examples=300, deadline=None)
def test_actions_keep_every_weight_alive_for_its_readers_and_never_carry_one_in_use(spec, compute, policy, ratio):
    us = units(spec)
    profiles = [dataclasses.replace(p, compute_ms=compute[p.index]) for p in unit_profiles(us)]
    plan = build_plan(profiles, 2e4, OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio))
    plan.validate(profiles)
    a = build_actions(us, plan)
    batched = [w for ws in a.batches for w in ws]
    users = {w.input_index: w.users for u in us for w in u.weights}
    assert len(batched) == len(set(batched)) and set(batched) | set(a.resident) == set(users)
    carried = {w for b in a.carry for w in a.batches[b]}
    assert all(max(users[w]) < a.carry_unit for w in carried), "a carried weight is still read this step"
    life = batch_lifetimes(a)
    for b, ws in enumerate(a.batches):
        for w in ws:  # alive from before its first reader runs to after its last, in this step
            first, last = 2 * min(users[w]) + 1, 2 * max(users[w]) + 1
            assert any(lo <= first and last <= hi for lo, hi in life[b]), (b, w, life[b])
    for u in range(len(a.wait)):  # a unit waits on every batch it reads that was not waited on before
        waited = {w for k in range(u + 1) for b in a.wait[k] for w in a.batches[b]}
        assert all(w in waited or w in a.resident for w in (x.input_index for x in us[u].weights))
