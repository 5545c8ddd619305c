"""``magi demo``: a synthetic transformer run resident, then offloaded with each policy and residency ratio.

Prints one table row per run: the compiler that produced it, step time, the plan's predicted step time, peak
device memory, bytes streamed per step, achieved copy rate (bytes streamed / step time), and two norm-wise
relative errors (||out - ref|| / ||ref||): against the resident run, and against a float32 reference; a legend
under the table explains each column once, and a "correct" column says which runs passed the gate. On the CPU
backend the demo first says what that run shows (correctness of every policy and ratio, not speed) and leaves out
what the host cannot measure (step and planned times, peak device memory, copy rate); "err vs fp32" appears only
for low-precision models (a float32 model is its own reference).
Every run gets the same device input (offloaded runs through
:func:`~magi_core.api.compile_offloaded`), so no row pays for an input copy. Runs use Inductor's
default settings, as a user's would.

The pass/fail gate. In float32, every run must match the resident run within 1e-5. In a low-precision dtype
two correct runs do not agree to that: each rounds differently (a compiled graph keeps fused intermediates
in float32, per-unit compiles round at unit boundaries), and on a deep random model the differences grow
layer by layer: two correct runs end as far apart as each is from float32 (``benchmarks/numerics.py``
measures them; its results are in ``benchmarks/results/``). So in low precision the gate asks
that offloading cost no accuracy: every offloaded run must be within :data:`LOW_PRECISION_SLACK` of the
float32-reference error of the model run eagerly in its own dtype. Both references are computed block by
block on the device (one block's weights at a time), so they fit wherever the offloaded runs do; eager
block by block runs the same kernels as eager on the whole model.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from magi_core.bench.models import SyntheticTransformer, TransformerSpec, build_transformer, example_input
from magi_core.plugin.manager import get_backend

logger = logging.getLogger(__name__)
T = TypeVar("T")

POLICIES = ("BASE", "COST_EFFECTIVE", "HEURISTIC")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
#: Defaults by backend kind: (layers, hidden, heads, tokens, dtype).
CPU_DEFAULTS = (4, 256, 4, 64, "float32")
ACCEL_DEFAULTS = (16, 4096, 32, 4096, "bfloat16")
#: float32 runs must match the resident run this closely (norm-wise relative error).
FP32_TOL = 1e-5
#: Low-precision runs may be at most this factor further from float32 than the eager run in their dtype.
LOW_PRECISION_SLACK = 1.1


@dataclass
class Row:
    """One measured run."""

    name: str
    step_ms: float
    peak_bytes: int
    streamed_bytes: int
    rel_err: float
    compiler: str = "eager"
    predicted_ms: float | None = None
    err_fp32: float | None = None
    """Norm-wise relative error against the float32 reference (None in float32: that is ``rel_err``)."""
    note: str = ""
    correct: bool | None = None
    """Whether this offloaded run passed the gate (:func:`check`); None for the resident baseline and before it."""

    @property
    def copy_gbps(self) -> float:
        """Bytes streamed per step over the step time, in GB/s."""
        return self.streamed_bytes / (self.step_ms * 1e-3) / 1e9 if self.step_ms > 0 else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 4 on cpu, 16 on a device)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: 256 on cpu, 4096 on a device)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: 4 on cpu, 32 on a device)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (default: 64 on cpu, 4096 on a device)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="float32 on cpu, bfloat16 on a device")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    parser.add_argument("--ratios", default="0,0.5,1", help="comma-separated gpu_resident_weight_ratio values")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after warm-up)")
    parser.add_argument("--unit-compiler", default="auto", choices=("auto", "inductor", "eager"))
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _spec(args: argparse.Namespace, accel: bool) -> tuple[TransformerSpec, int]:
    layers, hidden, heads, tokens, dtype = ACCEL_DEFAULTS if accel else CPU_DEFAULTS
    spec = TransformerSpec(
        layers=args.layers or layers,
        hidden=args.hidden or hidden,
        heads=args.heads or (heads if (args.hidden or hidden) % heads == 0 else 1),
        dtype=DTYPES[args.dtype or dtype],
    )
    return spec, args.tokens or tokens


def _time(fn: Callable[[], Any], steps: int, sync: Callable[[], None]) -> tuple[float, Any]:
    out = fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps, out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||out - ref|| / ||ref||: robust to where a fused low-precision kernel rounds."""
    ref32 = ref.float()
    return float(torch.linalg.vector_norm(out.float() - ref32) / torch.linalg.vector_norm(ref32).clamp_min(1e-12))


