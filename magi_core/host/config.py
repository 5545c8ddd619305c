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

from dataclasses import dataclass, replace
from typing import Literal

from magi_core._env import env_bool, env_gib_bytes, env_int, env_str
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
    """How :func:`magi_core.host.materialize` lays out, shares and pins host weights (None = env or default)."""

    #: Expert-parallel size, a hint: > 1 says the ranks' weights are expected to differ (no warning when tensors
    #: differ; tensors whose provenance differs are not compared). Sharing is decided per tensor by content either
    #: way. None: ``MAGI_EP_SIZE``, then launcher variables, else 1.
    ep_size: int | None = None
    #: Keep plain host tensors, no shared memory and no pinning. None: ``MAGI_SKIP_SHM``, else False.
    skip_shm: bool | None = None
    #: Pin (register in place) the mappings through the backend. An arena only this rank maps is pinned in pieces
    #: while it is filled (:class:`magi_core.host.pinning.PinAhead`), the rest after filling.
    pin: bool = True
    #: Ranks of a node pinning at once. None: ``MAGI_PIN_CONCURRENCY``, else host memory / 2 / per-rank bytes.
    pin_concurrency: int | None = None
    #: Pin at most this many bytes per rank (first bytes of the arenas, after filling: a budget turns pinning while
    #: filling off). None: ``MAGI_PIN_BUDGET_GB``, else all.
    pin_budget_bytes: int | None = None
    #: Directory of the shared-memory files. None: ``MAGI_SHM_DIR``, else ``/dev/shm``.
    shm_dir: str | None = None
    #: Show tqdm progress bars. None: only when stderr is a terminal.
    progress: bool | None = None
    #: A tensor that differs between ranks of a node: "copy" (default) gives each differing rank its own copy of it
    #: and shares every identical tensor once (host memory per node = bytes of distinct tensors; a warning names
    #: them when the EP size is 1); "error" raises :class:`WeightMismatchError` on every rank naming them, for jobs
    #: whose ranks must hold the same weights. "per_rank" is the older name of "copy".
    on_mismatch: MismatchPolicy = "copy"
    #: How ranks sharing a file prove they hold the same weights. "full": every rank that maps another rank's
    #: file compares all of its own bytes with the file's before using it (memory speed; see README "Sharing
    #: across ranks"). "sampled": only the sampled fingerprint (misses sparse differences; for when the
    #: weights are known to be identical, e.g. loaded from one checkpoint).
    verify_shared: VerifyMode = "full"
    #: What an in-place write (``param.add_``, ``load_state_dict``, a buffer update) does to weights in a file
    #: shared by several ranks; it never reaches another rank. "read_only" (default): the mapping is made
    #: read-only once written, checked and pinned: one copy per node even when pinned (what sharing is for:
    #: a model that fits the host once, not once per rank), but a write kills the writing process with SIGSEGV
    #: and a Python traceback (torch cannot turn it into an exception; the log says so at set-up).
    #: "copy_on_write": the mapping is private, the write changes this rank's pages only (edits after offload
    #: keep working); but registering such a mapping with CUDA copies every page (measured on an H200), so with
    #: a device pinning it each rank holds its own copy (a warning says so). Files used by one rank only
    #: (EP > 1, one process) stay writable either way.
    shared_writes: SharedWrites = "read_only"
    #: Elements sampled per tensor for the cross-rank fingerprint (a fast pre-check before any file is written).
    fingerprint_samples: int = 64
    #: Byte alignment of every tensor inside an arena.
    alignment: int = 256
    #: Loading from a weight source: the most anonymous memory used to read and convert tensors (one reused buffer;
    #: a tensor whose dtype matches the model's is read straight into the arena). None: 4% of the weight bytes
    #: (loading adds at most 5% in all), at least 4 KiB and at most 64 MiB.
    staging_bytes: int | None = None
    #: Loading from files: threads reading at once on each rank (each with its share of the staging window), into
    #: the arena's mapping. None: the host's cores divided among the node's ranks, at most 8 (one thread copying
    #: file ranges in the kernel reached 0.64x of the page-cache read rate on the H200 host, 8 threads 1.56x).
    #: A function source is called from one thread unless it is a ``CallableSource(..., thread_safe=True)``.
    load_threads: int | None = None
    #: Remove files of crashed runs (owner gone: its lock is free) from the shm directory before creating ours.
    cleanup_stale: bool = True
    #: TEST ONLY: ignore the EP size and every check and share one file anyway (the old, corrupting way).
    _unsafe_share_across_ranks: bool = False

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
        """Raise :class:`ConfigError` naming the bad field and what to set instead."""
        if self.ep_size is not None and self.ep_size < 1:
            raise ConfigError(f"HostOptions.ep_size={self.ep_size}: must be >= 1")
        if self.pin_concurrency is not None and self.pin_concurrency < 1:
            raise ConfigError(f"HostOptions.pin_concurrency={self.pin_concurrency}: must be >= 1 (or None for auto)")
        if self.pin_budget_bytes is not None and self.pin_budget_bytes < 0:
            raise ConfigError(f"HostOptions.pin_budget_bytes={self.pin_budget_bytes}: must be >= 0 (or None for all)")
        if self.on_mismatch not in ("copy", "error", "per_rank"):
            raise ConfigError(f"HostOptions.on_mismatch={self.on_mismatch!r}: use 'copy' (differing tensors get a copy "
                              "per rank) or 'error'")
        if self.load_threads is not None and self.load_threads < 1:
            raise ConfigError(f"HostOptions.load_threads={self.load_threads}: must be >= 1 (or None for auto)")
        if self.staging_bytes is not None and self.staging_bytes < 4096:
            raise ConfigError(f"HostOptions.staging_bytes={self.staging_bytes}: must be >= 4096 (or None for 4% of "
                              "the weights)")
        if self.verify_shared not in ("full", "sampled"):
            raise ConfigError(f"HostOptions.verify_shared={self.verify_shared!r}: use 'full' or 'sampled'")
        if self.shared_writes not in ("read_only", "copy_on_write"):
            raise ConfigError(f"HostOptions.shared_writes={self.shared_writes!r}: use 'read_only' or 'copy_on_write'")
        if self.fingerprint_samples < 1:
            raise ConfigError(f"HostOptions.fingerprint_samples={self.fingerprint_samples}: must be >= 1")
        a = self.alignment
        if a < 64 or a & (a - 1):
            raise ConfigError(f"HostOptions.alignment={a}: use a power of two >= 64 (default 256)")
