"""What a ``magi bench --generate`` run measures: the model, the prompt, the systems, and the checks on the flags."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from magi_core.bench.options import DTYPES
from magi_core.bench.systems import SystemSpec
from magi_core.errors import ConfigError

#: Systems a generate run can measure (diffusers' group offloading is not a peer for language-model decoding).
GENERATE_SYSTEMS = ("resident_eager", "resident_compiled", "magi", "accelerate")
#: Models that ``generate``: the causal language models among the bench's workloads.
GENERATE_MODELS = ("llama8b",)
CACHES = ("dynamic", "static")
#: Defaults of ``--generate`` where the bench's own differ: the compiled resident model, the accelerate peer, and
#: magi-core's default policy at ratio 0 (all streamed), half the weights as budget and ratio 0.9.
DEFAULT_SYSTEMS = ("resident_compiled", "magi", "accelerate")
DEFAULT_POLICIES = ("HEURISTIC",)
DEFAULT_RATIOS = (0.0, 0.9)
DEFAULT_BUDGETS = (0.5,)
#: Prompt length on accelerators (the bench's transfer-bound llama8b forward) and on the cpu backend (tiny model).
ACCELERATOR_PROMPT_TOKENS = 2048
CPU_PROMPT_TOKENS = 16
#: New tokens of each warm-up ``generate`` with a ``DynamicCache`` (a static cache warms up at the timed length: its
#: length is part of the graph): the prefill, the first decode step and enough dynamic decode steps for magi-core's
#: decode graph to plan.
WARMUP_NEW_TOKENS = 6
#: Flags of ``magi bench`` that mean nothing to a generate run: naming one with ``--generate`` is an error.
BENCH_ONLY = {"tokens": "--tokens (give --prompt-tokens)", "report": "--report",
              "accelerate_device_map": "--accelerate-device-map (accelerate always runs a device map here: "
                                       "--accelerate-budget)",
              "accelerate_all_tokens": "--accelerate-all-tokens", "device_memory": "--device-memory",
              "magi_default": "--magi-default (name the ratios and budgets)"}
#: Flags only a generate run reads: naming one without ``--generate`` is an error.
GENERATE_ONLY = {"prompt_tokens": "--prompt-tokens", "new_tokens": "--new-tokens", "batch": "--batch",
                 "cache": "--cache", "accelerate_budget": "--accelerate-budget",
                 "accelerate_max_time": "--accelerate-max-time", "in_process": "--in-process",
                 "cudnn_attention": "--cudnn-attention"}


@dataclass(frozen=True)
class GenerateOptions:
    """Everything a generate run needs; ``prompt_tokens=None`` is the backend's default (2048, or 16 on the host)."""

    models: tuple[str, ...] = GENERATE_MODELS
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    prompt_tokens: int | None = None
    new_tokens: int = 32
    batch: int = 1
    cache: str = "dynamic"
    warmup: int = 2
    """Warm-up ``generate`` calls before the timed one (magi-core: at least its warm-up calls + 2, so that every
    graph has planned, and planned again next to the others, before timing)."""
    dtype: str = "bf16"
    quick: bool = False
    llama_layers: int | None = None
    probe_bytes: int | None = None
    compile_backend: str = "inductor"
    compile_on_cpu: bool = False
    accelerate_budget: float = 0.5
    """accelerate's ``max_memory`` on the device, as a fraction of the weight bytes: the rest is offloaded to the
    host (as magi-core's half-weights budget)."""
    accelerate_max_time: float = 60.0
    """Seconds accelerate's timed ``generate`` may take (``max_time``): its decode streams from pageable memory."""
    time_budget_s: float | None = None
    """Seconds after which systems not yet started are recorded as skipped (None or 0: no limit)."""
    cudnn_attention: bool = False
    """Let ``scaled_dot_product_attention`` use cuDNN where torch would. Off by default, for every system alike:
    cuDNN attention builds an execution plan per new key length, so a growing cache pays one per token (tens of
    milliseconds of host time on the H200)."""
    in_process: bool = False
    """Run every system in this process (tests, debugging) instead of one process per system."""
    out: Path | None = None

    def __post_init__(self) -> None:
        for m in self.models:
            if m not in GENERATE_MODELS:
                raise ConfigError(f"--generate runs causal language models: {', '.join(GENERATE_MODELS)}; "
                                  f"{m!r} does not generate")
        for s in self.systems:
            if s not in GENERATE_SYSTEMS:
                raise ConfigError(f"system {s!r} cannot run --generate; choose from {', '.join(GENERATE_SYSTEMS)}")
        if not self.systems:
            raise ConfigError("--generate needs at least one system")
        for r in self.ratios + self.budgets + (self.accelerate_budget,):
            if not 0.0 <= r <= 1.0:
                raise ConfigError(f"residency ratios and budget fractions must be in [0, 1], got {r}")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ConfigError(f"--prompt-tokens must be >= 1, got {self.prompt_tokens}")
        if self.new_tokens < 2:
            raise ConfigError(f"--new-tokens must be >= 2 (the first comes from the prefill, the rest from decode "
                              f"steps), got {self.new_tokens}")
        if self.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {self.batch}")
        if self.cache not in CACHES:
            raise ConfigError(f"unknown cache {self.cache!r}; choose from {', '.join(CACHES)}")
        if self.warmup < 1:
            raise ConfigError(f"--warmup must be >= 1 (the first generate compiles), got {self.warmup}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.llama_layers is not None and self.llama_layers < 1:
            raise ConfigError(f"--llama-layers must be >= 1, got {self.llama_layers}")
        if self.accelerate_max_time <= 0:
            raise ConfigError(f"--accelerate-max-time must be > 0 seconds, got {self.accelerate_max_time}")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise ConfigError(f"--time-budget must be >= 0 seconds (0: no limit), got {self.time_budget_s}")
        if "magi" in self.systems and not self.policies:
            raise ConfigError("--generate with magi needs a policy (--policies)")
        if "magi" in self.systems and not self.ratios and not self.budgets:
            raise ConfigError("--generate with magi needs a ratio or a budget (--ratios, --budgets)")

    def prompt_length(self, is_accelerator: bool) -> int:
        """Tokens of each prompt: the option, else 2048 on accelerators and 16 on the host."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return ACCELERATOR_PROMPT_TOKENS if is_accelerator else CPU_PROMPT_TOKENS

    def warmup_new_tokens(self) -> int:
        """New tokens of each warm-up ``generate``: the timed count with a static cache (its length is compiled in),
        else a few."""
        return self.new_tokens if self.cache == "static" else min(self.new_tokens, WARMUP_NEW_TOKENS)

    def as_json(self) -> dict[str, Any]:
        """The options as JSON-ready values."""
        d = asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        return d


def generate_specs(options: GenerateOptions) -> list[SystemSpec]:
    """The systems to run, in order: the residents (the tokens' reference), magi-core for each policy at its ratios
    and budgets from the least resident to the most (ratio 0, half the weights, ratio 0.9), accelerate last (the
    slowest: a time budget skips from the end)."""
    specs = [SystemSpec(kind) for kind in ("resident_compiled", "resident_eager") if kind in options.systems]
    if "magi" in options.systems:
        for policy in options.policies:
            magi = [SystemSpec("magi", policy=policy.upper(), ratio=r) for r in options.ratios]
            magi += [SystemSpec("magi", policy=policy.upper(), budget_fraction=b) for b in options.budgets]
            specs += sorted(magi, key=lambda s: s.ratio if s.ratio is not None else s.budget_fraction or 0.0)
    if "accelerate" in options.systems:
        specs.append(SystemSpec("accelerate"))
    return specs


def spec_arguments(spec: SystemSpec) -> list[str]:
    """The ``magi bench --generate`` flags that select ``spec`` alone."""
    if spec.kind != "magi":
        return ["--systems", spec.kind]
    ratios = "" if spec.ratio is None else f"{spec.ratio:g}"
    budgets = "" if spec.budget_fraction is None else f"{spec.budget_fraction:g}"
    return ["--systems", "magi", "--policies", str(spec.policy), "--ratios", ratios, "--budgets", budgets]


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations that mean nothing: generate-only flags without ``--generate``, bench-only ones with
    it. Raises :class:`~magi_core.errors.ConfigError` naming the flag."""
    if not getattr(args, "generate", False):
        given = [flag for key, flag in GENERATE_ONLY.items() if getattr(args, key, None) not in (None, False)]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply to a generate run: add --generate")
        return
    for key, flag in BENCH_ONLY.items():
        if getattr(args, key, None) not in (None, False):
            raise ConfigError(f"{flag} does not apply to --generate")


def options_from_args(args: argparse.Namespace) -> GenerateOptions:
    """:class:`GenerateOptions` from parsed ``magi bench --generate`` arguments (the bench's defaults that differ
    for generate: systems, policies and ratios, taken from here when not given)."""
    check_flags(args)

    def given(value: Any, default: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(value) if value is not None else default

    return GenerateOptions(
        models=tuple(args.models) if args.models != ("mlp", "transformer") else GENERATE_MODELS,
        systems=given(args.systems, DEFAULT_SYSTEMS), policies=tuple(p.upper() for p in given(args.policies,
                                                                                             DEFAULT_POLICIES)),
        ratios=given(args.ratios, DEFAULT_RATIOS), budgets=given(args.budgets, DEFAULT_BUDGETS),
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens if args.new_tokens is not None else 32,
        batch=args.batch if args.batch is not None else 1, cache=args.cache or "dynamic", warmup=args.warmup,
        dtype=args.dtype, quick=args.quick, llama_layers=args.llama_layers,
        probe_bytes=args.probe_mb << 20 if args.probe_mb else None, compile_backend=args.compile_backend,
        compile_on_cpu=args.compile_on_cpu,
        accelerate_budget=args.accelerate_budget if args.accelerate_budget is not None else 0.5,
        accelerate_max_time=args.accelerate_max_time if args.accelerate_max_time is not None else 60.0,
        time_budget_s=args.time_budget, in_process=bool(args.in_process), out=args.out,
        cudnn_attention=bool(getattr(args, "cudnn_attention", False)),
    )


def _common_arguments(options: GenerateOptions) -> list[str]:
    argv = ["--new-tokens", str(options.new_tokens), "--batch", str(options.batch), "--cache", options.cache,
            "--warmup", str(options.warmup), "--dtype", options.dtype, "--compile-backend", options.compile_backend,
            "--accelerate-budget", f"{options.accelerate_budget:g}",
            "--accelerate-max-time", f"{options.accelerate_max_time:g}"]
    if options.prompt_tokens is not None:
        argv += ["--prompt-tokens", str(options.prompt_tokens)]
    if options.quick:
        argv.append("--quick")
    if options.llama_layers is not None:
        argv += ["--llama-layers", str(options.llama_layers)]
    if options.probe_bytes is not None:
        argv += ["--probe-mb", str(max(1, options.probe_bytes >> 20))]
    if options.compile_on_cpu:
        argv.append("--compile-on-cpu")
    if options.cudnn_attention:
        argv.append("--cudnn-attention")
    return argv


def _csv(values: tuple[Any, ...]) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def run_arguments(options: GenerateOptions) -> list[str]:
    """The ``magi bench`` arguments that run ``options`` again (what a result records as its command)."""
    argv = ["bench", "--generate", "--models", ",".join(options.models), "--systems", ",".join(options.systems),
            "--policies", _csv(options.policies), "--ratios", _csv(options.ratios), "--budgets",
            _csv(options.budgets), *_common_arguments(options)]
    if options.in_process:
        argv.append("--in-process")
    if options.time_budget_s is not None:
        argv += ["--time-budget", f"{options.time_budget_s:g}"]
    if options.out is not None:
        argv += ["--out", str(options.out)]
    return argv


def child_arguments(options: GenerateOptions, spec: SystemSpec, out: Path) -> list[str]:
    """The ``magi bench`` arguments of the process that runs ``spec`` alone and writes its result to ``out``."""
    return ["bench", "--generate", "--in-process", "--models", ",".join(options.models), *spec_arguments(spec),
            *_common_arguments(options), "--time-budget", "0", "--out", str(out)]
