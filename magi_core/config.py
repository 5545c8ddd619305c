"""``OffloadConfig``: the offload runtime's settings, from code, ``torch.compile`` options or the environment.

Precedence (:func:`resolve_config`): defaults < ``config=`` < ``options={...}`` < ``MAGI_OFFLOAD_<FIELD>``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar

from magi_core._env import GIB, MIB, parse_bool, parse_bytes, parse_float, parse_int
from magi_core.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_PREFIX = "MAGI_OFFLOAD_"
#: Bandwidth probe size when ``bandwidth_probe_bytes`` is None: 1 GiB on accelerators, 16 MiB on the host.
DEFAULT_PROBE_BYTES_ACCELERATOR = GIB
DEFAULT_PROBE_BYTES_CPU = 16 * MIB
#: Values of ``OffloadConfig.unit_compiler``.
UNIT_COMPILERS = ("auto", "inductor", "eager")


class Policy(str, Enum):
    """Built-in scheduling policies (plugins add more by name, see :func:`register_policy`)."""

    BASE = "BASE"
    COST_EFFECTIVE = "COST_EFFECTIVE"
    HEURISTIC = "HEURISTIC"

    def __str__(self) -> str:
        return self.value


def normalize_policy(value: Policy | str) -> Policy | str:
    """The one normalisation of policy names: the built-in :class:`Policy` for ``value`` (any case, ``-`` read
    as ``_``), else the upper-cased name as a str (a plugin policy).

    Whether a plugin policy of that name exists is checked when planning, and early by
    :func:`magi_core.plan.check_policy`; this function never looks at the registry. A value that is not a
    non-empty string raises :class:`ConfigError`.
    """
    if isinstance(value, Policy):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"OffloadConfig.policy: expected a policy name, got {value!r}")
    name = value.strip().upper().replace("-", "_")
    return Policy[name] if name in Policy.__members__ else name


@dataclass(frozen=True)
class OffloadConfig:
    """Settings of the offload runtime; every field is validated on construction (:class:`ConfigError`).

    ``policy``: BASE (look-ahead prefetch), COST_EFFECTIVE (keep the least-compute-per-byte units resident)
    or HEURISTIC (latest copy triggers from profiled times; residency where it removes the most stall),
    or the name of a plugin policy; any case. ``gpu_resident_weight_ratio`` in [0, 1]: at most this share of
    all weight bytes stays resident on the device. ``device_memory_budget_bytes``: the alternative to the
    ratio (set one of the two): the scheduler keeps as many weights resident as fit while resident weights
    plus the predicted streamed working set stay within this many bytes (activations not included).
    ``bandwidth_safety_factor`` in (0, 1]: schedulers plan with measured bandwidth times this.
    ``prefetch_margin_ms`` >= 0: slack HEURISTIC keeps between a copy's end and its unit's start.
    ``lookahead`` >= 1: BASE / COST_EFFECTIVE prefetch this many streamed units ahead.
    ``unit_compiler``: "auto" (Inductor on accelerators, eager on the CPU backend), "inductor" or "eager".
    ``warmup_calls`` >= 0: calls before the static plan is built (the first runs a simple look-ahead, the
    second profiles). ``max_unit_bytes``: split units whose weights exceed this many bytes (None: no limit).
    ``bandwidth_probe_bytes``: size of the H2D bandwidth probe (None: 1 GiB on accelerators, 16 MiB on CPU).
    ``direct_unit_calls``: call each Inductor unit's generated code without the Dynamo / AOT wrapper layers
    (verified per unit on its first call, see :func:`magi_core.execute.unit_compile.direct_call`); False
    keeps the wrapped calls (``MAGI_OFFLOAD_DIRECT_UNIT_CALLS=0``).
    """

    policy: Policy | str = Policy.HEURISTIC
    gpu_resident_weight_ratio: float = 0.0
    device_memory_budget_bytes: int | None = None
    bandwidth_safety_factor: float = 0.9
    prefetch_margin_ms: float = 0.1
    lookahead: int = 1
    unit_compiler: str = "auto"
    warmup_calls: int = 2
    max_unit_bytes: int | None = None
    bandwidth_probe_bytes: int | None = None
    direct_unit_calls: bool = True
    #: True on configs returned by :func:`resolve_config` (environment applied); set per instance, never
    #: compared, and not carried over by :meth:`replace`.
    _resolved: ClassVar[bool] = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "policy", normalize_policy(self.policy))
        set_(self, "gpu_resident_weight_ratio", _float("gpu_resident_weight_ratio", self.gpu_resident_weight_ratio))
        if not 0.0 <= self.gpu_resident_weight_ratio <= 1.0:
            raise _range("gpu_resident_weight_ratio", self.gpu_resident_weight_ratio, "[0, 1]")
        budget = _opt_int("device_memory_budget_bytes", self.device_memory_budget_bytes)
        set_(self, "device_memory_budget_bytes", budget)
        if self.device_memory_budget_bytes is not None:
            if self.device_memory_budget_bytes <= 0:
                raise _range("device_memory_budget_bytes", self.device_memory_budget_bytes, "> 0 bytes, or None")
            if self.gpu_resident_weight_ratio > 0.0:
                raise ConfigError(
                    f"OffloadConfig: both gpu_resident_weight_ratio={self.gpu_resident_weight_ratio} and "
                    f"device_memory_budget_bytes={self.device_memory_budget_bytes} are set; set only one of them "
                    "(the budget chooses the resident share itself)"
                )
        set_(self, "bandwidth_safety_factor", _float("bandwidth_safety_factor", self.bandwidth_safety_factor))
        if not 0.0 < self.bandwidth_safety_factor <= 1.0:
            raise _range("bandwidth_safety_factor", self.bandwidth_safety_factor, "(0, 1]")
        set_(self, "prefetch_margin_ms", _float("prefetch_margin_ms", self.prefetch_margin_ms))
        if not self.prefetch_margin_ms >= 0.0:
            raise _range("prefetch_margin_ms", self.prefetch_margin_ms, ">= 0 ms")
        set_(self, "lookahead", _int("lookahead", self.lookahead))
        if self.lookahead < 1:
            raise _range("lookahead", self.lookahead, ">= 1")
        if not isinstance(self.unit_compiler, str) or self.unit_compiler.strip().lower() not in UNIT_COMPILERS:
            raise _range("unit_compiler", self.unit_compiler, " / ".join(repr(c) for c in UNIT_COMPILERS))
        set_(self, "unit_compiler", self.unit_compiler.strip().lower())
        set_(self, "warmup_calls", _int("warmup_calls", self.warmup_calls))
        if self.warmup_calls < 0:
            raise _range("warmup_calls", self.warmup_calls, ">= 0")
        for name in ("max_unit_bytes", "bandwidth_probe_bytes"):
            value = _opt_int(name, getattr(self, name))
            if value is not None and value <= 0:
                raise _range(name, value, "> 0 bytes, or None")
            set_(self, name, value)
        if not isinstance(self.direct_unit_calls, bool):
            raise _range("direct_unit_calls", self.direct_unit_calls, "True or False")

    # -- derived values -----------------------------------------------------------------------------
    def resolved_unit_compiler(self, is_accelerator: bool) -> str:
        """"inductor" or "eager": ``unit_compiler`` with "auto" resolved for the active backend."""
        if self.unit_compiler == "auto":
            return "inductor" if is_accelerator else "eager"
        return self.unit_compiler

    def probe_bytes(self, is_accelerator: bool) -> int:
        """Size of the bandwidth probe: ``bandwidth_probe_bytes`` or the default for the backend kind."""
        if self.bandwidth_probe_bytes is not None:
            return self.bandwidth_probe_bytes
        return DEFAULT_PROBE_BYTES_ACCELERATOR if is_accelerator else DEFAULT_PROBE_BYTES_CPU

    def to_dict(self) -> dict[str, Any]:
        """Plain field values (the policy as its name), suitable for logging or ``from_options``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["policy"] = str(out["policy"])
        return out

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    # -- constructors --------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every setting (the valid ``options`` keys)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, base: OffloadConfig | None = None) -> OffloadConfig:
        """Apply ``torch.compile(..., options={...})`` entries (typed values or strings) on ``base``.

        An unknown key raises :class:`ConfigError` listing the valid keys.
        """
        base = base if base is not None else cls()
        if not options:
            return base
        valid = cls.field_names()
        unknown = sorted(k for k in options if k not in valid)
        if unknown:
            raise ConfigError(
                f"unknown magi offload option(s) {', '.join(map(repr, unknown))}; valid options: {', '.join(valid)}"
            )
        changes = {k: _parse(k, v) if isinstance(v, str) else v for k, v in options.items()}
        return base.replace(**changes)

    @classmethod
    def from_env(cls, base: OffloadConfig | None = None, environ: Mapping[str, str] | None = None) -> OffloadConfig:
        """Apply ``MAGI_OFFLOAD_<FIELD>`` environment variables (e.g. ``MAGI_OFFLOAD_POLICY=base``) on ``base``.

        Optional fields accept ``none``; byte sizes accept suffixes (``512MiB``, ``2GB``). Unknown
        ``MAGI_OFFLOAD_*`` variables are ignored (logged at debug level; other parts of magi-core may define some).
        """
        base = base if base is not None else cls()
        env = os.environ if environ is None else environ
        valid = cls.field_names()
        changes: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in valid:
                changes[name] = _parse(name, raw, source=key)
            else:
                logger.debug("ignoring %s: not an OffloadConfig field (%s)", key, ", ".join(valid))
        return base.replace(**changes) if changes else base


