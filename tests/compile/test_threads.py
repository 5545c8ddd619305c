"""An offloaded model called from several threads from its very first call (compile, profile, plan)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)

import magi_core
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.plugin.manager import get_backend

SPEC = TransformerSpec(layers=3, hidden=32, heads=2)
THREADS = 8

def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding, wherever the offloaded output lives (the device, or the host on CPU)."""
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=1e-4, atol=1e-4)



def call_from_threads(model: torch.nn.Module, xs: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """Call ``model`` 5 times on ``xs[k]`` from thread ``k``, all starting at once; the outputs per thread."""
    errors: list[BaseException] = []
    outs: dict[int, list[torch.Tensor]] = {k: [] for k in range(len(xs))}
    start = threading.Barrier(len(xs))

    def worker(k: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(5):
                    outs[k].append(model(xs[k]))
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return outs


@pytest.mark.parametrize("ratio,transfer", [(0.0, "auto"), (0.5, "auto"), (0.0, "unit")])
def test_first_call_from_many_threads(shm_dir: str, ratio: float, transfer: str) -> None:
    # "unit": every step copies into the same planned device buffer (real copies on the CPU too), so steps of
    # several threads must not overwrite each other's weights
    torch._dynamo.reset()
    model = build_transformer(SPEC)
    xs = [example_input(SPEC, tokens=5, seed=s) for s in range(THREADS)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
    magi_core.offload(model, magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=ratio,
                                                     unit_compiler="eager", transfer=transfer))
    try:
        outs = call_from_threads(model, xs)
        for k in range(THREADS):
            for out in outs[k]:
                close(out, refs[k])
        h = magi_core.handle(model)
        assert h.compile_count == 1, "one compile for one input shape, however many threads call first"
        assert h.runtime.phase == "planned"
    finally:
        magi_core.release(model)


def test_threads_with_two_input_shapes_plan_one_at_a_time_within_the_ratio(shm_dir: str) -> None:
    """Threads calling with two input shapes from the first call: two runtimes plan, one after the other, and
    together keep at most the ratio of the weights resident (what one keeps, the other uses too); they take
    turns in one copy buffer ("unit" copies for real on the CPU too)."""
    torch._dynamo.reset()
    model = build_transformer(SPEC)
    xs = [example_input(SPEC, tokens=5 + 2 * (s % 2), seed=s) for s in range(THREADS)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
    weights = sum(p.nbytes for p in model.parameters())
    magi_core.offload(model, magi_core.OffloadConfig(policy="HEURISTIC", gpu_resident_weight_ratio=0.5,
                                                     unit_compiler="eager", transfer="unit"), dynamic=False)
    try:
        outs = call_from_threads(model, xs)
        for k in range(THREADS):
            for out in outs[k]:
                close(out, refs[k])
        # two graphs, or on rare occasions a third: Dynamo may compile one again when threads race its guards
        # (its log says "Unexpected recompilation"); every one that planned counts against the same ratio
        rts = [r for r in magi_core.handle(model).runtimes if r.phase == "planned"]
        assert len(rts) >= 2
        held: dict = {}
        for r in rts:
            held.update(r.resident_hosts)
        assert held and sum(held.values()) <= 0.5 * weights
    finally:
        magi_core.release(model)


def test_profiling_ranges_stay_balanced_while_another_thread_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compiler.is_compiling() is one flag for the process: another thread's compile set it between a push
    and its pop, so the pop was skipped (a threaded probe on magidev: "magi_range_pop: no range is open")."""
    opened: list[str] = []
    backend = dataclasses.replace(get_backend(), _range_push=opened.append, _range_pop=lambda: opened.pop())
    backend.range_push("outer")
    backend.range_push("inner")
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # another thread starts compiling
    backend.range_pop()
    assert opened == ["outer"]
    backend.range_push("inner again")
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)  # and is done
    backend.range_pop()
    backend.range_pop()
    assert opened == []
    compiled = torch.compile(lambda x: _ranged(backend, x), backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0)) and opened == []  # traced: no-ops


def _ranged(backend: Any, x: torch.Tensor) -> torch.Tensor:
    with backend.range("compiled"):
        return x * 2


class _ByShape(torch.nn.Module):
    """Two input shapes, two graphs reading different weights (as a prefill and a decode step use their own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) if x.shape[0] == 3 else torch.tanh(self.b(x))


def _by_shape_offloaded(xs: list[torch.Tensor]) -> tuple[_ByShape, list[torch.Tensor], int]:
    """A :class:`_ByShape` model, its eager outputs for ``xs``, and the model offloaded under a budget that holds one
    graph's weights resident, not both graphs' streaming; returns the model, the outputs and the budget."""
    torch._dynamo.reset()
    model = _ByShape().eval()
    with torch.no_grad():
        refs = [model(x) for x in xs]
    budget = model.a.weight.nbytes + model.a.bias.nbytes + 1024
    magi_core.offload(model, magi_core.OffloadConfig(unit_compiler="eager", transfer="unit", warmup_calls=2,
                                                     device_memory_budget_bytes=budget), dynamic=False)
    return model, refs, budget


def test_threads_with_graphs_that_take_each_others_memory_back(shm_dir: str) -> None:
    """Threads call two graphs of a model whose budget holds one graph's weights resident, not both graphs'
    streaming: the graph planned second takes the first one's memory back while other threads run it (their calls
    plan it again), and every output is right; the graphs end within the budget."""
    xs = [torch.randn(3 if s % 2 else 5, 64, generator=torch.Generator().manual_seed(s)) for s in range(THREADS)]
    model, refs, budget = _by_shape_offloaded(xs)
    try:
        outs = call_from_threads(model, xs)
        for k in range(THREADS):
            for out in outs[k]:
                close(out, refs[k])
        with torch.no_grad():
            for k in range(2):
                close(model(xs[k]), refs[k])
        rts = magi_core.handle(model).runtimes
        held: dict = {}
        for r in rts:
            held.update(r.resident_hosts)
        buffers = {b.data_ptr(): b.numel() for r in rts
                   if (b := getattr(r.executor.transfer, "device_buffer", None)) is not None}
        assert sum(held.values()) + sum(buffers.values()) <= budget
    finally:
        magi_core.release(model)


def test_a_graph_whose_memory_is_taken_back_between_its_planning_and_its_step_plans_again(shm_dir: str) -> None:
    """Another graph's thread may take this graph's memory back after this call planned it and before its step
    starts (found once in the threaded test above on magidev): the call plans again and runs, it does not raise
    ExecutorSuspended. The window is hit on purpose here: the other graph takes the memory back as the step begins,
    once in the fast path and once right after the plan made for it."""
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
    model, refs, _ = _by_shape_offloaded(xs)
    try:
        with torch.no_grad():
            for _ in range(3):
                for x in xs:
                    model(x)
            first, second = sorted(magi_core.handle(model).runtimes, key=lambda r: id(r))
            ex = first.executor
            run, taken = ex.run, []

            def taken_back_first(args: Any, timer: Any) -> Any:
                if len(taken) < 2:  # as another thread would, between this graph's planning and its step
                    with second.plan_lock if second.plan_lock is not None else contextlib.nullcontext():
                        second._evictions = 0
                        taken.append(second._evict_peers())
                return run(args, timer)

            ex.run = taken_back_first  # type: ignore[method-assign]
            outs = [model(x) for x in xs]
        assert taken == [True, True], "the test must take the memory back twice"
        for out, ref in zip(outs, refs, strict=True):
            close(out, ref)
    finally:
        magi_core.release(model)
