"""Weights changed after offload are seen by the next call, at every ratio and policy.

The executor here copies through a transfer that really copies (``torch.clone``) even on the CPU backend,
so a device copy kept across calls (resident weights, the next call's prefetched first weights) is a
separate buffer and goes stale when the host weight changes; the CPU backend's own transfer would alias
the host tensor and hide exactly that bug.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers.copying import CloningTransfer
from helpers.torch_calls import TorchCalls
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.execute import executor as executor_mod
from magi_core.execute.freshness import WeightWatch
from magi_core.execute.residency import ResidentSet, ResidentStore
from magi_core.execute.transfer import UnitTransfer
from magi_core.plugin.manager import get_backend

SPEC = TransformerSpec(layers=3, hidden=32, heads=2)

def close(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """Equal up to float32 rounding, wherever the offloaded output lives (the device, or the host on CPU)."""
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=1e-4, atol=1e-4,
                               msg=None if msg is None else (lambda m: f"{msg}: {m}"))





class Scaled(nn.Module):
    """A linear stack with a buffer the forward reads (a buffer edit must be seen too)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


class Wide(nn.Module):
    """Three 1 MiB linear layers: copies long enough for another thread to act while they are queued."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@contextlib.contextmanager
def _offloaded(ratio: float, warm: int = 4) -> Iterator[tuple[nn.Module, nn.Module, torch.Tensor]]:
    """A transformer offloaded at ``ratio`` (eager units) after ``warm`` calls (4: its static plan, steady state),
    its eager twin and an input, under ``torch.no_grad``; released afterwards."""
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=ratio, unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(warm):
                model(x)
            yield model, ref, x
    finally:
        magi_core.release(model)


@pytest.fixture(autouse=True)
def _copying_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", CloningTransfer)
    torch._dynamo.reset()


def _edit_mul(m: nn.Module) -> None:
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight.mul_(1.5)  # type: ignore[index, union-attr]


def _edit_copy(m: nn.Module) -> None:
    with torch.no_grad():
        w = m.blocks[-1].mlp.down.weight  # type: ignore[index, union-attr]
        w.copy_(torch.flip(w, dims=[0]))


def _edit_data_inplace(m: nn.Module) -> None:  # peft's unsafe LoRA merge: weight.data += delta
    w = m.blocks[0].mlp.up.weight  # type: ignore[index, union-attr]
    w.data += 0.25 * torch.ones_like(w)


def _edit_assign(m: nn.Module) -> None:
    lin = m.blocks[0].attn.out  # type: ignore[index, union-attr]
    lin.weight = nn.Parameter(lin.weight.detach() * -1.0)


def _edit_data_assign(m: nn.Module) -> None:  # diffusers' fuse_lora without peft: weight.data = fused
    lin = m.blocks[1].mlp.gate  # type: ignore[index, union-attr]
    lin.weight.data = lin.weight.detach() + 0.1


def _edit_load_state_dict(m: nn.Module) -> None:
    m.load_state_dict(build_transformer(SPEC, seed=7).state_dict())


def _edit_norm(m: nn.Module) -> None:
    with torch.no_grad():
        m.norm.weight.fill_(2.0)  # type: ignore[union-attr, operator]


EDITS: dict[str, Callable[[nn.Module], None]] = {
    "mul_": _edit_mul,
    "copy_": _edit_copy,
    "data_inplace": _edit_data_inplace,
    "assign_parameter": _edit_assign,
    "data_assign": _edit_data_assign,
    "load_state_dict": _edit_load_state_dict,
    "norm_fill_": _edit_norm,
}


@pytest.mark.parametrize("transfer,policy,ratio", [
    ("per_tensor", "BASE", 0.0), ("per_tensor", "HEURISTIC", 0.0), ("per_tensor", "HEURISTIC", 0.5),
    ("per_tensor", "COST_EFFECTIVE", 0.5), ("per_tensor", "HEURISTIC", 1.0),
    ("unit", "BASE", 0.0), ("unit", "HEURISTIC", 0.5),  # one copy per unit: streamed weights are views of a buffer
])
def test_weight_edits_between_calls_are_seen(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch, transfer: str, policy: str, ratio: float
) -> None:
    # Every kind of edit, one after the other on the same offloaded model (one compile per configuration):
    # each must show in the next two calls, whatever the previous edits left resident or carried.
    if transfer == "unit":
        monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", UnitTransfer)
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    magi_core.offload(model, magi_core.OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio,
                                                     unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(4):  # warm-up, profile, static plan, steady state (prefetch carried across calls)
                close(model(x), ref(x))
            for name, edit in EDITS.items():
                edit(model)
                edit(ref)
                expected = ref(x)
                for _ in range(2):
                    close(model(x), expected, msg=f"after edit {name}")
    finally:
        magi_core.release(model)


@pytest.mark.parametrize("transfer", ["per_tensor", "unit"])
def test_weight_edits_are_seen_by_every_input_shape(shm_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                    transfer: str) -> None:
    # Two input shapes: two runtimes sharing resident device copies (and, with "unit", one copy buffer in
    # turns); an edit must show in both, whichever runs first after it.
    if transfer == "unit":
        monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", UnitTransfer)
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    xs = [example_input(SPEC, tokens=5), example_input(SPEC, tokens=7, seed=1)]
    magi_core.offload(model, magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5,
                                                     unit_compiler="eager"), dynamic=False)
    try:
        with torch.no_grad():
            for _ in range(4):
                for x in xs:
                    close(model(x), ref(x))
            assert len(magi_core.handle(model).runtimes) == 2
            for k, (name, edit) in enumerate(EDITS.items()):
                edit(model)
                edit(ref)
                order = xs if k % 2 == 0 else xs[::-1]
                for _ in range(2):
                    for x in order:
                        close(model(x), ref(x), msg=f"after edit {name}, {x.shape[1]} tokens")
    finally:
        magi_core.release(model)


def test_a_rebound_weight_edited_before_the_other_shape_runs_reaches_it(shm_dir: str) -> None:
    # Shape A copies the new parameter; its bytes then change through .data (no version counter moves); shape B,
    # running next, takes A's copy over and must copy the new bytes, not use the copy made before the edit.
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    xs = [example_input(SPEC, tokens=5), example_input(SPEC, tokens=7, seed=1)]
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=1.0, unit_compiler="eager"),
                      dynamic=False)
    try:
        with torch.no_grad():
            for _ in range(4):
                for x in xs:
                    close(model(x), ref(x))
            _edit_assign(model)
            _edit_assign(ref)
            close(model(xs[0]), ref(xs[0]), msg="shape A after the rebinding")
            for m in (model, ref):
                m.blocks[0].attn.out.weight.data.mul_(-0.5)  # type: ignore[index, union-attr, operator]
            close(model(xs[1]), ref(xs[1]), msg="shape B after the rebinding and the edit")
            close(model(xs[0]), ref(xs[0]), msg="shape A after the edit")
    finally:
        magi_core.release(model)


@pytest.mark.parametrize("transfer,ratio", [("per_tensor", 0.0), ("per_tensor", 0.5), ("unit", 0.0)])
def test_a_weight_rebound_by_another_thread_reaches_every_call_whole(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch, transfer: str, ratio: float
) -> None:
    # Threads call the model while the main thread rebinds a weight's .data to fresh tensors (the old one freed at
    # once): a copy reads its host bytes when the device runs it, so it must hold the data it was issued for.
    # Every output is the old or the new weights' output, never a mix or freed memory.
    if transfer == "unit":
        monkeypatch.setattr(executor_mod, "DEFAULT_TRANSFER", UnitTransfer)
    model = Wide().eval()
    x = torch.randn(64, 512)
    values = [model.layers[1].weight.detach().clone() * s for s in (1.0, -1.0)]
    refs = []
    with torch.no_grad():
        for v in values:
            model.layers[1].weight.data = v.clone()
            refs.append(model(x))
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=ratio, unit_compiler="eager"))
    errors: list[str] = []
    torn: list[float] = []

    def caller() -> None:
        try:
            with torch.no_grad():
                for _ in range(25):
                    out = model(x).cpu()
                    if not any(torch.allclose(out, r, rtol=1e-4, atol=1e-4) for r in refs):
                        torn.append(min(float((out - r).abs().max()) for r in refs))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
        threads = [threading.Thread(target=caller) for _ in range(4)]
        for t in threads:
            t.start()
        k = 0
        while any(t.is_alive() for t in threads):
            model.layers[1].weight.data = values[k % 2].clone()  # the previous tensor is freed here
            k += 1
        for t in threads:
            t.join()
        assert not errors, errors
        assert not torn, f"{len(torn)} of 100 outputs match neither weight (max abs error {max(torn):.3g}); {k} rebinds"
        assert k > 1
    finally:
        magi_core.release(model)


@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("edit", ["mul_", "data_inplace", "load_state_dict"])
def test_an_edit_then_a_new_input_shape_sees_the_edit(shm_dir: str, ratio: float, edit: str) -> None:
    # One shape planned (its resident copies shared in the process), an edit in place (a LoRA fuse), then a new
    # shape (a new resolution or prompt length): the new shape's runtime takes the shared resident copies, which
    # the edit made stale; its every call, the planned ones included, must see the edit.
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    first, second = example_input(SPEC, tokens=5), example_input(SPEC, tokens=7, seed=1)
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=ratio, unit_compiler="eager"),
                      dynamic=False)
    try:
        with torch.no_grad():
            for _ in range(4):
                close(model(first), ref(first))
            EDITS[edit](model)
            EDITS[edit](ref)
            for call in range(5):
                close(model(second), ref(second), msg=f"call {call + 1} of the new shape after edit {edit}")
            close(model(first), ref(first), msg="the first shape after the edit")
    finally:
        magi_core.release(model)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_buffer_edits_are_seen(shm_dir: str, ratio: float) -> None:
    model, ref = Scaled().eval(), Scaled().eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=ratio, unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(4):
                close(model(x), ref(x))
            model.scale.mul_(3.0)
            ref.scale.mul_(3.0)
            close(model(x), ref(x))
            model.register_buffer("scale", torch.full((16,), -1.0))
            ref.register_buffer("scale", torch.full((16,), -1.0))
            close(model(x), ref(x))
    finally:
        magi_core.release(model)


def test_watch_reports_exactly_what_changed() -> None:
    arena = torch.zeros(4096, dtype=torch.uint8)
    a = arena[:1024].view(torch.float32).view(16, 16)
    b = torch.zeros(32, 16)  # views of one base share its version counter: keep b on its own
    c = torch.randn(8)
    args = [a, b, c, torch.randn(3)]
    w = WeightWatch((0, 1, 2))
    assert w.changed(args) == {0, 1, 2}  # first call: everything
    assert w.changed(args) == set()
    b.add_(1.0)  # version counter
    assert w.changed(args) == {1}
    a.data[3, 4] = 7.0  # through .data: no version bump; caught when a sampled byte moves
    a.data[0, 0] = 1.0
    assert w.changed(args) == {0}
    args[2] = torch.randn(8)  # another object
    assert w.changed(args) == {2}
    w.force()
    assert w.changed(args) == {0, 1, 2}
    assert w.changed(args) == set()
    a2 = arena[1024:2048].view(torch.float32)  # another view of a's base: an edit of it moves a's version too
    a2.add_(1.0)
    assert w.changed(args) == {0}  # over-reporting is safe (a re-copy); missing a change is not


def test_resident_copy_follows_its_host_tensor_without_a_change_notice() -> None:
    # ResidentSet re-copies by itself when the tensor passed in is another object or its storage moved; the
    # executor's change set (``changed``) only adds in-place edits of the same storage
    backend = get_backend()
    transfer = CloningTransfer(backend, backend.device())
    store = ResidentStore()
    resident = ResidentSet(store, backend.device(), (1,))
    compute = backend.device_module.current_stream()
    p = nn.Parameter(torch.ones(4))
    env: list[Any] = [None, None]
    for step, value in (("first", 1.0), ("unchanged", 1.0), ("data", 2.0), ("new", 3.0)):
        if step == "data":
            p.data = torch.full((4,), 2.0)  # new storage, same Parameter object
        elif step == "new":
            p = nn.Parameter(torch.full((4,), 3.0))  # another object
        resident.fill([None, p], env, transfer, compute)  # no change set: the executor's watch is not asked
        assert torch.equal(env[1].cpu(), torch.full((4,), value)), step
        assert env[1].data_ptr() != p.data_ptr()  # a real copy (CloningTransfer), not the host tensor itself
    assert resident.copies == 3 and len(store) == 1  # the copies of replaced host tensors were released
    resident.close(transfer, compute)
    assert len(store) == 0


def test_resident_copy_and_its_recorded_address_come_from_one_view() -> None:
    """Another thread rebinds ``p.data`` while the resident copy is being made (found by a threaded probe on
    magidev: the copy held the old bytes, the new address was recorded, and every later call stayed stale)."""
    backend = get_backend()
    store = ResidentStore()
    resident = ResidentSet(store, backend.device(), (0,))
    compute = backend.device_module.current_stream()
    p = nn.Parameter(torch.ones(4))
    new = torch.full((4,), 2.0)

    class RebindDuringCopy(CloningTransfer):
        def fetch_now(self, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
            out = super().fetch_now(host, compute_stream)
            if p.data.data_ptr() != new.data_ptr():
                p.data = new  # lands between the copy and the bookkeeping after it, as a racing thread may
            return out

    transfer = RebindDuringCopy(backend, backend.device())
    env: list[Any] = [None]
    resident.fill([p], env, transfer, compute)
    assert torch.equal(env[0].cpu(), torch.ones(4))  # this call used the bytes it copied
    resident.fill([p], env, transfer, compute)  # the next call sees the new address and copies again
    assert torch.equal(env[0].cpu(), new)
    assert resident.copies == 2 and len(store) == 1
    resident.close(transfer, compute)
    assert len(store) == 0  # nothing orphaned under the old address


def test_resident_set_says_it_is_complete_without_touching_a_tensor() -> None:
    """``complete`` is asked before every step: answered from a count, not by comparing each host tensor with None
    through torch (found on the H200: 1160 such comparisons put 10 ms before a Flux step's first kernel)."""
    backend = get_backend()
    transfer = CloningTransfer(backend, backend.device())
    store = ResidentStore()
    resident = ResidentSet(store, backend.device(), (0, 1, 2))
    compute = backend.device_module.current_stream()
    ps = [nn.Parameter(torch.full((4,), float(i))) for i in range(3)]
    env: list[Any] = [None] * 3
    seen = []
    for part in (range(0, 1), range(1, 3)):
        with TorchCalls() as mode:
            seen.append(resident.complete)
        assert mode.calls == []
        resident.fill(ps, env, transfer, compute, part=part)
    assert seen == [False, False] and resident.complete
    ps[1] = nn.Parameter(torch.full((4,), 7.0))  # another object: its copy is replaced at the next fill
    resident.fill(ps, env, transfer, compute)
    assert resident.complete and torch.equal(env[1].cpu(), torch.full((4,), 7.0))
    resident.close(transfer, compute)
    assert not resident.complete and len(store) == 0


def test_failed_replacement_copy_leaves_the_position_empty_and_the_store_clean() -> None:
    """A host tensor replaced and its new copy failing: the old copy is released once, the set is incomplete (the
    next step makes the copy again) and closing it releases nothing twice."""
    backend = get_backend()
    store = ResidentStore()
    resident = ResidentSet(store, backend.device(), (0, 1))
    compute = backend.device_module.current_stream()
    fail = [False]

    class FailingTransfer(CloningTransfer):
        def fetch_now(self, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
            if fail[0]:
                raise RuntimeError("copy failed")
            return super().fetch_now(host, compute_stream)

    transfer = FailingTransfer(backend, backend.device())
    ps = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))]
    other = ResidentSet(store, backend.device(), (0,))  # another executor sharing the first weight's copy
    env: list[Any] = [None, None]
    resident.fill(ps, env, transfer, compute)
    other.fill(ps, [None], transfer, compute)
    assert len(store) == 2
    ps[0] = nn.Parameter(torch.full((4,), 5.0))
    fail[0] = True
    with pytest.raises(RuntimeError, match="copy failed"):
        resident.fill(ps, env, transfer, compute)
    assert not resident.complete and len(store) == 2  # the shared old copy is still the other set's
    fail[0] = False
    assert resident.acquire(ps, transfer, compute) == frozenset({0})
    resident.fill(ps, env, transfer, compute)
    assert resident.complete and torch.equal(env[0].cpu(), torch.full((4,), 5.0))
    resident.close(transfer, compute)
    other.close(transfer, compute)
    assert len(store) == 0


