"""``OffloadConfig``: the offload runtime's settings, from code, ``torch.compile`` options or the environment.

Precedence (:func:`resolve_config`), lowest first: field defaults < ``MAGI_OFFLOAD_<FIELD>`` environment
variables < fields passed explicitly to ``OffloadConfig(...)`` (or to :meth:`OffloadConfig.replace`) <
``torch.compile(..., options={...})`` entries. Environment variables only replace *defaults*: a field the
code set (even to its default value, e.g. ``OffloadConfig(policy="HEURISTIC")``) is never overridden by
the environment (the ignored variable is logged as a warning). ``gpu_resident_weight_ratio`` and
``device_memory_budget_bytes`` are one decision (how much stays resident): setting either explicitly also
keeps the environment's value for the other out. An unknown ``MAGI_OFFLOAD_*`` variable (a typo) is logged as
a warning naming the closest valid one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar

from magi_core._env import (
    GIB,
    MIB,
    OFFLOAD_PREFIX,
    did_you_mean,
    parse_bool,
    parse_bytes,
    parse_choice,
    parse_float,
    parse_int,
    register_env_names,
    warn_unknown_env,
)
from magi_core.errors import ConfigError
from magi_core.plugin.spec import UNIT_COMPILERS as BACKEND_UNIT_COMPILERS

logger = logging.getLogger(__name__)

ENV_PREFIX = OFFLOAD_PREFIX
#: Bandwidth probe size when ``bandwidth_probe_bytes`` is None: 1 GiB on accelerators, 16 MiB on the host.
DEFAULT_PROBE_BYTES_ACCELERATOR = GIB
DEFAULT_PROBE_BYTES_CPU = 16 * MIB
#: Device memory the fit-the-card budget leaves free besides the measured activation peak: what the
#: allocator's fragmentation, the runtime's workspaces and kernels' scratch memory take: this many bytes plus
#: :data:`DEVICE_RESERVE_SHARE` of the device's memory.
DEVICE_RESERVE_BYTES = GIB // 2
DEVICE_RESERVE_SHARE = 0.1
#: Values of ``OffloadConfig.unit_compiler``.
UNIT_COMPILERS = ("auto", *BACKEND_UNIT_COMPILERS)
#: How streamed weights are copied: "auto" (by backend kind), one copy per unit into a planned device buffer,
#: or one copy per weight.
TRANSFERS = ("auto", "unit", "per_tensor")
#: Whether ranks of a node that stream the same weights fetch a share each and all-gather the rest.
EXCHANGES = ("off", "auto", "on")


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


#: Which policy names a scheduler exists for now (built-in, registered, entry points): installed by
#: :mod:`magi_core.plan.registry`, a floor up, so that configs check a plugin policy's name on construction.
_policy_names: Callable[[], Sequence[str]] | None = None


def use_policy_names(lookup: Callable[[], Sequence[str]]) -> None:
    """Let configs check policy names that are not built-in with ``lookup`` (the policy registry's)."""
    global _policy_names
    _policy_names = lookup


def _check_policy_name(policy: Policy | str) -> None:
    """Refuse a policy name no scheduler answers to, with a did-you-mean; built-in names are never looked up, so a
    plugin policy must be registered before a config naming it is built."""
    if isinstance(policy, Policy) or _policy_names is None:
        return
    known = _policy_names()
    if policy not in known:
        raise ConfigError(
            f"unknown offload policy {policy!r} (OffloadConfig.policy){did_you_mean(policy, known)}; known policies: "
            f"{', '.join(known)}. A plugin policy must be registered first: magi_core.plan.register_policy("
            f"{policy.lower()!r}, SchedulerClass) or an entry point in the 'magi.policies' group"
        )


@dataclass(frozen=True)
class OffloadConfig:
    """Settings of the offload runtime; every field is validated on construction (:class:`ConfigError`).

    ``policy``: BASE (look-ahead prefetch), COST_EFFECTIVE (keep the least-compute-per-byte units resident)
    or HEURISTIC (latest copy triggers from profiled times; residency where it removes the most stall),
    or the name of a plugin policy registered before the config is built; any case. A name no scheduler
    answers to, and a value outside a closed set (``unit_compiler``, ``transfer``, ``exchange``), is refused
    here with a did-you-mean. With neither ``gpu_resident_weight_ratio`` nor
    ``device_memory_budget_bytes`` set (the default) the plan fits the card: the fastest plan within what the
    device can spare when planning (free memory less the activation peak measured in warm-up and a reserve,
    :data:`DEVICE_RESERVE_BYTES` plus :data:`DEVICE_RESERVE_SHARE` of the device), holding the least memory that
    step needs; on a backend that cannot say how
    much memory its device has (the host backend) every weight streams. ``gpu_resident_weight_ratio`` in [0, 1]:
    at most this share of all weight bytes stays resident on the device (at 1, with no ``max_unit_bytes``,
    nothing streams and the graph is compiled whole, as one unit, where the device's free memory holds every
    weight when it compiles; elsewhere it is split as by default); a ratio whose plan does not fit what the
    device can spare degrades to the fastest plan that fits, with a warning. ``device_memory_budget_bytes``: the
    alternative to the ratio (set one of the two): bytes (an int, or a size such as ``"12GiB"``), a share of the
    device's memory (``"80%"``), or ``"auto"`` (the default's fit-the-card budget); the scheduler keeps as many
    weights resident as fit while resident weights plus the predicted streamed working set stay within it
    (activations not included).
    ``bandwidth_safety_factor`` in (0, 1]: schedulers plan with measured bandwidth times this.
    ``prefetch_margin_ms`` >= 0: slack HEURISTIC keeps between a copy's end and its unit's start.
    ``lookahead`` >= 1: BASE / COST_EFFECTIVE prefetch this many streamed units ahead.
    ``unit_compiler``: "auto" (the active backend's choice from its capabilities: Inductor where it can compile
    for the device, e.g. CUDA; eager on the CPU backend and on devices Inductor cannot compile for), "inductor"
    or "eager" (see :meth:`magi_core.plugin.facade.Backend.resolve_unit_compiler`).
    ``warmup_calls`` >= 0: calls before the static plan is built (the first runs a simple look-ahead, the
    second profiles). Byte sizes (``max_unit_bytes``, ``bandwidth_probe_bytes``, ``device_memory_budget_bytes``)
    take an int or a size such as ``"512MiB"`` or ``"2GB"``, parsed as the environment's are.
    ``max_unit_bytes``: split units whose weights exceed this many bytes, and merge consecutive
    blocks of one stack up to it (None: automatic, every block its own unit and other code cut at the largest
    block's weight bytes, or 256 MiB in a graph without repeated blocks; see :mod:`magi_core.passes.split`).
    ``bandwidth_probe_bytes``: size of the H2D bandwidth probe (None: 1 GiB on accelerators, 16 MiB on CPU).
    ``direct_unit_calls``: call each Inductor unit's generated code without the Dynamo / AOT wrapper layers
    (verified per unit on its first call, see :func:`magi_core.execute.unit_compile.direct_call`); False
    keeps the wrapped calls (``MAGI_OFFLOAD_DIRECT_UNIT_CALLS=0``).
    ``transfer``: "auto" (default: "unit" on accelerators, "per_tensor" on the host backend), "unit" (each
    unit's streamed weights are one copy per host storage into a fixed place of one device buffer planned for
    the step, with views made once: no allocation and one copy call per unit) or "per_tensor" (one copy per
    weight, each allocated from the device's caching allocator), see :mod:`magi_core.execute.transfer`.
    ``exchange``: "off" (default), "auto" or "on": ranks of one node running the same graph on identical
    host weights (torch.distributed initialised, e.g. under torchrun) each copy ``1/N`` of every unit from the
    host and all-gather the rest over the device interconnect (:mod:`magi_core.execute.transfer.exchange`);
    "auto" does so on accelerators when the node has more than one rank, "on" also on the host backend (gloo)
    and fails when there is no process group. Batches whose bytes differ between ranks are copied whole.

    Every field can also come from ``MAGI_OFFLOAD_<FIELD>`` (e.g. ``MAGI_OFFLOAD_POLICY=base``), but only where
    the code left the default: the config records which fields were passed to the constructor
    (:attr:`explicit_fields`; :meth:`replace` and ``torch.compile`` options add theirs), and
    :func:`resolve_config` lets the environment fill the others. Precedence, lowest first: defaults <
    ``MAGI_OFFLOAD_*`` < explicit fields < ``torch.compile`` options.
    """

    policy: Policy | str = Policy.HEURISTIC
    gpu_resident_weight_ratio: float | None = None
    device_memory_budget_bytes: int | str | None = None
    bandwidth_safety_factor: float = 0.9
    prefetch_margin_ms: float = 0.1
    lookahead: int = 1
    unit_compiler: str = "auto"
    warmup_calls: int = 2
    max_unit_bytes: int | str | None = None
    bandwidth_probe_bytes: int | str | None = None
    direct_unit_calls: bool = True
    transfer: str = "auto"
    exchange: str = "off"
    #: True on configs returned by :func:`resolve_config` (environment applied); set per instance, never
    #: compared, and not carried over by :meth:`replace`.
    _resolved: ClassVar[bool] = False
    #: Names of the fields set explicitly (constructor arguments, :meth:`replace` changes, ``options`` keys);
    #: set per instance and never compared. The environment never overrides these.
    _explicit: ClassVar[frozenset[str]] = frozenset()
    #: Set on the copy a graph plans with next to other graphs of its model (:meth:`planning_rest`); per instance,
    #: never compared, and not carried over by :meth:`replace`.
    _rest_share: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "policy", normalize_policy(self.policy))
        if self.gpu_resident_weight_ratio is not None:
            ratio = _float("gpu_resident_weight_ratio", self.gpu_resident_weight_ratio)
            set_(self, "gpu_resident_weight_ratio", ratio)
            if not 0.0 <= ratio <= 1.0:
                raise _range("gpu_resident_weight_ratio", ratio, "[0, 1], or None")
        set_(self, "device_memory_budget_bytes", _budget(self.device_memory_budget_bytes))
        if self.device_memory_budget_bytes is not None:
            if self.gpu_resident_weight_ratio:
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
        set_(self, "unit_compiler", _choice("unit_compiler", self.unit_compiler, UNIT_COMPILERS))
        set_(self, "warmup_calls", _int("warmup_calls", self.warmup_calls))
        if self.warmup_calls < 0:
            raise _range("warmup_calls", self.warmup_calls, ">= 0")
        for name in ("max_unit_bytes", "bandwidth_probe_bytes"):
            value = _opt_bytes(name, getattr(self, name))
            if value is not None and value <= 0:
                raise _range(name, value, "> 0 bytes, or None")
            set_(self, name, value)
        if not isinstance(self.direct_unit_calls, bool):
            raise _range("direct_unit_calls", self.direct_unit_calls, "True or False")
        set_(self, "transfer", _choice("transfer", self.transfer, TRANSFERS))
        set_(self, "exchange", _choice("exchange", self.exchange, EXCHANGES))
        _check_policy_name(self.policy)  # last: the registry is asked only about an otherwise valid config

    # -- derived values -----------------------------------------------------------------------------
    @property
    def fits_card(self) -> bool:
        """True when the plan's device budget is what the device can spare (neither a ratio nor bytes given)."""
        return self.gpu_resident_weight_ratio is None and self.device_memory_budget_bytes is None

    @property
    def unit_bytes_cap(self) -> int | None:
        """``max_unit_bytes`` in bytes (a size given as text is parsed on construction); None: automatic."""
        return None if self.max_unit_bytes is None else int(self.max_unit_bytes)

    @property
    def resident_ratio(self) -> float:
        """``gpu_resident_weight_ratio`` as a number (0 when it is not set)."""
        return self.gpu_resident_weight_ratio or 0.0

    @property
    def planned_resident_share(self) -> float:
        """The share of the weight bytes being planned that may stay resident (what schedulers cap residency with):
        :attr:`resident_ratio`, or for a graph planned next to other graphs of its model the share of the weights
        those do not keep resident already (:meth:`planning_rest`)."""
        return self.resident_ratio if self._rest_share is None else self._rest_share

    def planning_rest(self, share: float) -> OffloadConfig:
        """A copy whose :attr:`planned_resident_share` is ``share`` (clamped to [0, 1]); every field, so also
        ``gpu_resident_weight_ratio`` (a share of all the model's weights), keeps its value and meaning."""
        new = self._evolve({}, self._explicit)
        object.__setattr__(new, "_rest_share", min(1.0, max(0.0, float(share))))
        return new

    def budget_bytes(self, device_total: int | None) -> int | None:
        """``device_memory_budget_bytes`` in bytes: a share (``"80%"``) of ``device_total``; None when not set.

        A share of a device whose size is unknown (``device_total`` None) raises :class:`ConfigError`.
        """
        budget = self.device_memory_budget_bytes
        if not isinstance(budget, str):
            return budget
        if device_total is None:
            raise ConfigError(
                f"OffloadConfig.device_memory_budget_bytes={budget!r} is a share of the device's memory, and this "
                "backend cannot say how much its device has; give bytes instead (e.g. '12GiB')"
            )
        return max(1, math.floor(float(budget[:-1]) / 100.0 * device_total))

    def probe_bytes(self, is_accelerator: bool) -> int:
        """Size of the bandwidth probe: ``bandwidth_probe_bytes`` or the default for the backend kind."""
        if self.bandwidth_probe_bytes is not None:
            return int(self.bandwidth_probe_bytes)  # already bytes: sizes are parsed on construction
        return DEFAULT_PROBE_BYTES_ACCELERATOR if is_accelerator else DEFAULT_PROBE_BYTES_CPU

    def to_dict(self) -> dict[str, Any]:
        """Plain field values (the policy as its name), suitable for logging or ``from_options``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["policy"] = str(out["policy"])
        return out

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Fields set explicitly (constructor arguments, :meth:`replace` changes, ``options`` keys): the
        ``MAGI_OFFLOAD_*`` environment does not override them. (``dataclasses.replace`` passes every field to
        the constructor, so its copies count every field as explicit; use :meth:`replace`.)"""
        return self._explicit

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` applied and validated; the changed fields count as explicitly set."""
        return self._evolve(changes, self._explicit | frozenset(changes))

    def __replace__(self, **changes: Any) -> OffloadConfig:  # copy.replace (Python 3.13+)
        return self.replace(**changes)

    def _evolve(self, changes: Mapping[str, Any], explicit: frozenset[str]) -> OffloadConfig:
        new = dataclasses.replace(self, **changes)
        object.__setattr__(new, "_explicit", explicit)
        return new

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
        """Fill the fields ``base`` did not set explicitly from ``MAGI_OFFLOAD_<FIELD>`` (``MAGI_OFFLOAD_POLICY=base``).

        Optional fields accept ``none``; byte sizes accept suffixes (``512MiB``, ``2GB``); numbers must be
        finite. A variable is parsed even where an explicit field wins (a bad value is an error either way);
        the ignored variable is then logged as a warning. An unknown ``MAGI_*`` variable is logged as a
        warning naming the closest valid one (:func:`magi_core._env.warn_unknown_env`). Fields filled here
        stay non-explicit.
        """
        base = base if base is not None else cls()
        env = os.environ if environ is None else environ
        warn_unknown_env(env)
        explicit = base._explicit
        # the ratio and the budget are one decision: an explicit one keeps the environment's other one out
        blocked = dict.fromkeys(explicit, "")
        if "gpu_resident_weight_ratio" in explicit:
            blocked.setdefault("device_memory_budget_bytes", "gpu_resident_weight_ratio")
        if "device_memory_budget_bytes" in explicit and base.device_memory_budget_bytes is not None:
            blocked.setdefault("gpu_resident_weight_ratio", "device_memory_budget_bytes")
        valid = cls.field_names()
        changes: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key, raw in sorted(env.items()):
            name = key[len(ENV_PREFIX):].lower() if key.startswith(ENV_PREFIX) else ""
            if name not in valid:
                continue
            value = _parse(name, raw, source=key)
            if name in blocked:
                _note_ignored(key, raw, blocked[name] or name)
                continue
            changes[name] = value
            sources[name] = f"{key}={raw!r}"
        if not changes:
            return base
        try:
            return base._evolve(changes, explicit)
        except ConfigError as exc:
            named = [src for name, src in sources.items() if name in str(exc)] or list(sources.values())
            raise ConfigError(f"{exc} (from the environment: {', '.join(named)})") from None


def resolve_config(
    config: OffloadConfig | None = None,
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> OffloadConfig:
    """The effective config: defaults < ``MAGI_OFFLOAD_*`` < ``config``'s explicit fields < ``options``.

    ``options`` are applied on ``config`` and count as explicit; the environment then fills only the fields
    neither set (see :meth:`OffloadConfig.from_env`). Each entry point resolves once on the way in
    (``offload`` / ``load``, ``compile_offloaded``, or the Dynamo backend for ``torch.compile(backend=
    "magi_offload")``) and hands the result down; the result is marked resolved, and resolving it again without
    ``options`` (or ``environ``) returns it unchanged.
    """
    if config is not None and config._resolved and not options and environ is None:
        return config
    resolved = OffloadConfig.from_env(OffloadConfig.from_options(options, base=config), environ=environ)
    if config is not None and resolved is config:  # nothing changed it: mark a copy, never the caller's object
        resolved = config._evolve({}, config._explicit)
    object.__setattr__(resolved, "_resolved", True)
    return resolved


_ignored_lock = threading.Lock()
_ignored_noted: set[tuple[str, str]] = set()


def _note_ignored(key: str, raw: str, field_name: str) -> None:
    """Log (once per process and value) that an environment variable lost to an explicitly set field."""
    with _ignored_lock:
        if (key, raw) in _ignored_noted:
            return
        _ignored_noted.add((key, raw))
    logger.warning(
        "%s=%r is ignored: OffloadConfig.%s was set explicitly (in code or torch.compile options), which beats "
        "the environment; drop it there to let the variable decide", key, raw, field_name,
    )


def _recording_init(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap the dataclass ``__init__`` so each config records which fields its caller passed."""

    @functools.wraps(init)
    def __init__(self: OffloadConfig, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in fields(OffloadConfig)]
        object.__setattr__(self, "_explicit", frozenset(names[: len(args)]) | frozenset(kwargs))
        init(self, *args, **kwargs)

    return __init__


setattr(OffloadConfig, "__init__", _recording_init(OffloadConfig.__init__))  # noqa: B010 - mypy forbids method assignment
register_env_names(ENV_PREFIX + name.upper() for name in OffloadConfig.field_names())


# -- parsing and validation helpers ----------------------------------------------------------------------
_OPTIONAL = {"gpu_resident_weight_ratio", "device_memory_budget_bytes", "max_unit_bytes", "bandwidth_probe_bytes"}
#: Byte sizes; the budget also takes "N%" and "auto" (its own parser, :func:`_budget`).
_BYTES = {"max_unit_bytes", "bandwidth_probe_bytes"}
_INTS = {"lookahead", "warmup_calls"}
_FLOATS = {"gpu_resident_weight_ratio", "bandwidth_safety_factor", "prefetch_margin_ms"}
_BOOLS = {"direct_unit_calls"}


def _parse(name: str, raw: str, source: str | None = None) -> Any:
    where = source or name
    text = raw.strip()
    try:
        if name in _OPTIONAL and text.lower() in ("", "none", "null"):
            return None
        if name == "device_memory_budget_bytes":
            return text
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
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid; expected a finite number") from None
    if math.isnan(number):
        raise ConfigError(f"OffloadConfig.{name}=nan is invalid; expected a number")
    if math.isinf(number):
        raise ConfigError(f"OffloadConfig.{name}={number!r} is invalid; expected a finite number")
    return number


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid; expected an integer")
    return value


def _budget(value: Any) -> int | str | None:
    """``device_memory_budget_bytes`` normalised: bytes (int, or a size like ``"12GiB"``), a share ``"N%"`` in
    (0, 100], or None for ``"auto"`` / None (what the device can spare)."""
    name = "device_memory_budget_bytes"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "none", ""):
            return None
        if text.endswith("%"):
            try:
                share = parse_float(text[:-1].strip())
            except ValueError:
                share = math.nan
            if not 0.0 < share <= 100.0:
                raise _range(name, value, "a share of the device's memory in (0%, 100%], e.g. '80%'")
            return f"{share:g}%"
        try:
            value = parse_bytes(text)
        except ValueError as exc:
            raise ConfigError(
                f"OffloadConfig.{name}={value!r} is invalid: {exc}{did_you_mean(text, ('auto',))}; valid: bytes "
                "('12GiB', 12884901888), a share of the device's memory ('80%'), or 'auto'"
            ) from None
    budget = _opt_int(name, value)
    if budget is not None and budget <= 0:
        raise _range(name, budget, "> 0 bytes, a share such as '80%', 'auto' or None")
    return budget


def _opt_int(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value)


def _opt_bytes(name: str, value: Any) -> int | None:
    """A byte-size field: None, an int, or a size such as ``"512MiB"`` / ``"2GB"`` (the environment's parser)."""
    if not isinstance(value, str):
        return _opt_int(name, value)
    try:
        return None if value.strip().lower() in ("", "none", "null") else parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid: {exc}") from None


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` normalised when it is one of ``choices``; else :class:`ConfigError` with a did-you-mean."""
    try:
        if isinstance(value, str):
            return parse_choice(value, choices)
        raise ValueError(f"not one of {' / '.join(map(repr, choices))}")
    except ValueError as exc:
        raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid: {exc}") from None
