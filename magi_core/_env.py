"""The one parser of environment variables (and of the text values ``torch.compile`` options may carry).

``parse_*`` turn a text into a value or raise :class:`ValueError` saying what was expected; ``env_*`` read a
variable (None when it is unset or blank) and raise :class:`~magi_core.errors.ConfigError` naming the
variable and how to fix it. Every ``MAGI_*`` setting of magi-core is read through here. Numbers must be
finite: ``nan``, ``inf`` and values that overflow (``1e400``) are errors naming the variable.

:data:`KNOWN_VARIABLES` is the registry of every variable magi-core reads (modules add theirs with
:func:`register_env_names`, e.g. :mod:`magi_core.config` its ``MAGI_OFFLOAD_<FIELD>`` names);
:func:`warn_unknown_env` logs a warning, once per process and name, for a ``MAGI_*`` variable that is not in
it and names the closest known one (a typo such as ``MAGI_OFFLOAD_POLCY`` would otherwise be ignored silently).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from magi_core._once import first_time
from magi_core.errors import ConfigError

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20

#: Words accepted for booleans (any case).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
T = TypeVar("T")
_BOOL_HINT = f"one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"

_SUFFIX = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


# -- text -> value (ValueError) ---------------------------------------------------------------------------
def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case, surrounding blanks ignored)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"not a boolean (use {_BOOL_HINT})")


def parse_int(text: str, minimum: int | None = None) -> int:
    """A whole number, at least ``minimum`` when given."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError("not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"below {minimum}")
    return value


def parse_float(text: str, minimum: float | None = None) -> float:
    """A finite number (``nan``, ``inf`` and overflowing values such as ``1e400`` are refused), at least
    ``minimum`` when given."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"below {minimum:g}")
    return value


def parse_bytes(text: str) -> int:
    """A byte count such as ``1073741824``, ``1GiB``, ``512 MiB``, ``2GB`` or ``1e9`` (finite)."""
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _SUFFIX:
        raise ValueError("not a byte size (examples: 1073741824, 1GiB, 512MiB, 2GB)")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError("not a finite byte size")
    if value != int(value):
        raise ValueError("not a whole number of bytes")
    return int(value)


def parse_gib_bytes(text: str) -> int:
    """A number of GiB (2**30 bytes, >= 0, fractions allowed) as whole bytes; refuses nan, inf and overflow."""
    gib = parse_float(text, 0.0)
    value = gib * GIB
    if not math.isfinite(value):
        raise ValueError("too large")
    return int(value)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to ``value`` (any case), or ``""`` when none is close."""
    pool = {str(c).lower(): str(c) for c in choices}
    hit = difflib.get_close_matches(value.strip().lower(), list(pool), n=1, cutoff=0.6)
    return f" (did you mean {pool[hit[0]]!r}?)" if hit else ""


def parse_choice(text: str, choices: Sequence[str]) -> str:
    """``text`` (any case, blanks stripped) when it is one of ``choices`` (lower-case); else a did-you-mean."""
    word = text.strip().lower()
    if word in choices:
        return word
    raise ValueError(f"not one of {' / '.join(map(repr, choices))}{did_you_mean(word, choices)}")


# -- variable -> value (ConfigError) ------------------------------------------------------------------------
def env_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Variable ``name`` with surrounding blanks removed; None when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def _env(name: str, parse: Callable[[str], T], want: str, environ: Mapping[str, str] | None) -> T | None:
    raw = env_str(name, environ)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is {exc}; set {want}, or unset it") from None