def test_sparse_edit_through_data_is_seen_after_weights_changed(shm_dir: str) -> None:
    model = build_transformer(SPEC)
    ref = build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=1.0, unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(4):
                model(x)
            for m in (model, ref):
                m.blocks[0].mlp.up.weight.data[5, 3] += 1.0  # type: ignore[index, union-attr]
            magi_core.handle(model).weights_changed()
            close(model(x), ref(x))
    finally:
        magi_core.release(model)


def test_steady_state_calls_copy_no_resident_weight_again(shm_dir: str) -> None:
    with _offloaded(1.0) as (model, _, x):
        ex = magi_core.handle(model).runtime.executor
        assert ex.resident is not None
        copies = ex.resident.copies
        for _ in range(3):
            model(x)
        assert ex.resident.copies == copies, "unchanged weights must not be copied again"


def test_resident_weights_are_checked_just_before_the_unit_that_uses_them_first(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sampling host bytes reads memory far apart (milliseconds on large models): checked all before the first
    # unit, it delays every step; checked per unit, past the first it overlaps the device's work on earlier units.
    with _offloaded(0.99) as (model, ref, x):
        ex = magi_core.handle(model).runtime.executor
        assert ex.actions is not None
        first_use = ex.actions.resident_at
        assert sum(1 for ws in first_use if ws) >= 3, "the test needs resident weights in several units"
        assert sorted(w for ws in first_use for w in ws) == sorted(ex.actions.resident)
        events: list[tuple[str, Any]] = []
        changed = WeightWatch.changed

        def spy_changed(self: WeightWatch, args: Any) -> set[int]:
            events.append(("check", self.indices))
            return changed(self, args)

        def spy_unit(u: int, fn: Any) -> Any:
            def run(a: list[Any]) -> Any:
                events.append(("run", u))
                return fn(a)

            return run

        monkeypatch.setattr(WeightWatch, "changed", spy_changed)
        ex.fns[:] = [spy_unit(u, fn) for u, fn in enumerate(ex.fns)]
        _edit_copy(model)  # a weight of the last block, resident: its unit refreshes it
        _edit_copy(ref)
        close(model(x), ref(x))
        runs = {u: k for k, (what, u) in enumerate(events) if what == "run"}
        checks = {ix: k for k, (what, ix) in enumerate(events) if what == "check"}
        for u, ws in enumerate(first_use):
            if ws:
                at = checks[tuple(ws)]
                assert runs[u] > at, f"unit {u} ran before its resident weights were checked"
                assert u == 0 or runs[u - 1] < at, f"unit {u}'s weights were checked before unit {u - 1} ran"


def test_resident_copies_are_made_before_the_steps_streamed_copies(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long-lived copies made between a step's short-lived streamed buffers would split the allocator's memory:
    # in every call, the resident weights' copies come first.
    model = build_transformer(SPEC)
    x = example_input(SPEC, tokens=5)
    events: list[str] = []
    fetch_now, fetch = CloningTransfer.fetch_now, CloningTransfer.fetch

    def spy_fetch_now(self: CloningTransfer, host: torch.Tensor, compute_stream: Any) -> torch.Tensor:
        events.append("resident")
        return fetch_now(self, host, compute_stream)

    def spy_fetch(self: CloningTransfer, hosts: Any, event: Any = None, batch: int | None = None) -> Any:
        if batch is not None:
            events.append("streamed")
        return fetch(self, hosts, event, batch)

    monkeypatch.setattr(CloningTransfer, "fetch_now", spy_fetch_now)
    monkeypatch.setattr(CloningTransfer, "fetch", spy_fetch)
    magi_core.offload(model, magi_core.OffloadConfig(gpu_resident_weight_ratio=0.5, unit_compiler="eager"))
    try:
        with torch.no_grad():
            calls = []
            for _ in range(5):
                events.clear()
                model(x)
                calls.append(list(events))
        assert any("resident" in c for c in calls) and any("streamed" in c for c in calls)
        for c in calls:
            if "resident" in c and "streamed" in c:
                assert c.index("streamed") > max(k for k, e in enumerate(c) if e == "resident"), c
    finally:
        magi_core.release(model)


def _resident_after_first_unit(model: nn.Module) -> str:
    """The name of a parameter the plan keeps resident and first uses in a unit after the first one that uses
    resident weights (so its check runs after device work was queued)."""
    ex = magi_core.handle(model).runtime.executor
    assert ex.actions is not None and ex.resident is not None
    later = [w for ws in [ws for ws in ex.actions.resident_at if ws][1:] for w in ws]
    assert later, "the test needs resident weights in a later unit than the first"
    by_id = {id(p): n for n, p in model.named_parameters()}
    args_pos = {w: k for k, w in enumerate(ex.resident.indices)}
    names = [by_id[id(h)] for w in later if (h := ex.resident._hosts[args_pos[w]]) is not None and id(h) in by_id
             and h.dim() == 2]
    assert names, "no resident matrix parameter in a later unit"
    return names[-1]


def test_an_edit_whose_refresh_failed_is_copied_at_the_next_call(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check saw the edit, then copying it failed (out of memory, an interrupt): the next call must copy it,
    # not take the check's memory of the new bytes as a copy made.
    with _offloaded(0.99) as (model, ref, x):
        transfer = magi_core.handle(model).runtime.executor.transfer

        def failing_refresh(*args: Any) -> None:
            raise RuntimeError("refresh failed")

        monkeypatch.setattr(transfer, "refresh", failing_refresh)
        name = _resident_after_first_unit(model)  # what is resident depends on the profiled plan
        for m in (model, ref):
            with torch.no_grad():
                w = m.get_parameter(name)
                w.copy_(torch.flip(w, dims=[0]))
        with pytest.raises(RuntimeError, match="refresh failed"):
            model(x)
        monkeypatch.undo()
        close(model(x), ref(x), msg="the call after a failed refresh")


class Counter(nn.Module):
    """A step counter updated inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.lin(x) * self.steps


class AugmentedCounter(Counter):
    """The same counter through an augmented assignment (``self.steps += 1``, an in-place add on a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.lin(x) * self.steps


class Normed(nn.Module):
    """BatchNorm, whose running statistics update in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


class RowWriter(nn.Module):
    """A cache buffer written one row at a time through an indexing view (``buf[i].copy_(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[1].copy_(x[0])
        return self.lin(x) + self.cache.sum(0)


class SliceWriter(RowWriter):
    """The same through a slice and a transposed view (``buf[:, :2].t().mul_(...)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[:, :2].t().mul_(2.0)
        return self.lin(x) + self.cache.sum(0)


@pytest.mark.parametrize("make,train,written", [(Counter, False, "steps"), (AugmentedCounter, False, "steps"),
                                                (Normed, True, "running_mean"),
                                                (RowWriter, False, "cache"), (SliceWriter, False, "cache")])
def test_state_written_inside_forward_is_refused(shm_dir: str, make: Any, train: bool, written: str) -> None:
    model = make().train(train)
    with pytest.raises(magi_core.MagiError, match=rf"writes to module state .*{written}.*inference"):
        magi_core.offload(model, magi_core.OffloadConfig(unit_compiler="eager"))(torch.randn(4, 8))
    magi_core.release(model)


def test_batchnorm_in_eval_mode_is_fine(shm_dir: str) -> None:
    model, ref = Normed().eval(), Normed().eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    magi_core.offload(model, magi_core.OffloadConfig(unit_compiler="eager"))
    try:
        with torch.no_grad():
            for _ in range(3):
                close(model(x), ref(x))
    finally:
        magi_core.release(model)
