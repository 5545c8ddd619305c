"""Errors of the host-memory layer; each message says what to do."""

from __future__ import annotations

from magi_core.errors import MagiError


class ShmSpaceError(MagiError):
    """The shared-memory filesystem has no room for the weights (no free bytes, or no free inodes)."""

    def __init__(self, shm_dir: str, needed: int, available: int, cause: str | None = None,
                 inodes: bool = False) -> None:
        self.shm_dir, self.needed, self.available, self.inodes = shm_dir, needed, available, inodes
        why = f" ({cause})" if cause else ""
        what = "files (no free inodes)" if inodes else "the host weights"
        grow = (f"mount -o remount,nr_inodes=... {shm_dir}, or remove unused files there" if inodes
                else f"mount -o remount,size=... {shm_dir}")
        super().__init__(
            f"no room for {what} in {shm_dir}{why}: {needed} bytes needed ({needed / 2**30:.2f} GiB), "
            f"{available} bytes available ({available / 2**30:.2f} GiB). Enlarge it (e.g. docker --shm-size, "
            f"or {grow}), point MAGI_SHM_DIR at a larger tmpfs, or set "
            "MAGI_SKIP_SHM=1 to keep plain host tensors. The model was left unchanged."
        )


class WeightMismatchError(MagiError):
    """Ranks that would share one host file hold different weights."""


class HostStateError(MagiError):
    """The model's host weights are in a state that does not allow the requested operation."""


class WeightSourceError(MagiError):
    """A weight source does not fit the model (missing, unexpected or mis-shaped tensors) or cannot be read."""
