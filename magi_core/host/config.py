"""Options of the host-memory layer (:class:`HostOptions`) and the environment variables behind them.

Environment variables (read when :meth:`HostOptions.resolve` runs; an explicit field wins):

``MAGI_EP_SIZE``
    Expert-parallel size, a hint (sharing is per tensor, by content); see :mod:`magi_core.host.topology`.
``MAGI_SKIP_SHM=1``
    Keep plain host tensors: no shared-memory file, no pinning (hosts too small for either).
``MAGI_PIN_CONCURRENCY=N``
    How many ranks of a node pin at once (default: available host memory / 2 / per-rank bytes, min 1).
``MAGI_PIN_BUDGET_GB=X``
    Pin only the first X GiB (2**30 bytes) of each rank's weights; the rest stays pageable.
``MAGI_SHM_DIR=PATH``
    Directory of the shared-memory files (default ``/dev/shm``); tests point it at a private directory.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from typing import Any, Literal

from magi_core._env import FALSE_WORDS, TRUE_WORDS, env_bool, env_gib_bytes, env_int, env_str, parse_bool, parse_bytes
from magi_core.errors import ConfigError
from magi_core.host.topology import resolve_ep_size

ENV_SKIP_SHM = "MAGI_SKIP_SHM"
ENV_PIN_CONCURRENCY = "MAGI_PIN_CONCURRENCY"
ENV_PIN_BUDGET_GB = "MAGI_PIN_BUDGET_GB"
ENV_SHM_DIR = "MAGI_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"

MismatchPolicy = Literal["copy", "error", "per_rank"]
VerifyMode = Literal["full", "sampled"]
SharedWrites = Literal["read_only", "copy_on_write"]


def _env_gib(name: str) -> int | None:
    return env_gib_bytes(name)  # finite GiB >= 0 as bytes; nan, inf and overflow raise ConfigError naming it


@dataclass(frozen=True)
class HostOptions:
    """How :func:`magi_core.host.materialize` lays out, shares and pins host weights (None = env or default).

    Every field is checked on construction, as :class:`magi_core.OffloadConfig` checks its own: a
    :class:`ConfigError` names the field for a wrong type (a boolean given as a string, a float or string where a
    count is meant), NaN or infinity, a value out of range, or a value outside a field's fixed set (with a "did you
    mean"). Byte sizes also take sizes such as ``"1GiB"``; integral floats (``4.0``) count as integers.
    """

    ep_size: int | None = None
    """Expert-parallel size, a hint: > 1 says the ranks' weights are expected to differ (no warning when tensors
    differ; tensors whose provenance differs are not compared). Sharing is decided per tensor by content either
    way. None: ``MAGI_EP_SIZE``, then launcher variables, else 1.
    """
    skip_shm: bool | None = None
    """Keep plain host tensors, no shared memory and no pinning. None: ``MAGI_SKIP_SHM``, else False."""
    pin: bool = True
    """Pin (register in place) the mappings through the backend. An arena only this rank maps is pinned in pieces
    while it is filled (:class:`magi_core.host.pinning.PinAhead`), the rest after filling.
    """
    pin_concurrency: int | None = None
    """Ranks of a node pinning at once. None: ``MAGI_PIN_CONCURRENCY``, else host memory / 2 / per-rank bytes."""
    pin_budget_bytes: int | None = None
    """Pin at most this many bytes per rank (first bytes of the arenas, after filling: a budget turns pinning while
    filling off). None: ``MAGI_PIN_BUDGET_GB``, else all.
    """
    shm_dir: str | None = None
    """Directory of the shared-memory files. None: ``MAGI_SHM_DIR``, else ``/dev/shm``."""
    progress: bool | None = None
    """Show tqdm progress bars. None: only when stderr is a terminal."""
    on_mismatch: MismatchPolicy = "copy"
    """A tensor that differs between ranks of a node: "copy" (default) gives each differing rank its own copy of it
    and shares every identical tensor once (host memory per node = bytes of distinct tensors; a warning names
    them when the EP size is 1); "error" raises :class:`WeightMismatchError` on every rank naming them, for jobs
    whose ranks must hold the same weights. "per_rank" is another name of "copy".
    """
    verify_shared: VerifyMode = "full"
    """How ranks sharing a file prove they hold the same weights. "full": every rank that maps another rank's
    file compares all of its own bytes with the file's before using it (memory speed; see the user guide,
    "Several GPUs and ranks"). "sampled": only the sampled fingerprint (misses sparse differences; for when the
    weights are known to be identical, e.g. loaded from one checkpoint).
    """
    shared_writes: SharedWrites = "read_only"
    """What an in-place write (``param.add_``, ``load_state_dict``, a buffer update) does to weights in a file
    shared by several ranks; it never reaches another rank. "read_only" (default): the mapping is made
    read-only once written, checked and pinned: one copy per node even when pinned (what sharing is for:
    a model that fits the host once, not once per rank), but a write kills the writing process with SIGSEGV
    and a Python traceback (torch cannot turn it into an exception; the log says so at set-up).
    "copy_on_write": the mapping is private, the write changes this rank's pages only (edits after offload
    keep working); but registering such a mapping with CUDA copies every page (CUDA registers for writing), so with
    a device pinning it each rank holds its own copy (a warning says so). Files used by one rank only
    (EP > 1, one process) stay writable either way.
    """
    fingerprint_samples: int = 64
    """Elements sampled per tensor for the cross-rank fingerprint (a fast pre-check before any file is written)."""
    alignment: int = 256
    """Byte alignment of every tensor inside an arena."""
    staging_bytes: int | None = None
    """Loading from a weight source: the most anonymous memory used to read and convert tensors (one reused buffer;
    a tensor whose dtype matches the model's is read straight into the arena). None: 4% of the weight bytes
    (loading adds at most 5% in all), at least 4 KiB and at most 64 MiB.
    """
    load_threads: int | None = None
    """Loading from files: threads reading at once on each rank (each with its share of the staging window), into
    the arena's mapping. None: the host's cores divided among the node's ranks, at most 8 (several threads read a
    large checkpoint faster than one thread copying file ranges in the kernel).
    A function source is called from one thread unless it is a ``CallableSource(..., thread_safe=True)``.
    """
    cleanup_stale: bool = True
    """Remove files of crashed runs (owner gone: its lock is free) from the shm directory before creating ours."""
    _unsafe_share_across_ranks: bool = False
    """TEST ONLY: ignore the EP size and every check and share one file anyway (corrupts ranks whose weights differ)."""

    def __post_init__(self) -> None:
        _normalise(self)

    def resolve(self) -> HostOptions:
        """A copy with every None filled from the environment or the default; validates the values."""
        skip = self.skip_shm if self.skip_shm is not None else bool(env_bool(ENV_SKIP_SHM))
        conc = self.pin_concurrency if self.pin_concurrency is not None else env_int(ENV_PIN_CONCURRENCY, 1)
        budget = self.pin_budget_bytes if self.pin_budget_bytes is not None else _env_gib(ENV_PIN_BUDGET_GB)
        shm_dir = self.shm_dir or env_str(ENV_SHM_DIR) or DEFAULT_SHM_DIR
        resolved = replace(
            self,
            ep_size=resolve_ep_size(self.ep_size),
            skip_shm=skip,
            pin_concurrency=conc,
            pin_budget_bytes=budget,
            shm_dir=shm_dir,
        )
        resolved.validate()
        return resolved

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the bad field, what it holds and what to set instead (also run on
        construction)."""
        _normalise(self)


