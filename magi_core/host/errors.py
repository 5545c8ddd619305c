"""Errors of the host-memory layer; each message says what to do."""

from __future__ import annotations

from magi_core.errors import MagiError


class ShmSpaceError(MagiError):
    """The shared-memory filesystem has no room for the weights."""

    def __init__(self, shm_dir: str, needed: int, available: int, cause: str | None = None) -> None:
        self.shm_dir, self.needed, self.available = shm_dir, needed, available
        why = f" ({cause})" if cause else ""
        super().__init__(
            f"no room for the host weights in {shm_dir}{why}: {needed} bytes needed ({needed / 2**30:.2f} GiB), "
            f"{available} bytes available ({available / 2**30:.2f} GiB). Enlarge it (e.g. docker --shm-size, "
            f"or mount -o remount,size=... {shm_dir}), point MAGI_SHM_DIR at a larger tmpfs, or set "
            "MAGI_SKIP_SHM=1 to keep plain host tensors. The model was left unchanged."
        )


class WeightMismatchError(MagiError):
    """Ranks that would share one host file hold different weights."""


class HostStateError(MagiError):
    """The model's host weights are in a state that does not allow the requested operation."""
