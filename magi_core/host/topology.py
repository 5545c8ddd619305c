"""Where this process sits: rank, world, node-local peers and the expert-parallel (EP) size.

EP size, first match wins:

1. the explicit argument (``HostOptions.ep_size`` / ``offload(..., ep_size=)``);
2. ``MAGI_EP_SIZE``;
3. launcher variables, in this order: ``EXPERT_MODEL_PARALLEL_SIZE`` (Megatron-style launch scripts),
   ``EXPERT_PARALLEL_SIZE``, ``EP_SIZE``;
4. 1 (every rank holds the same weights). With EP size 1 the ranks of a node share one file, and a
   sampled fingerprint of every tensor (a fast pre-check) and then a comparison of every byte prove they
   really hold the same weights: when they do not, :func:`magi_core.host.materialize` fails on every rank
   naming the tensors and says to set ``MAGI_EP_SIZE``; it never silently shares.

Node-local peers are found by exchanging (host name, shm-directory device and inode, uid) over
torch.distributed, so ranks that can open the same file are grouped whatever launcher started them;
the launchers' node-local world size (``LOCAL_WORLD_SIZE`` of torchrun, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
``MPI_LOCALNRANKS``) is only cross-checked.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from magi_core._env import first_env_int
from magi_core.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_EP_SIZE = "MAGI_EP_SIZE"
LAUNCHER_EP_VARS = ("EXPERT_MODEL_PARALLEL_SIZE", "EXPERT_PARALLEL_SIZE", "EP_SIZE")
LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def resolve_ep_size(explicit: int | None = None) -> int:
    """The EP size: explicit > ``MAGI_EP_SIZE`` > launcher variables > 1."""
    if explicit is not None:
        if explicit < 1:
            raise ConfigError(f"ep_size={explicit}: must be >= 1")
        return int(explicit)
    value = first_env_int((ENV_EP_SIZE, *LAUNCHER_EP_VARS), minimum=1)
    return 1 if value is None else value


def env_local_world_size() -> int | None:
    """The node-local world size a launcher exported, or None."""
    return first_env_int(LOCAL_WORLD_VARS, minimum=0, skip_invalid=True)


@dataclass(frozen=True)
class Topology:
    """This process's place in the run: global rank/world and the ranks it can share a file with."""

    rank: int
    world_size: int
    node_ranks: tuple[int, ...]
    ep_size: int

    @property
    def distributed(self) -> bool:
        """True when torch.distributed is initialised with more than one rank."""
        return self.world_size > 1

    @property
    def local_rank(self) -> int:
        """Index of this rank among the ranks of its node."""
        return self.node_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        """Number of ranks on this node."""
        return len(self.node_ranks)

    @property
    def node_leader(self) -> int:
        """Lowest global rank of this node."""
        return self.node_ranks[0]


def node_key(shm_dir: str) -> tuple[str, int, int, int]:
    """What two ranks must share to open one file: host name, shm dir device and inode, uid."""
    st = os.stat(shm_dir)
    return (socket.gethostname(), int(st.st_dev), int(st.st_ino), os.getuid())


_group_lock = threading.Lock()
_groups: dict[int, Any] = {}


class Coordinator:
    """Host-side collectives for materialisation: a gloo group (the default one when it is gloo)."""

    def __init__(self) -> None:
        on = _dist_on()
        self.rank = dist.get_rank() if on else 0
        self.world_size = dist.get_world_size() if on else 1
        self.group: Any = None
        if self.world_size > 1:
            self.group = _host_group()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (just ``[obj]`` without torch.distributed)."""
        if self.world_size <= 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _host_group() -> Any:
    """A gloo process group over all ranks, created once per default group (collective on first use)."""
    default = dist.distributed_c10d._get_default_group()
    with _group_lock:
        key = id(default)
        if key not in _groups:
            if dist.get_backend() == "gloo":
                _groups[key] = None  # the default group already runs on the host
            else:
                _groups[key] = dist.new_group(backend="gloo")
        return _groups[key]


def build_topology(rank: int, keys: list[Any], ep_size: int, shm_dir: str) -> Topology:
    """The :class:`Topology` of ``rank`` from every rank's :func:`node_key` (gathered in rank order)."""
    node = tuple(r for r, k in enumerate(keys) if k == keys[rank])
    topo = Topology(rank=rank, world_size=len(keys), node_ranks=node, ep_size=ep_size)
    env_lws = env_local_world_size()
    if topo.distributed and env_lws is not None and env_lws != topo.local_world_size:
        logger.warning(
            "rank %d: the launcher says %d ranks per node but %d ranks share this host's %s; "
            "files are shared by the latter", topo.rank, env_lws, topo.local_world_size, shm_dir,
        )
    return topo