#: Fields holding True or False (None: the environment or the default decides).
_BOOLS = ("pin", "cleanup_stale", "_unsafe_share_across_ranks")
_OPTIONAL_BOOLS = ("skip_shm", "progress")
#: Counts: field -> smallest valid value (all optional but ``fingerprint_samples`` and ``alignment``).
_COUNTS = {"ep_size": 1, "pin_concurrency": 1, "load_threads": 1, "fingerprint_samples": 1, "alignment": 64}
_REQUIRED = ("fingerprint_samples", "alignment")
#: Byte sizes (an int, or a size such as ``"1GiB"``): field -> smallest valid value.
_BYTE_SIZES = {"pin_budget_bytes": 0, "staging_bytes": 4096}
#: Fields with a fixed set of values, and what each value means (for the error).
_CHOICES: dict[str, dict[str, str]] = {
    "on_mismatch": {"copy": "differing tensors get a copy per rank", "error": "raise on every rank",
                    "per_rank": "the older name of 'copy'"},
    "verify_shared": {"full": "compare every byte", "sampled": "compare sampled fingerprints only"},
    "shared_writes": {"read_only": "one copy per node, a write kills the process",
                      "copy_on_write": "a write stays on its rank"},
}
#: What None means for an optional field, for the error.
_NONE_MEANS = {"ep_size": "MAGI_EP_SIZE or 1", "pin_concurrency": "automatic", "load_threads": "automatic",
               "pin_budget_bytes": "pin everything", "staging_bytes": "4% of the weights",
               "skip_shm": "MAGI_SKIP_SHM or False", "progress": "only on a terminal", "shm_dir": "MAGI_SHM_DIR or "
               "/dev/shm"}