@dataclass
class References:
    """Outputs the runs are compared with: the model eagerly in its dtype and in float32 (None in float32)."""

    eager: torch.Tensor
    fp32: torch.Tensor | None

    @property
    def eager_err_fp32(self) -> float | None:
        """How far the eager run in the model's dtype is from float32: the dtype's own error on this model."""
        return None if self.fp32 is None else _rel_err(self.eager, self.fp32)


def blockwise(model: SyntheticTransformer, x: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``model(x)`` run eagerly on ``device`` one block at a time (weights cast to ``dtype`` when given).

    Needs one block's weights on the device, not the model's; returns the output on the host.
    """
    h = x.to(device) if dtype is None else x.to(device=device, dtype=dtype)
    for part in [*model.blocks, model.norm]:
        dev = copy.deepcopy(part)
        dev = dev.to(device) if dtype is None else dev.to(device=device, dtype=dtype)
        h = dev(h)
        del dev
    return h.cpu()


def references(model: SyntheticTransformer, x: torch.Tensor, device: torch.device) -> References:
    """The eager and float32 references of ``model`` on ``x``, computed block by block on ``device``."""
    eager = blockwise(model, x, device, None)
    fp32 = blockwise(model, x, device, torch.float32) if x.dtype != torch.float32 else None
    return References(eager, fp32)


def _fits(fn: Callable[[], T]) -> tuple[T | None, str]:
    """``(fn(), "")``, or ``(None, why)`` when the device runs out of memory."""
    try:
        return fn(), ""
    except torch.OutOfMemoryError as exc:
        return None, f"does not fit in device memory ({str(exc).splitlines()[0][:80]})"


def run_demo(args: argparse.Namespace, emit: Callable[[str], None] = print) -> list[Row]:
    """Run every configuration and return the table rows (printing progress through ``emit``)."""
    rows, _ = run_demo_with_references(args, emit)
    return rows


def run_demo_with_references(
    args: argparse.Namespace, emit: Callable[[str], None] = print
) -> tuple[list[Row], References]:
    """Run every configuration; return the table rows and the references they were compared with."""
    from magi_core.api import compile_offloaded
    from magi_core.config import OffloadConfig
    from magi_core.host.materialize import materialize

    backend = get_backend()
    dm = backend.device_module
    device = backend.device()
    spec, tokens = _spec(args, backend.is_accelerator)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    emit(f"magi demo on backend {backend.name!r} ({device}): {spec.layers} layers, hidden {spec.hidden}, "
         f"{tokens} tokens, {str(spec.dtype).removeprefix('torch.')}, {spec.weight_bytes() / 1e9:.3f} GB of weights")
    if not backend.is_accelerator:
        emit(CPU_INTRO)
    model = build_transformer(spec)
    x = example_input(spec, tokens)
    compiler = backend.resolve_unit_compiler(OffloadConfig(unit_compiler=args.unit_compiler).unit_compiler)
    rows: list[Row] = []
    bar = tqdm(total=2 + len(policies) * len(ratios), desc="magi demo", disable=args.no_progress, leave=False)

    def sync() -> None:
        dm.synchronize()

    def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float | None]:
        host = out.detach().cpu()
        return _rel_err(host, ref), None if refs.fp32 is None else _rel_err(host, refs.fp32)

    with torch.no_grad():
        bar.set_postfix_str("references")
        refs = references(model, x, device)
        bar.update(1)
        xd = x.to(device)
        # resident baseline: a device copy of the model, compiled with the units' compiler
        torch._dynamo.reset()
        ref = refs.eager

        def resident_run() -> tuple[float, torch.Tensor, int]:
            resident = build_transformer(spec).to(device)
            run: Callable[..., Any] = torch.compile(resident) if compiler == "inductor" else resident

            def step_resident(run: Callable[..., Any] = run, xd: torch.Tensor = xd) -> Any:
                return run(xd)

            dm.reset_peak_memory_stats()
            ms, out = _time(step_resident, args.steps, sync)
            return ms, out.detach().cpu(), int(dm.max_memory_allocated())

        measured, why = _fits(resident_run)
        gc.collect()
        dm.empty_cache()
        if measured is not None:
            ms, ref, peak = measured
            rows.append(Row("resident", ms, peak, 0, 0.0, compiler,
                            err_fp32=None if refs.fp32 is None else _rel_err(ref, refs.fp32)))
        else:
            emit(f"resident run skipped: the model {why}; errors are against the eager reference")
            rows.append(Row("resident", float("nan"), 0, 0, float("nan"), compiler, note="skipped: " + why))
        bar.update(1)

        host = materialize(model)
        try:
            for policy in policies:
                for ratio in ratios:
                    bar.set_postfix_str(f"{policy} ratio {ratio:g}")
                    torch._dynamo.reset()
                    gc.collect()
                    dm.empty_cache()
                    dm.reset_peak_memory_stats()
                    cfg = OffloadConfig(policy=policy, gpu_resident_weight_ratio=ratio, unit_compiler=compiler)
                    f = compile_offloaded(model, cfg)

                    def step_offloaded(f: Callable[..., Any] = f) -> Any:
                        return f(xd)  # the device input, as the resident run gets it

                    for _ in range(3):  # warm-up: look-ahead, profile, static plan
                        step_offloaded()
                    ms, out = _time(step_offloaded, args.steps, sync)
                    assert f.handle is not None
                    stats = f.handle.stats()[-1]
                    streamed = stats.streamed_bytes_per_step or 0
                    predicted = stats.predicted_step_ms
                    err, err32 = errors(out, ref)
                    rows.append(Row(f"{policy} r={ratio:g}", ms, int(dm.max_memory_allocated()), streamed,
                                    err, compiler, predicted, err32))
                    f.handle.release()  # free this run's resident weights before the next
                    del f, out, step_offloaded
                    bar.update(1)
        finally:
            torch._dynamo.reset()
            gc.collect()
            host.release(restore=True)
            bar.close()
    return rows, refs


def check(rows: list[Row], refs: References, dtype: torch.dtype) -> tuple[bool, str]:
    """The demo's gate (see the module docstring): ``(passed, one line saying why)``; sets each offloaded row's
    :attr:`Row.correct`."""
    offloaded = [r for r in rows if r.name != "resident"]
    if dtype == torch.float32 or refs.eager_err_fp32 is None:
        for r in offloaded:
            r.correct = r.rel_err <= FP32_TOL
        worst = max((r.rel_err for r in offloaded), default=0.0)
        ok = worst <= FP32_TOL
        return ok, f"max relative error vs the resident run {worst:.2e} ({'<=' if ok else '>'} {FP32_TOL:.0e})"
    bound = LOW_PRECISION_SLACK * refs.eager_err_fp32
    for r in offloaded:
        r.correct = (r.err_fp32 or 0.0) <= bound
    worst = max((r.err_fp32 or 0.0 for r in offloaded), default=0.0)
    ok = worst <= bound
    return ok, (f"max error vs float32 of an offloaded run {worst:.2e} {'<=' if ok else '>'} {bound:.2e} = "
                f"{LOW_PRECISION_SLACK}x that of eager {str(dtype).removeprefix('torch.')} "
                f"({refs.eager_err_fp32:.2e}): offloading costs no accuracy")


#: The table's columns: header -> (cell of a row, what the column means, said once in the legend).
COLUMNS: dict[str, tuple[Callable[[Row], str], str]] = {
    "run": (lambda r: r.name, "resident: the whole model on the device (the baseline); POLICY r=R: offloaded with "
                              "that policy, a fraction R of the weights kept resident on the device"),
    "compiler": (lambda r: r.compiler, "how the units (and the resident model) were compiled: inductor or eager"),
    "step ms": (lambda r: "-" if r.note else f"{r.step_ms:.2f}",
                "wall time per step, averaged over the timed steps after warm-up"),
    "planned ms": (lambda r: "-" if r.predicted_ms is None else f"{r.predicted_ms:.2f}",
                   "the step time the plan predicted from the warm-up profile (- for resident: it has no plan)"),
    "peak dev MB": (lambda r: "-" if r.note else f"{r.peak_bytes / 1e6:.1f}", "peak device memory of the run"),
    "streamed MB/step": (lambda r: f"{r.streamed_bytes / 1e6:.2f}",
                         "weight bytes copied host-to-device per step (0 when every weight is resident)"),
    "copy GB/s": (lambda r: "-" if r.note else f"{r.copy_gbps:.2f}", "bytes streamed per step / step time"),
    "err vs resident": (lambda r: r.note or f"{r.rel_err:.2e}",
                        "||out - ref|| / ||ref|| against the resident run's output (the eager reference when the "
                        "resident run was skipped)"),
    "err vs fp32": (lambda r: "-" if r.err_fp32 is None else f"{r.err_fp32:.2e}",
                    "the same error against a float32 run of the same weights (low-precision models only)"),
    "correct": (lambda r: "-" if r.correct is None else "yes" if r.correct else "NO",
                "whether the offloaded run passed the gate below (- for the resident baseline)"),
}
#: Columns only an accelerator measures: left out on the CPU backend, where the host has no device memory or
#: copy link and host step times of a tiny model are noise (they swing run to run, the plan's prediction included).
DEVICE_ONLY_COLUMNS = ("step ms", "planned ms", "peak dev MB", "copy GB/s")
#: What the demo says first on the CPU backend.
CPU_INTRO = (
    "On the CPU backend this run checks correctness, not speed:\n"
    "  every policy and residency ratio runs the same planning, streaming and freeing code as on an accelerator,\n"
    "  and each offloaded run must match the resident run. Timings are left out: the host has no device memory\n"
    "  or copy link to measure, and host step times of a small model are noise. Run it on an accelerator for them."
)


def table_columns(rows: list[Row], is_accelerator: bool) -> list[str]:
    """The columns worth printing: timings and device figures only on an accelerator, "err vs fp32" only when some
    run has it."""
    return [
        c for c in COLUMNS
        if (is_accelerator or c not in DEVICE_ONLY_COLUMNS)
        and (c != "err vs fp32" or any(r.err_fp32 is not None for r in rows))
    ]


def legend(columns: list[str]) -> str:
    """One line per printed column saying what it means."""
    width = max(len(c) for c in columns)
    return "\n".join(f"  {c.ljust(width)}  {COLUMNS[c][1]}" for c in columns)


def format_table(rows: list[Row], columns: list[str] | None = None) -> str:
    """The results as an aligned text table (every column of :data:`COLUMNS` unless ``columns`` names some)."""
    head = tuple(columns if columns is not None else COLUMNS)
    body = [tuple(COLUMNS[c][0](r) for c in head) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the demo and print the table; returns the exit status."""
    backend = get_backend()
    spec, _ = _spec(args, backend.is_accelerator)
    rows, refs = run_demo_with_references(args)
    ok, why = check(rows, refs, spec.dtype)
    columns = table_columns(rows, backend.is_accelerator)
    print(format_table(rows, columns))
    print("columns:")
    print(legend(columns))
    if refs.eager_err_fp32 is not None:
        print(f"reference: float32 eager on the same {str(spec.dtype).removeprefix('torch.')} weights; eager "
              f"{str(spec.dtype).removeprefix('torch.')} is {refs.eager_err_fp32:.2e} from it")
    print(("PASSED: " if ok else "FAILED: ") + why)
    return 0 if ok else 1