def resolve_config(
    config: OffloadConfig | None = None,
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> OffloadConfig:
    """The effective config: ``config`` (or defaults), then ``options``, then ``MAGI_OFFLOAD_*`` overrides.

    The result is marked resolved: resolving it again without ``options`` (or ``environ``) returns it
    unchanged, so the environment is applied once however many layers (``offload``, ``compile_offloaded``,
    the Dynamo backend) pass the config on.
    """
    if config is not None and config._resolved and not options and environ is None:
        return config
    resolved = OffloadConfig.from_env(OffloadConfig.from_options(options, base=config), environ=environ)
    if config is not None and resolved is config:  # nothing changed it: mark a copy, never the caller's object
        resolved = dataclasses.replace(config)
    object.__setattr__(resolved, "_resolved", True)
    return resolved


# -- parsing and validation helpers ----------------------------------------------------------------------
_OPTIONAL = {"device_memory_budget_bytes", "max_unit_bytes", "bandwidth_probe_bytes"}
_BYTES = _OPTIONAL
_INTS = {"lookahead", "warmup_calls"}
_FLOATS = {"gpu_resident_weight_ratio", "bandwidth_safety_factor", "prefetch_margin_ms"}
_BOOLS = {"direct_unit_calls"}


def _parse(name: str, raw: str, source: str | None = None) -> Any:
    where = source or name
    text = raw.strip()
    try:
        if name in _OPTIONAL and text.lower() in ("", "none", "null"):
            return None
        if name in _BYTES:
            return parse_bytes(text)
        if name in _INTS:
            return parse_int(text)
        if name in _FLOATS:
            return parse_float(text)
        if name in _BOOLS:
            return parse_bool(text)
    except ValueError as exc:
        raise ConfigError(f"OffloadConfig.{name}: cannot parse {raw!r} from {where}: {exc}") from None
    return text


def _range(name: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"OffloadConfig.{name}={value!r} is invalid; valid: {valid}")


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid; expected a number")
    if math.isnan(value):
        raise ConfigError(f"OffloadConfig.{name}=nan is invalid; expected a number")
    return float(value)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid; expected an integer")
    return value


def _opt_int(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value)