def _bad(name: str, value: Any, want: str) -> ConfigError:
    none = f", or None ({_NONE_MEANS[name]})" if name in _NONE_MEANS else ""
    return ConfigError(f"HostOptions.{name}={value!r} is invalid; expected {want}{none}")


def _count(name: str, value: Any) -> int:
    """A whole number (an integral float such as 4.0 too, as in OffloadConfig); bools, strings, NaN refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, _count_want(name))
    if isinstance(value, float):
        if not value.is_integer():  # nan, inf, 2.5
            raise _bad(name, value, _count_want(name))
        value = int(value)
    if value < _COUNTS[name]:
        raise _bad(name, value, _count_want(name))
    if name == "alignment" and value & (value - 1):
        raise _bad(name, value, _count_want(name))
    return int(value)


def _count_want(name: str) -> str:
    if name == "alignment":
        return "a power of two >= 64 (default 256)"
    return f"a whole number >= {_COUNTS[name]}"


def _byte_size(name: str, value: Any) -> int:
    """Bytes: an int, an integral float, or a size such as ``"1GiB"`` / ``"512MiB"`` (finite, whole)."""
    want = f"a number of bytes >= {_BYTE_SIZES[name]} (an int, or a size such as '1GiB' or '512MiB')"
    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except ValueError as exc:
            raise ConfigError(f"HostOptions.{name}={value!r} is {exc}; expected {want}") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, want)
    elif isinstance(value, float):
        if not value.is_integer():
            raise _bad(name, value, want)
        value = int(value)
    if value < _BYTE_SIZES[name]:
        raise _bad(name, value, want)
    return int(value)


def _choice(name: str, value: Any) -> str:
    """One of the field's values (any case, surrounding blanks ignored); else an error listing them, with the
    closest as a "did you mean"."""
    valid = _CHOICES[name]
    listed = "; ".join(f"{k!r} ({v})" for k, v in valid.items())
    if isinstance(value, str):
        word = value.strip().lower()
        if word in valid:
            return word
        near = difflib.get_close_matches(word.replace("-", "_").replace(" ", "_"), list(valid), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"HostOptions.{name}={value!r} is invalid; valid: {listed}{hint}")
    raise ConfigError(f"HostOptions.{name}={value!r} is invalid; expected a string, one of: {listed}")


def _normalise(opts: HostOptions) -> None:
    """Check every field of ``opts`` (types, ranges, values) and store its normal form (e.g. ``"1GiB"`` as bytes);
    :class:`ConfigError` naming the first bad field."""
    set_ = object.__setattr__
    for name in (*_BOOLS, *_OPTIONAL_BOOLS):
        value = getattr(opts, name)
        if value is None and name in _OPTIONAL_BOOLS:
            continue
        if not isinstance(value, bool):
            hint = (f" (a string is not a boolean: pass {parse_bool(value)})" if isinstance(value, str)
                    and value.strip().lower() in (*TRUE_WORDS, *FALSE_WORDS) else "")
            raise _bad(name, value, "True or False" + hint)
    for name in _COUNTS:
        value = getattr(opts, name)
        if value is None and name not in _REQUIRED:
            continue
        set_(opts, name, _count(name, value))
    for name in _BYTE_SIZES:
        value = getattr(opts, name)
        if value is not None:
            set_(opts, name, _byte_size(name, value))
    for name in _CHOICES:
        set_(opts, name, _choice(name, getattr(opts, name)))
    shm_dir = opts.shm_dir
    if shm_dir is not None:
        if isinstance(shm_dir, os.PathLike):
            shm_dir = os.fspath(shm_dir)
        if not isinstance(shm_dir, str) or not shm_dir.strip():
            raise _bad("shm_dir", opts.shm_dir, "a directory path such as '/dev/shm'")
        set_(opts, "shm_dir", shm_dir)
