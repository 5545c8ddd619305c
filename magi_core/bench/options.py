"""Benchmark options and the size presets chosen from the backend (full, quick, cpu)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from magi_core.bench.real.common import REAL_WORKLOADS
from magi_core.errors import ConfigError
from magi_core.plugin.device_limit import parse_device_memory

SYSTEMS = ("resident_eager", "resident_compiled", "magi", "diffusers", "accelerate")
#: The bench's own synthetic models, then the models built from transformers / diffusers classes (``--models``).
MODELS = ("mlp", "transformer", *REAL_WORKLOADS)
#: ``core``: the first policy at every ratio and budget, the other policies at the budgets only; ``full``: every
#: policy at every ratio and budget.
GRIDS = ("core", "full")
#: Default ``--time-budget`` on accelerators (seconds): the core grid of both default models finishes in under 10
#: minutes.
ACCELERATOR_TIME_BUDGET_S = 420.0
#: The fewest timed steps a configuration may have (their median is the step time).
MIN_STEPS = 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Sizes:
    """Model sizes and token counts of one run."""

    mlp_hidden: int
    mlp_layers: int
    tf_hidden: int
    tf_layers: int
    tf_heads: int
    tf_ffn_mult: float
    tokens: tuple[int, ...]


#: Accelerator default: the 24-block bf16 MLP stack (hidden 4096, 4x FFN: 6.44 GB) and the synthetic transformer
#: (32 x 486 MB blocks, FFN 14336, hidden 4096: 15.6 GB).
FULL = Sizes(4096, 24, 4096, 32, 32, 3.5, (2048, 16384))
#: Accelerator quick check: same widths, fewer blocks, one token count.
QUICK = Sizes(4096, 8, 4096, 4, 32, 3.5, (2048,))
#: Host-only run: tiny models, figures not meaningful.
#: (enough blocks that half the weight bytes can hold the two-unit streaming working set)
CPU = Sizes(64, 8, 64, 6, 2, 3.5, (16, 64))
CPU_QUICK = Sizes(64, 6, 64, 5, 2, 3.5, (16,))


@dataclass(frozen=True)
class BenchOptions:
    """Everything a ``magi bench`` run needs; ``None`` sizes are taken from the backend's preset."""

    models: tuple[str, ...] = ("mlp", "transformer")
    systems: tuple[str, ...] = SYSTEMS
    policies: tuple[str, ...] = ("HEURISTIC", "COST_EFFECTIVE", "BASE")
    ratios: tuple[float, ...] = (0.0, 0.25, 0.5)
    budgets: tuple[float, ...] = (0.5,)
    steps: int = 10
    warmup: int = 2
    dtype: str = "bf16"
    quick: bool = False
    tokens: tuple[int, ...] | None = None
    mlp_hidden: int | None = None
    mlp_layers: int | None = None
    tf_hidden: int | None = None
    tf_layers: int | None = None
    tf_heads: int | None = None
    probe_bytes: int | None = None
    compile_on_cpu: bool = False
    overhead_probe: bool = True
    time_budget_s: float | None = None
    grid: str = "core"
    accelerate_all_tokens: bool = False
    llama_layers: int | None = None
    wan_layers: int | None = None
    flux_layers: int | None = None
    """Flux double-stream blocks (and twice as many single-stream ones); None: the preset's."""
    device_memory: str | None = None
    """Cap this process's device memory before anything is allocated (``12GiB``, ``80%``); None: ``MAGI_DEVICE_MEMORY``,
    else no cap."""
    magi_default: bool = False
    """Also run magi-core with its default ``OffloadConfig()`` (the plan fits the card), first among magi runs."""
    host_timing: bool = True
    """Time single calls on an idle device (host overhead) at the smallest token count; off for quick grids."""
    accelerate_device_map: bool = False
    """accelerate with ``device_map="auto"`` and ``max_memory`` at the device's capacity (the cap when one is set)
    instead of ``cpu_offload``; always so under a device memory cap."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of the resident compiled system (Inductor; the CPU tests use ``aot_eager``)."""
    out: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.models:
            if m not in MODELS:
                raise ConfigError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        for name in ("llama_layers", "wan_layers", "flux_layers"):
            n = getattr(self, name)
            if n is not None and n < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {n}")
        for s in self.systems:
            if s not in SYSTEMS:
                raise ConfigError(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
        for r in self.ratios + self.budgets:
            if not 0.0 <= r <= 1.0:
                raise ConfigError(f"residency ratios and budget fractions must be in [0, 1], got {r}")
        if self.steps < MIN_STEPS:
            raise ConfigError(f"--steps must be >= {MIN_STEPS} (the step time is their median), got {self.steps}")
        if self.device_memory is not None:
            parse_device_memory(self.device_memory)
        if self.warmup < 1:
            raise ConfigError(f"--warmup must be >= 1, got {self.warmup}")
        if self.grid not in GRIDS:
            raise ConfigError(f"unknown grid {self.grid!r}; choose from {', '.join(GRIDS)}")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise ConfigError(f"--time-budget must be >= 0 seconds (0: no limit), got {self.time_budget_s}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the models."""
        return DTYPES[self.dtype]

    def sizes(self, is_accelerator: bool) -> Sizes:
        """The preset for this backend with every explicitly given size applied on top."""
        base = (QUICK if self.quick else FULL) if is_accelerator else (CPU_QUICK if self.quick else CPU)
        overrides = {k: getattr(self, k) for k in ("mlp_hidden", "mlp_layers", "tf_hidden", "tf_layers", "tf_heads")
                     if getattr(self, k) is not None}
        if self.tokens is not None:
            overrides["tokens"] = tuple(self.tokens)
        return replace(base, **overrides)

    def real_preset(self, is_accelerator: bool) -> str:
        """Size of the real-library models: full (accelerators), quick (4 layers, one token count), tiny (cpu)."""
        if not is_accelerator:
            return "tiny"
        return "quick" if self.quick else "full"

    def time_budget(self, is_accelerator: bool) -> float | None:
        """Seconds after which configurations not yet started are skipped: the option, else 420 s on accelerators.

        ``0`` means no limit; the cpu backend has none by default.
        """
        if self.time_budget_s is not None:
            return self.time_budget_s or None
        return ACCELERATOR_TIME_BUDGET_S if is_accelerator else None

    def h2d_probe_bytes(self, is_accelerator: bool) -> int:
        """Bytes of the pinned H2D bandwidth probe: 1 GiB on accelerators, 16 MiB on the host."""
        if self.probe_bytes is not None:
            return self.probe_bytes
        return (1 << 30) if is_accelerator else (16 << 20)

    def as_json(self) -> dict[str, Any]:
        """The options as JSON-ready values."""
        d = asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        return d
