"""Whether a runtime exchanges weights across the ranks of its node (``OffloadConfig.exchange``), and with whom.

The exchange groups are the node's ranks (torchrun's ``LOCAL_WORLD_SIZE`` consecutive ranks), made once per
process with :func:`torch.distributed.new_subgroups` on the default backend (NCCL on GPUs) for the weights
and on gloo for the small agreements; every rank must compile its first offloaded graph, as data-parallel
ranks do. A weight's identity across ranks is the shared-memory file and offset its bytes lie at: ranks that
map the same file at the same offset hold the same bytes (copy-on-write mappings, where a rank may have
edited its own pages, and plain host memory have no identity, so they are never exchanged).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from magi_core._env import env_float, register_env_names
from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError
from magi_core.execute.transfer.exchange import ExchangeTransfer, Identity
from magi_core.host.topology import GroupCache
from magi_core.plugin.facade import Backend

if TYPE_CHECKING:
    from magi_core.host import HostWeights

logger = logging.getLogger(__name__)

register_env_names(["MAGI_EXCHANGE_TIMEOUT_S"])
#: How long a rank waits for the others in an exchange before failing (a dead or diverged rank), in seconds.
EXCHANGE_TIMEOUT_S = env_float("MAGI_EXCHANGE_TIMEOUT_S", minimum=1.0) or 300.0

#: Process-group backends whose all-gather works on device tensors (torch_musa registers "mccl").
DEVICE_COLLECTIVES = ("nccl", "mccl", "xccl", "hccl")

#: This node's (weights group, gloo agreement group), per default group (made again after a new
#: ``init_process_group``, never kept alive past ``destroy_process_group``).
_NODE_GROUPS = GroupCache()

def _node_size() -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() else dist.get_world_size()


def node_groups() -> tuple[Any, Any] | None:
    """This node's (weights group, gloo agreement group), made once per default group; None for a single rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = _node_size()
    if size <= 1 or dist.get_world_size() % size:
        return None

    def make() -> tuple[Any, Any]:
        timeout = datetime.timedelta(seconds=EXCHANGE_TIMEOUT_S)
        group, _ = dist.new_subgroups(group_size=size, timeout=timeout)
        meta, _ = dist.new_subgroups(group_size=size, backend="gloo", timeout=timeout)
        return group, meta

    group, meta = _NODE_GROUPS.get(make)
    return group, meta


def host_identity(host: HostWeights | None) -> Identity:
    """Identity of a weight's bytes across ranks: (file inode, offset, bytes) in a shared read-only mapping."""

    def identity(t: torch.Tensor) -> Hashable | None:
        if host is None or host.released:
            return None
        loc = host.locate(t)
        if loc is None:
            return None
        arena = next((a for a in host.arenas if a.key == loc.arena), None)
        if arena is None or arena.inode is None or arena.private or arena.mapping is None:
            return None
        return (arena.inode, loc.offset, loc.nbytes, str(t.dtype), tuple(t.shape))

    return identity


def exchange_transfer(
    config: OffloadConfig, backend: Backend, device: torch.device, host: HostWeights | None
) -> ExchangeTransfer | None:
    """The exchange transfer ``config.exchange`` asks for, or None (off, one rank, or nothing to exchange with)."""
    if config.exchange == "off":
        return None
    if config.exchange == "auto" and not backend.is_accelerator:
        logger.info("magi exchange: 'auto' exchanges only between accelerators (backend %r): each rank copies "
                    "its own weights", backend.name)
        return None
    groups = node_groups()
    if groups is None:
        if config.exchange == "on":
            raise ConfigError(
                "OffloadConfig(exchange='on') needs torch.distributed initialised with more than one rank on the "
                "node (e.g. torchrun --nproc-per-node 2 ...); use exchange='auto' to exchange only when it can"
            )
        return None
    kind = str(dist.get_backend(groups[0])).lower()
    if backend.is_accelerator and kind not in DEVICE_COLLECTIVES:
        if config.exchange == "on":
            raise ConfigError(
                f"OffloadConfig(exchange='on'): the process group's backend {kind!r} has no device all-gather "
                f"magi-core knows ({', '.join(DEVICE_COLLECTIVES)}); initialise torch.distributed with one of "
                "them, or use exchange='auto' (falls back to per-rank copies)"
            )
        logger.warning("magi exchange: process group backend %r has no device all-gather; each rank copies its "
                       "own weights (initialise torch.distributed with %s to exchange)", kind,
                       " or ".join(DEVICE_COLLECTIVES))
        return None
    group, meta = groups
    logger.info("magi exchange: %d ranks of this node share the weights they stream", dist.get_world_size(group))
    return ExchangeTransfer(backend, device, group, meta, host_identity(host))
