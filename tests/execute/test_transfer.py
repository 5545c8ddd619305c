"""Weight transfers: one copy per weight, or one copy per unit into a planned device buffer with a view per weight."""

from __future__ import annotations

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from hypothesis import given
from hypothesis import strategies as st

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.execute.actions import StepActions, batch_lifetimes
from magi_core.execute.executor import make_transfer
from magi_core.execute.transfer import PerTensorTransfer, UnitTransfer, plan_span
from magi_core.execute.transfer.shared import SharedBuffer
from magi_core.host.arena import PAGE
from magi_core.plan.packing import overlaps, pack
from magi_core.plugin.manager import get_backend

SPEC = TransformerSpec(layers=3, hidden=32, heads=2)




def _arena(*shapes: tuple[int, ...], gap: int = 64, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    item = dtype.itemsize
    sizes = [int(torch.Size(s).numel()) * item for s in shapes]
    buf = torch.zeros(sum(sizes) + gap * len(shapes), dtype=torch.uint8)
    out, off = [], 0
    for s, n in zip(shapes, sizes, strict=True):
        out.append(buf[off:off + n].view(dtype).view(s))
        off += n + gap
    for k, t in enumerate(out):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(k)))
    return out


def _actions(batches: list[tuple[int, ...]], free: list[tuple[int, ...]], issue: list[tuple[int, ...]],
             start: tuple[int, ...] = (), carry: tuple[int, ...] = ()) -> StepActions:
    return StepActions(resident=(), batches=tuple(batches), batch_unit=tuple(range(len(batches))), start=start,
                       carry=carry, issue=tuple(issue), wait=tuple(() for _ in issue), free=tuple(free),
                       streamed_bytes=0, resident_bytes=0)


def test_batch_lifetimes_run_from_issue_to_last_use_and_wrap_for_carried_batches() -> None:
    # 3 units; batch 0 (weights 0, 1) carried into the step, weight 1 also used by unit 2; batch 1 issued at
    # unit 0 for unit 1; batch 2 issued at start for unit 2.
    acts = _actions([(0, 1), (2,), (3,)], free=[(0,), (2,), (1, 3)], issue=[(1,), (), ()], start=(0, 2), carry=(0,))
    assert batch_lifetimes(acts) == [((0, 5), (4, 5)), ((0, 3),), ((0, 5),)]
    acts = _actions([(0,), (1,)], free=[(0,), (1,)], issue=[(0,), (1,)])
    assert batch_lifetimes(acts) == [((0, 1),), ((2, 3),)]  # disjoint: the two may share bytes


def test_packing_shares_bytes_only_between_batches_alive_at_different_times() -> None:
    p = pack([100, 100, 300], [((0, 1),), ((2, 3),), ((1, 2),)], alignment=64)
    assert p.offsets[0] == p.offsets[1]  # never alive together: same place
    assert p.offsets[2] == 0 and p.offsets[0] >= 320  # the big one first; the others after it
    assert p.total == p.offsets[0] + 128 and p.shares_with == ((1,), (0,), ())
    with pytest.raises(ValueError, match="alignment"):
        pack([1], [((0, 0),)], alignment=48)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20), st.integers(0, 6), st.booleans()),
                min_size=1, max_size=24))
