"""``magi bench``: magi-core against resident execution and peer offloaders, with JSON results and targets.

The CLI dispatches ``magi bench`` to :func:`add_arguments` and :func:`main`. Library use::

    from magi_core.bench import BenchOptions, run_benchmark
    doc = run_benchmark(BenchOptions(quick=True))
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from magi_core.bench.options import ACCELERATOR_TIME_BUDGET_S, GRIDS, MIN_STEPS, MODELS, SYSTEMS, BenchOptions
from magi_core.bench.runner import default_out_path, environment, run_benchmark
from magi_core.errors import MagiError

logger = logging.getLogger(__name__)

__all__ = ["BenchOptions", "add_arguments", "main", "options_from_args", "run_benchmark"]


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(v) for v in text.split(",") if v.strip())

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``magi bench`` options to ``parser``."""
    parser.add_argument("--models", type=_csv(str), default=("mlp", "transformer"),
                        help=f"comma list of models: {','.join(MODELS)} (default mlp,transformer); llama8b "
                             "(transformers LlamaForCausalLM, Llama-3-8B), wan14b (diffusers WanTransformer3DModel, "
                             "Wan2.1-14B blocks) and flux (diffusers FluxTransformer2DModel, FLUX.1-dev) run at their "
                             "own regime token counts unless --tokens is given, and tiny on the cpu backend")
    parser.add_argument("--systems", type=_csv(str), default=None,
                        help=f"comma list of systems (default all: {','.join(SYSTEMS)}; --generate: "
                             "resident_compiled,magi,accelerate)")
    parser.add_argument("--policies", type=_csv(str), default=None,
                        help="magi-core policies, run in this order (default all three; --generate: HEURISTIC)")
    parser.add_argument("--grid", choices=GRIDS, default="core",
                        help="core (default): the first policy at every ratio and budget, the others at the budgets; "
                             "full: every policy at every ratio and budget")
    parser.add_argument("--ratios", type=_csv(float), default=None,
                        help="gpu_resident_weight_ratio values (default 0,0.25,0.5; --generate: 0,0.9)")
    parser.add_argument("--budgets", type=_csv(float), default=None,
                        help="device-memory budgets as fractions of the weight bytes (default 0.5)")
    parser.add_argument("--tokens", type=_csv(int), default=None,
                        help="token counts of every model (default 2048,16384 on accelerators, 16,64 on the cpu "
                             "backend; llama8b 2048,8192,16384 and wan14b 2184,8190,16380: transfer-bound, balanced, "
                             "compute-bound on an H200)")
    parser.add_argument("--steps", type=int, default=10,
                        help=f"timed steps per configuration (default 10, at least {MIN_STEPS}; median)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls before timing (magi: at least its own)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--quick", action="store_true", help="fewer blocks and one token count")
    parser.add_argument("--mlp-hidden", type=int, default=None)
    parser.add_argument("--mlp-layers", type=int, default=None)
    parser.add_argument("--tf-hidden", type=int, default=None)
    parser.add_argument("--tf-layers", type=int, default=None, help="transformer blocks (default 32: 15.6 GB)")
    parser.add_argument("--tf-heads", type=int, default=None)
    parser.add_argument("--llama-layers", type=int, default=None,
                        help="llama8b decoder layers (default 32, the real model; 4 with --quick)")
    parser.add_argument("--wan-layers", type=int, default=None,
                        help="wan14b transformer blocks (default 20, 14.5 GB; the real model has 40; 4 with --quick)")
    parser.add_argument("--flux-layers", type=int, default=None,
                        help="flux double-stream blocks, with twice as many single-stream ones (default 19 + 38, "
                             "FLUX.1-dev; 2 + 4 with --quick)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="cap this process's device memory before anything is allocated, to run as on a smaller "
                             "card: bytes (12GiB, 16e9) or a percentage of the device (80%%); default: "
                             "MAGI_DEVICE_MEMORY, else no cap. A run that does not fit is a failed row, not a crash; "
                             "the cpu backend cannot cap")
    parser.add_argument("--magi-default", action="store_true",
                        help="also run magi-core with its default OffloadConfig() (the plan fits the card)")
    parser.add_argument("--accelerate-device-map", action="store_true",
                        help="accelerate with device_map='auto' and max_memory at the device's capacity instead of "
                             "cpu_offload (always so under --device-memory)")
    parser.add_argument("--no-host-timing", action="store_true",
                        help="skip timing 20 single calls on an idle device (host overhead) per configuration")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of resident_compiled (default inductor)")
    parser.add_argument("--probe-mb", type=int, default=None, help="H2D probe size in MiB (default 1024; cpu 16)")
    parser.add_argument("--compile-on-cpu", action="store_true", help="run Inductor for resident compiled on cpu")
    parser.add_argument("--no-overhead-probe", action="store_true",
                        help="skip the all-resident (ratio 1) magi run used to measure executor host overhead")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which configurations not yet started are recorded as skipped, split "
                             f"across the models (default {ACCELERATOR_TIME_BUDGET_S:g} on accelerators, none on the "
                             "cpu backend; 0: no limit)")
    parser.add_argument("--accelerate-all-tokens", action="store_true",
                        help="run accelerate cpu_offload at every token count (default: the smallest only)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default benchmarks/results/<date>-<hardware>.json)")
    parser.add_argument("--report", type=Path, default=None, metavar="MARKDOWN",
                        help="also write the Markdown report (and a PNG plot next to it) from this run")
    generate = parser.add_argument_group(
        "generate", "--generate: greedy model.generate of llama8b per system, each system in a process of its own: "
                    "prefill ms, decode ms per token against the streaming ideal, tokens/s, peaks, compiles, tokens "
                    "against the resident model's (magi_core.bench.generate)")
    generate.add_argument("--generate", action="store_true", help="run the generate benchmark")
    generate.add_argument("--prompt-tokens", type=int, default=None,
                          help="prompt length (default 2048 on accelerators, 16 on the cpu backend)")
    generate.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default 32)")
    generate.add_argument("--batch", type=int, default=None, help="sequences generated together (default 1)")
    generate.add_argument("--cache", choices=("dynamic", "static"), default=None,
                          help="KV cache: dynamic (DynamicCache, the default) or static (StaticCache)")
    generate.add_argument("--accelerate-budget", type=float, default=None, metavar="FRACTION",
                          help="accelerate's max_memory on the device as a fraction of the weight bytes, the rest "
                               "offloaded to the host (default 0.5)")
    generate.add_argument("--accelerate-max-time", type=float, default=None, metavar="S",
                          help="seconds accelerate's timed generate may take (max_time; default 60)")
    generate.add_argument("--cudnn-attention", action="store_true",
                          help="let attention use cuDNN where torch picks it (default: every other kernel of "
                               "scaled_dot_product_attention; cuDNN builds a plan per new KV length, i.e. per token)")
    generate.add_argument("--in-process", action="store_true",
                          help="run every system in this process instead of one process per system")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Build :class:`BenchOptions` from parsed ``magi bench`` arguments."""
    return BenchOptions(
        models=tuple(args.models), systems=_given(args.systems, BenchOptions.systems),
        policies=tuple(p.upper() for p in _given(args.policies, BenchOptions.policies)),
        ratios=_given(args.ratios, BenchOptions.ratios), budgets=_given(args.budgets, BenchOptions.budgets),
        steps=args.steps, warmup=args.warmup,
        dtype=args.dtype, quick=args.quick, tokens=tuple(args.tokens) if args.tokens else None,
        mlp_hidden=args.mlp_hidden, mlp_layers=args.mlp_layers, tf_hidden=args.tf_hidden, tf_layers=args.tf_layers,
        tf_heads=args.tf_heads, probe_bytes=args.probe_mb << 20 if args.probe_mb else None,
        compile_on_cpu=args.compile_on_cpu, overhead_probe=not args.no_overhead_probe,
        time_budget_s=args.time_budget, grid=args.grid, accelerate_all_tokens=args.accelerate_all_tokens,
        llama_layers=args.llama_layers, wan_layers=args.wan_layers, flux_layers=args.flux_layers,
        device_memory=args.device_memory, magi_default=args.magi_default, host_timing=not args.no_host_timing,
        accelerate_device_map=args.accelerate_device_map, compile_backend=args.compile_backend, out=args.out,
    )


def _given(value: Any, default: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(value) if value is not None else default


def _repo_root() -> Path:
    here = Path(__file__).resolve().parents[2]
    return here if (here / "benchmarks").is_dir() else Path.cwd()


def main(args: argparse.Namespace) -> int:
    """Run ``magi bench``; print a summary and where the JSON went. Returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from magi_core.bench import report
    from magi_core.plugin.device_limit import device_memory_from_env
    from magi_core.plugin.manager import get_backend

    try:
        if getattr(args, "generate", False):
            from magi_core.bench import generate

            return generate.main(args, _repo_root())
        from magi_core.bench.generate.options import check_flags

        check_flags(args)
        options = options_from_args(args)
        backend = get_backend()
        if options.out is None:
            from dataclasses import replace

            models = options.models if set(options.models) != {"mlp", "transformer"} else ()
            options = replace(options, out=default_out_path(environment(backend), models, _repo_root(),
                                                            options.device_memory or device_memory_from_env()))
        doc = run_benchmark(options, backend)
    except MagiError as exc:
        print(f"magi bench: {exc}", file=sys.stderr)
        return 2
    print(report.text_summary(doc))
    print(f"results: {options.out}")
    if args.report is not None:
        report.write_report([doc], args.report)
        print(f"report: {args.report}")
    return 0