def env_bool(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """Boolean variable ``name`` (see :func:`parse_bool`); None when unset or blank."""
    return _env(name, parse_bool, _BOOL_HINT, environ)


def env_int(name: str, minimum: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """Integer variable ``name``; None when unset or blank; a non-integer or one below ``minimum`` raises."""
    want = "a whole number" + (f" >= {minimum}" if minimum is not None else "")
    return _env(name, lambda raw: parse_int(raw, minimum), want, environ)


def first_env_int(
    names: Sequence[str],
    minimum: int | None = None,
    *,
    skip_invalid: bool = False,
    environ: Mapping[str, str] | None = None,
) -> int | None:
    """The value of the first of ``names`` that is set (:func:`env_int`), or None.

    ``skip_invalid``: a variable that is not a whole number >= ``minimum`` counts as unset instead of raising
    (for launcher variables that are only cross-checked).
    """
    for name in names:
        try:
            value = env_int(name, minimum, environ)
        except ConfigError:
            if skip_invalid:
                continue
            raise
        if value is not None:
            return value
    return None


def env_float(
    name: str, minimum: float | None = None, unit: str = "", environ: Mapping[str, str] | None = None
) -> float | None:
    """Finite numeric variable ``name`` (``unit`` names its unit in messages); None when unset or blank."""
    want = (f"a finite number of {unit}" if unit else "a finite number") + (
        f" >= {minimum:g}" if minimum is not None else ""
    )
    return _env(name, lambda raw: parse_float(raw, minimum), want, environ)


def env_gib_bytes(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """Variable ``name`` in GiB (e.g. ``MAGI_PIN_BUDGET_GB=1.5``) as whole bytes; None when unset or blank."""
    return _env(name, parse_gib_bytes, "a finite number of GiB >= 0", environ)


# -- the registry of known variables ---------------------------------------------------------------------
#: Prefix of every variable magi-core reads.
PREFIX = "MAGI_"
#: Prefix of the :class:`~magi_core.config.OffloadConfig` variables (all of them are magi-core's).
OFFLOAD_PREFIX = "MAGI_OFFLOAD_"
#: Every ``MAGI_*`` variable magi-core reads (grows with :func:`register_env_names`).
KNOWN_VARIABLES: set[str] = {
    "MAGI_BACKEND",  # plugin/manager.py: the backend to use
    "MAGI_TRACE_HOOKS",  # plugin/manager.py: log every hook call
    "MAGI_EP_SIZE",  # host/topology.py
    "MAGI_SKIP_SHM",  # host/config.py
    "MAGI_PIN_CONCURRENCY",  # host/config.py
    "MAGI_PIN_BUDGET_GB",  # host/config.py
    "MAGI_SHM_DIR",  # host/config.py
    "MAGI_SESSION_INSTALLED",  # benchmarks/device_session.sh (exported to the runs it starts)
}
_warned_names: set[str] = set()


def register_env_names(names: Iterable[str]) -> None:
    """Add variables to :data:`KNOWN_VARIABLES` (so :func:`warn_unknown_env` leaves them alone)."""
    KNOWN_VARIABLES.update(names)


def closest_env_name(name: str) -> str | None:
    """The known variable closest to ``name`` (:func:`difflib.get_close_matches`), or None."""
    pool = sorted(KNOWN_VARIABLES)
    if name.startswith(OFFLOAD_PREFIX):  # prefer the config fields, compared without the shared prefix
        fields = [k for k in pool if k.startswith(OFFLOAD_PREFIX)]
        tail = name[len(OFFLOAD_PREFIX):].upper()
        hit = difflib.get_close_matches(tail, [k[len(OFFLOAD_PREFIX):] for k in fields], n=1, cutoff=0.6)
        if hit:
            return OFFLOAD_PREFIX + hit[0]
    hit = difflib.get_close_matches(name, pool, n=1, cutoff=0.75)
    return hit[0] if hit else None


def is_known_env_name(name: str) -> bool:
    """Whether magi-core reads variable ``name`` (``MAGI_OFFLOAD_<field>`` in any case of the field name)."""
    if name in KNOWN_VARIABLES:
        return True
    return name.startswith(OFFLOAD_PREFIX) and OFFLOAD_PREFIX + name[len(OFFLOAD_PREFIX):].upper() in KNOWN_VARIABLES


def unknown_env_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """``MAGI_*`` variables set in ``environ`` (the process environment) that magi-core does not read."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(PREFIX) and not is_known_env_name(k))


def warn_unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn (logging, once per process and name) about unknown ``MAGI_*`` variables; return the messages issued now.

    An unknown ``MAGI_OFFLOAD_*`` name always warns (the prefix is magi-core's), naming the closest valid
    variable or listing them; another unknown ``MAGI_*`` name warns when it is close to a known one (a likely
    typo) and is otherwise only logged at debug level (other packages use the ``MAGI_`` prefix too).
    """
    messages = []
    for name in unknown_env_names(environ):
        if not first_time(_warned_names, name):
            continue
        near = closest_env_name(name)
        if near is None and not name.startswith(OFFLOAD_PREFIX):
            logger.debug("%s is not a magi-core variable; ignored", name)
            continue
        if near is not None:
            hint = f"did you mean {near}?"
        else:
            hint = "magi-core reads " + ", ".join(sorted(k for k in KNOWN_VARIABLES if k.startswith(OFFLOAD_PREFIX)))
        msg = f"{name} is not a magi-core environment variable and is ignored; {hint}"
        logger.warning(msg)
        messages.append(msg)
    return messages


__all__ = [
    "FALSE_WORDS",
    "GIB",
    "KNOWN_VARIABLES",
    "MIB",
    "OFFLOAD_PREFIX",
    "PREFIX",
    "TRUE_WORDS",
    "closest_env_name",
    "did_you_mean",
    "env_bool",
    "env_float",
    "env_gib_bytes",
    "env_int",
    "env_str",
    "first_env_int",
    "is_known_env_name",
    "parse_bool",
    "parse_bytes",
    "parse_choice",
    "parse_float",
    "parse_gib_bytes",
    "parse_int",
    "register_env_names",
    "unknown_env_names",
    "warn_unknown_env",
]