def test_packing_never_overlaps_live_batches(batches: list[tuple[int, int, int, bool]]) -> None:
    sizes = [b[0] for b in batches]
    lives = [((s, s + d),) if not wrap else ((0, d), (20, 21)) for _, s, d, wrap in batches]
    p = pack(sizes, lives, alignment=256)
    assert all(o % 256 == 0 for o in p.offsets) and p.total % 256 == 0
    peak = max(sum(sizes[i] for i in range(len(sizes)) if overlaps(lives[i], ((t, t),))) for t in range(28))
    assert peak <= p.total <= sum(-(-x // 256) * 256 for x in sizes)
    for i in range(len(sizes)):
        assert p.offsets[i] + sizes[i] <= p.total
        for j in range(i):
            share = sizes[i] and sizes[j] and p.offsets[i] < p.offsets[j] + sizes[j] \
                and p.offsets[j] < p.offsets[i] + sizes[i]
            assert not (share and overlaps(lives[i], lives[j])), (i, j)
            assert bool(share) == (j in p.shares_with[i])


def _fetch(t: UnitTransfer, hosts: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """Fetch as the executor does: the copy after the current stream's work, the current stream after the copy."""
    dm = get_backend().device_module
    gate = dm.Event()
    gate.record(dm.current_stream())
    t.copy_stream.wait_event(gate)
    outs, ev = t.fetch(hosts, batch=batch)
    dm.current_stream().wait_event(ev)
    return outs


def _unit_transfer(batches: list[list[torch.Tensor]]) -> UnitTransfer:
    backend = get_backend()
    t = UnitTransfer(backend, backend.device())
    n = len(batches)
    acts = _actions([tuple(range(10 * b, 10 * b + len(ws))) for b, ws in enumerate(batches)],
                    free=[tuple(range(10 * b, 10 * b + len(ws))) for b, ws in enumerate(batches)],
                    issue=[(b,) for b in range(n)])
    t.set_actions(acts, [[w.nbytes for w in ws] for ws in batches])
    return t


def test_unit_transfer_copies_a_batch_of_one_arena_once_into_its_place() -> None:
    ws = _arena((8, 4), (16,), (3, 5), gap=0)
    t = _unit_transfer([ws])
    assert t.buffer_bytes >= sum(w.nbytes for w in ws)
    outs = _fetch(t, ws, 0)
    assert t.copy_calls == 1 and t.copies == 3
    for o, w in zip(outs, ws, strict=True):
        assert o.shape == w.shape and o.stride() == w.stride() and o.dtype == w.dtype
        assert o.data_ptr() != w.data_ptr() and torch.equal(o.cpu(), w)  # a real copy, on the CPU too
    views = [o.data_ptr() for o in outs]
    for w in ws:
        w.add_(1.0)
    for o in outs:
        t.release(o, None)
    outs = _fetch(t, ws, 0)  # same place, same views, fresh values
    assert [o.data_ptr() for o in outs] == views and t.copy_calls == 2
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, ws, strict=True))


def test_unit_transfer_copies_per_storage_or_per_weight_when_no_tight_span() -> None:
    a, b = _arena((4, 4), (4,), gap=0), _arena((2, 3), (5,), gap=0, dtype=torch.float64)
    loose = _arena((4,), (4,), gap=10_000)
    perm = torch.randn(6, 4).t()  # dense, not contiguous: keeps its strides
    t = _unit_transfer([[a[0], b[0], a[1], b[1]], loose, [perm]])
    # (the three batches live one after the other and may share a place: each is checked, then released)
    outs = _fetch(t, [a[0], b[0], a[1], b[1]], 0)
    assert t.copy_calls == 2  # one per storage (dtype arena)
    for o, w in zip(outs, [a[0], b[0], a[1], b[1]], strict=True):
        assert o.dtype == w.dtype and torch.equal(o.cpu(), w)
        t.release(o, None)
    outs = _fetch(t, loose, 1)
    assert t.copy_calls == 4  # the gap does not fit the place: one copy each
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, loose, strict=True))
    for o in outs:
        t.release(o, None)
    (out,) = _fetch(t, [perm], 2)
    assert out.stride() == perm.stride() and torch.equal(out.cpu(), perm) and t.fallbacks == 0


def _page_aligned(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """float32 weights of whole pages back to back from a page boundary (registrable apart, as an arena's pieces)."""
    sizes = [int(torch.Size(s).numel()) * 4 for s in shapes]
    raw = torch.empty(sum(sizes) + PAGE, dtype=torch.uint8)
    at = -raw.data_ptr() % PAGE
    out = []
    for k, (s, n) in enumerate(zip(shapes, sizes, strict=True)):
        assert n % PAGE == 0
        out.append(raw[at:at + n].view(torch.float32).view(s).copy_(torch.randn(s, generator=torch.Generator()
                                                                                    .manual_seed(k))))
        at += n
    return out


def test_unit_transfer_never_copies_across_a_registered_bound() -> None:
    # An arena pinned in pieces (while it was filled, or under a pin budget) is several registrations; a runtime
    # refuses one copy from two of them (CUDA: invalid argument), so a unit's span is split at every bound, and
    # laid out again when the registrations change.
    be = get_backend()
    ws = _page_aligned((32, 32), (1024,), (16, 64), (1024,))
    base, cut, end = ws[0].data_ptr(), ws[2].data_ptr(), ws[3].data_ptr() + ws[3].nbytes
    held = [base, cut]
    be.host_register(base, cut - base)
    be.host_register(cut, end - cut)
    try:
        assert be.registered.crossed(base, end) and not be.registered.crossed(base, cut)
        assert plan_span(ws, registered=be.registered) is None and plan_span(ws[:2], registered=be.registered)
        t = _unit_transfer([ws])
        expected = 0
        for calls, drop in ((2, cut), (2, base), (1, None)):  # [base, cut) alone still ends inside the span
            outs = _fetch(t, ws, 0)
            expected += calls
            assert t.copy_calls == expected
            assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, ws, strict=True))
            for o in outs:
                t.release(o, None)
            if drop is not None:
                be.host_unregister(drop)
                held.remove(drop)
        assert t.fallbacks == 0
    finally:
        for p in held:
            be.host_unregister(p)


