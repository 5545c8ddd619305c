"""The one parser of environment variables (and of the text values ``torch.compile`` options may carry).

``parse_*`` turn a text into a value or raise :class:`ValueError` saying what was expected; ``env_*`` read a
variable (None when it is unset or blank) and raise :class:`~magi_core.errors.ConfigError` naming the
variable and how to fix it. Every ``MAGI_*`` setting of magi-core is read through here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from magi_core.errors import ConfigError

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
    """A number, at least ``minimum`` when given."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if minimum is not None and not value >= minimum:
        raise ValueError(f"below {minimum:g}")
    return value


def parse_bytes(text: str) -> int:
    """A byte count such as ``1073741824``, ``1GiB``, ``512 MiB``, ``2GB`` or ``1e9``."""
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _SUFFIX:
        raise ValueError("not a byte size (examples: 1073741824, 1GiB, 512MiB, 2GB)")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value != int(value):
        raise ValueError("not a whole number of bytes")
    return int(value)


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
    """Numeric variable ``name`` (``unit`` names its unit in messages); None when unset or blank."""
    want = (f"a number of {unit}" if unit else "a number") + (f" >= {minimum:g}" if minimum is not None else "")
    return _env(name, lambda raw: parse_float(raw, minimum), want, environ)


__all__ = [
    "FALSE_WORDS",
    "GIB",
    "MIB",
    "TRUE_WORDS",
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "first_env_int",
    "parse_bool",
    "parse_bytes",
    "parse_float",
    "parse_int",
]
