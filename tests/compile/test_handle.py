"""The offload handle (what offload made, its figures, release), the transfer seam and arena lookups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers.ranges import registered_ranges
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.compile.handle import OffloadHandle
from magi_core.errors import MagiError
from magi_core.execute.residency import RESIDENT
from magi_core.execute.transfer import PerTensorTransfer, UnitTransfer

SPEC = TransformerSpec(layers=2, hidden=32, heads=2)
CFG = magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=1.0, unit_compiler="eager")

def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding, wherever the offloaded output lives (the device, or the host on CPU)."""
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=1e-4, atol=1e-4)



@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_handle_owns_host_weights_runtimes_and_figures(shm_dir: str) -> None:
    model = build_transformer(SPEC)
    x = example_input(SPEC, tokens=6)
    with torch.no_grad():
        ref = model(x)
    with pytest.raises(MagiError, match="not offloaded"):
        magi_core.handle(model)
    magi_core.offload(model, CFG.replace(gpu_resident_weight_ratio=0.0))
    h = magi_core.handle(model)
    try:
        assert h.host is not None and h.host.weight_bytes == sum(p.nbytes for p in model.parameters())
        with pytest.raises(MagiError, match="nothing compiled yet"):
            _ = h.runtime
        with torch.no_grad():
            for _ in range(4):
                close(model(x), ref)
        assert h.compile_count == 1 and len(h.runtimes) == 1
        (s,) = h.stats()
        assert s.phase == "planned" and s.steps == 4 and s.policy == "HEURISTIC"
        assert s.resident_bytes == 0 and s.streamed_bytes_per_step == h.host.weight_bytes
        # a steady-state step streams every weight once (the last unit prefetches the next step's first ones)
        with torch.no_grad():
            model(x)
        (s2,) = h.stats()
        assert s2.steps == 5
        step_bytes = s2.streamed_bytes_total - s.streamed_bytes_total  # one span per unit: alignment gaps too
        assert h.host.weight_bytes <= step_bytes <= 1.125 * h.host.weight_bytes + 4096 * s.units
        assert s2.weight_copies - s.weight_copies == len(list(model.parameters()))
        t = h.runtime.executor.transfer
        per_step = s.units if isinstance(t, UnitTransfer) else len(list(model.parameters()))
        assert s2.copy_calls - s.copy_calls == per_step
        assert (s2.transfer_buffer_bytes >= h.host.weight_bytes / s.units) == isinstance(t, UnitTransfer)
        with pytest.raises(MagiError, match="already offloaded"):
            magi_core.offload(model)
    finally:
        magi_core.release(model)


def test_release_frees_resident_copies_ranges_and_refuses_calls(shm_dir: str) -> None:
    model = build_transformer(SPEC)
    x = example_input(SPEC, tokens=6)
    ranges = registered_ranges()
    resident_before = len(RESIDENT)
    magi_core.offload(model, CFG)
    h = magi_core.handle(model)
    with torch.no_grad():
        for _ in range(4):
            model(x)
    assert h.stats()[-1].resident_bytes == h.host.weight_bytes
    assert len(RESIDENT) > resident_before, "ratio 1 keeps device copies of every weight"
    assert len(registered_ranges()) > len(ranges)
    magi_core.release(model)
    assert h.released
    assert len(RESIDENT) == resident_before, "release frees the resident device copies"
    assert registered_ranges() == ranges
    with pytest.raises(MagiError, match="released"), torch.no_grad():
        model(x)
    magi_core.release(model)  # idempotent


def test_release_with_restore_gives_the_eager_model_back(shm_dir: str) -> None:
    model = build_transformer(SPEC)
    x = example_input(SPEC, tokens=6)
    with torch.no_grad():
        ref = model(x)
    magi_core.offload(model, CFG)
    with torch.no_grad():
        model(x)
    magi_core.release(model, restore=True)
    with torch.no_grad():
        close(model(x), ref)
    with pytest.raises(MagiError, match="not offloaded"):
        magi_core.handle(model)