def test_unit_transfer_never_writes_a_place_still_in_use() -> None:
    # Batches 0 and 1 share a place (disjoint lifetimes); fetching 1 before 0 is released allocates instead.
    w0, w1 = _arena((8,), (8,), gap=0), _arena((8,), (8,), gap=0)
    t = _unit_transfer([w0, w1])
    assert t._slots[0].offset == t._slots[1].offset
    first = _fetch(t, w0, 0)
    _fetch(t, w1, 1)
    assert t.fallbacks == 1 and all(torch.equal(o.cpu(), w) for o, w in zip(first, w0, strict=True))
    for o in first:
        t.release(o, None)
    _fetch(t, w1, 1)
    assert t.fallbacks == 1
    _fetch(t, w0, 0)  # batch 1 was never released (a step failed): allocate, until abort() says so
    assert t.fallbacks == 2
    t.abort()
    _fetch(t, w0, 0)
    assert t.fallbacks == 2


def test_transfers_sharing_one_buffer_take_turns_and_size_it_for_the_largest_plan() -> None:
    backend = get_backend()
    shared = SharedBuffer(backend.record_stream, backend.device_module.Event)
    small, large = _arena((8,), gap=0), _arena((4096,), gap=0)
    a, b = _unit_transfer([small]), _unit_transfer([large])
    a.share(shared)
    assert shared.nbytes == a.buffer_bytes and a.device_buffer is shared.tensor
    b.share(shared)  # grows it for b's plan; a drops its views of the old one and follows
    assert shared.nbytes == b.buffer_bytes > a.buffer_bytes and a.device_buffer is None
    assert a.begin_step(()) is True and a.device_buffer is shared.tensor  # the first turn: nothing carried
    (out,) = _fetch(a, small, 0)
    assert out.data_ptr() == shared.tensor.data_ptr() and torch.equal(out.cpu(), small[0])
    a.release(out, None)
    assert a.begin_step(()) is False  # its own turn again: what it carried is still there
    assert b.begin_step(()) is True and a.begin_step(()) is True  # each turn of the other overwrote it
    b.close()  # the buffer shrinks back to what the remaining plan needs once it is planned again
    assert shared.tensor is not None
    a.set_actions(a_actions := _actions([(0,)], free=[(0,)], issue=[(0,)]), [[small[0].nbytes]])
    assert a_actions.batches and shared.nbytes == a.buffer_bytes
    a.close()
    assert shared.tensor is None  # nobody uses it any more


@pytest.mark.parametrize("policy,ratio", [("BASE", 0.0), ("HEURISTIC", 0.0), ("COST_EFFECTIVE", 0.5)])
def test_offloaded_model_with_one_copy_per_unit(shm_dir: str, policy: str, ratio: float) -> None:
    torch._dynamo.reset()
    model, ref = build_transformer(SPEC), build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    magi_core.offload(model, magi_core.OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio,
                                                     unit_compiler="eager", transfer="unit"))
    try:
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-4, atol=1e-4)
            ex = magi_core.handle(model).runtime.executor
            t = ex.transfer
            assert isinstance(t, UnitTransfer) and ex.actions is not None
            calls, copies = t.copy_calls, t.copies
            model(x)
            assert t.copies - copies > t.copy_calls - calls == len(ex.actions.batches) >= 1  # one copy per batch
            assert t.fallbacks == 0 and 0 < t.buffer_bytes < 2 * ex.actions.streamed_bytes + 512 * len(t._slots)
            for m in (model, ref):
                with torch.no_grad():
                    m.blocks[1].mlp.up.weight.mul_(2.0)  # type: ignore[index, union-attr]
            torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-4, atol=1e-4)
    finally:
        magi_core.release(model)


class _PagedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)  # 32 KiB: every weight starts on a page of the arena
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _PagedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_PagedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("pieces", ["while_filling", "budget"])
def test_offloaded_model_pinned_in_pieces_is_exact(shm_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                   pieces: str) -> None:
    # The host arena registered one weight at a time while it was filled (pieces cut between tensors, so each
    # unit's two weights lie in two registrations), or up to the middle of a unit (a pin budget of 5.5 of the 8
    # weights): every copy stays inside one registration or outside all, and the outputs are the reference's
    # (on CUDA one copy across a registration's bound fails: invalid argument).
    from magi_core.host import pinning

    torch._dynamo.reset()
    monkeypatch.setattr(pinning, "AHEAD_GROUP", PAGE)
    model, ref = _PagedNet().eval(), _PagedNet().eval()
    weight = 32 << 10
    if pieces == "budget":
        monkeypatch.setenv("MAGI_PIN_BUDGET_GB", str(5.5 * weight / 2**30))
    x = torch.randn(3, 64)
    magi_core.offload(model, magi_core.OffloadConfig(policy="BASE", gpu_resident_weight_ratio=0.0,
                                                     unit_compiler="eager", transfer="unit"))
    try:
        h = magi_core.handle(model)
        assert h.host is not None
        if pieces == "budget":
            assert h.host.pinned_bytes == 5 * weight  # the budget's end falls between the third unit's weights
        else:
            assert len(h.host.pinned_ranges) == 8 and h.host.pinned_bytes == 8 * weight
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-5, atol=1e-5)
            ex = h.runtime.executor
            t = ex.transfer
            assert isinstance(t, UnitTransfer) and ex.actions is not None
            calls = t.copy_calls
            model(x)
            assert t.copy_calls - calls > len(ex.actions.batches)  # split at the registrations' bounds
            assert t.fallbacks == 0
    finally:
        magi_core.release(model)


def test_config_chooses_the_transfer(shm_dir: str) -> None:
    auto = UnitTransfer if get_backend().is_accelerator else PerTensorTransfer
    for kind, cls in (("per_tensor", PerTensorTransfer), ("unit", UnitTransfer), ("auto", auto)):
        torch._dynamo.reset()
        model = build_transformer(SPEC)
        x = example_input(SPEC, tokens=5)
        magi_core.offload(model, magi_core.OffloadConfig(transfer=kind, unit_compiler="eager"))
        try:
            with torch.no_grad():
                model(x)
            t = magi_core.handle(model).runtime.executor.transfer
            assert type(t) is cls
            assert (t.copy_calls == t.copies) == (cls is PerTensorTransfer)
        finally:
            magi_core.release(model)
    assert magi_core.OffloadConfig().transfer == "auto"
    with pytest.raises(magi_core.ConfigError, match="transfer"):
        magi_core.OffloadConfig(transfer="span")


def test_auto_transfer_is_one_copy_per_unit_on_accelerators_only() -> None:
    import dataclasses

    cpu = get_backend()
    if cpu.is_accelerator:
        pytest.skip("builds an accelerator facade from the CPU backend's")
    acc = dataclasses.replace(cpu, device_type="meta")
    assert type(make_transfer("auto", acc, torch.device("meta"))) is UnitTransfer
    assert type(make_transfer(None, cpu, torch.device("cpu"))) is PerTensorTransfer
    assert type(make_transfer("per_tensor", acc, torch.device("meta"))) is PerTensorTransfer


def test_release_hands_device_tensors_to_record_stream_and_host_tensors_to_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the CPU backend record_stream is never called; an accelerator facade over the host module (device type
    # meta) shows the release reaching Tensor.record_stream on the compute stream, exactly for device tensors.
    import dataclasses

    cpu = get_backend()
    if cpu.is_accelerator:
        pytest.skip("builds an accelerator facade from the CPU backend's")
    acc = dataclasses.replace(cpu, device_type="meta")
    calls: list[tuple[torch.Tensor, object]] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: calls.append((self, stream)))
    stream = cpu.device_module.current_stream()
    dev, host = torch.empty(4, device="meta"), torch.empty(4)
    for backend in (acc, cpu):
        PerTensorTransfer(backend, torch.device(backend.device_type)).release(dev, stream)
        backend.record_stream(host, stream)
    assert len(calls) == 1 and calls[0][0] is dev and calls[0][1] is stream


@pytest.mark.parametrize("kind", ["unit", "per_tensor"])
def test_host_runs_ahead_only_when_fetches_do_not_allocate(shm_dir: str, kind: str) -> None:
    # Per-weight allocations are bounded by keeping the host at most HOST_LEAD_UNITS ahead of the device; the
    # unit transfer's memory is fixed by the plan, so its host never blocks before issuing copies.
    torch._dynamo.reset()
    model = build_transformer(SPEC)
    magi_core.offload(model, magi_core.OffloadConfig(transfer=kind, unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(3):
                model(example_input(SPEC, tokens=5))
        ex = magi_core.handle(model).runtime.executor
        waits = [s for s in ex._sync_before if s >= 0]
        assert ex.transfer.allocates == (kind == "per_tensor")
        assert (len(waits) > 0) == (kind == "per_tensor")
    finally:
        magi_core.release(model)