class HalfPriceTransfer(PerTensorTransfer):
    """A transfer that says it moves half the bytes: planning must account through it."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.fetched: list[int] = []

    def fetch(
        self, hosts: Sequence[torch.Tensor], event: Any = None, batch: int | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        self.fetched.append(len(hosts))
        return super().fetch(hosts, event, batch)

    def nbytes(self, sizes: Sequence[int]) -> int:
        return sum(sizes) // 2


def test_executor_copies_and_plans_only_through_its_transfer() -> None:
    from magi_core.compile.backend import build_runtime
    from magi_core.config import OffloadConfig
    from magi_core.plugin.manager import get_backend

    model = build_transformer(SPEC).eval()
    x = example_input(SPEC, tokens=6)
    with torch.no_grad():
        ref = model(x)
    made: list[HalfPriceTransfer] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        cfg = OffloadConfig(policy="BASE", gpu_resident_weight_ratio=0.0, unit_compiler="eager")
        runtime = build_runtime(gm, example_inputs, cfg)
        t = HalfPriceTransfer(get_backend(), runtime.executor.device)
        runtime.executor.transfer = t
        made.append(t)
        return runtime

    f = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(4):
            close(f(x), ref)
    (t,) = made
    copies, nbytes = sum(t.fetched), t.bytes_copied
    with torch.no_grad():
        close(f(x), ref)
    # a steady-state step streams every weight once, all of it through the transfer
    assert sum(t.fetched) - copies == len(list(model.parameters()))
    assert t.bytes_copied - nbytes == sum(p.nbytes for p in model.parameters())


def test_handle_planning_accounts_bytes_through_the_transfer() -> None:
    from magi_core.execute.actions import build_actions, unit_profiles

    h = OffloadHandle("m")
    model = build_transformer(SPEC).eval()
    x = example_input(SPEC, tokens=6)
    f = torch.compile(model, backend=h.backend,
                      options={"policy": "BASE", "gpu_resident_weight_ratio": 0.0, "unit_compiler": "eager"})
    with torch.no_grad():
        for _ in range(3):
            f(x)
    ex = h.runtime.executor
    half = HalfPriceTransfer.nbytes
    full = unit_profiles(ex.units, None, ex.transfer.nbytes)
    halved = unit_profiles(ex.units, None, lambda s: half(ex.transfer, s))  # type: ignore[arg-type]
    assert sum(p.weight_bytes for p in full) == ex.split.weight_bytes
    assert sum(p.weight_bytes for p in halved) < sum(p.weight_bytes for p in full)
    assert ex.plan is not None
    acts = build_actions(ex.units, ex.plan, lambda s: half(ex.transfer, s))  # type: ignore[arg-type]
    assert 0 < acts.streamed_bytes < ex.actions.streamed_bytes  # type: ignore[union-attr]


def test_locate_finds_each_weight_in_its_arena(shm_dir: str) -> None:
    model = build_transformer(SPEC)
    magi_core.offload(model, CFG)
    hw = magi_core.handle(model).host
    assert hw is not None
    try:
        seen: dict[str, list[tuple[int, int]]] = {}
        for name, p in model.named_parameters():
            loc = hw.locate(p)
            assert loc is not None, name
            assert loc.nbytes == p.nbytes and loc.pinned
            arena = next(a for a in hw.arenas if a.key == loc.arena)
            assert torch.equal(arena.buf[loc.offset: loc.offset + loc.nbytes], p.detach().reshape(-1).view(torch.uint8))
            seen.setdefault(loc.arena, []).append((loc.offset, loc.offset + loc.nbytes))
        for spans in seen.values():  # weights never overlap inside an arena
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert hw.locate(torch.randn(4)) is None
    finally:
        magi_core.release(model)


def test_deepcopy_and_pickle_say_why_not_and_state_dict_works(shm_dir: str) -> None:
    import copy
    import io
    import pickle

    model = build_transformer(SPEC)
    x = example_input(SPEC, tokens=6)
    with torch.no_grad():
        ref = model(x)
    magi_core.offload(model, CFG)
    try:
        with torch.no_grad():
            model(x)
        with pytest.raises(MagiError, match="state_dict"):
            copy.deepcopy(model)
        with pytest.raises(MagiError, match="cannot be copied or pickled"):
            pickle.dumps(model)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        twin = build_transformer(SPEC, seed=3)
        twin.load_state_dict(torch.load(buf))
        with torch.no_grad():
            close(twin(x), ref)
            close(model(x), ref)  # still usable after the refused copies
    finally:
        magi_core.release(model)


def test_training_mode_and_grad_inputs_are_called_out(shm_dir: str) -> None:
    from magi_core.api import InferenceOnlyWarning

    model = build_transformer(SPEC).train()
    with pytest.warns(InferenceOnlyWarning, match=r"training mode .*model.eval\(\)"):
        magi_core.offload(model, CFG)
    try:
        x = example_input(SPEC, tokens=6).requires_grad_(True)
        with pytest.warns(UserWarning, match="without autograd"):
            out = model(x)
        with pytest.raises(MagiError, match="inference only"):
            out.sum().backward()
        assert x.grad is None
    finally:
        magi_core.release(model)
