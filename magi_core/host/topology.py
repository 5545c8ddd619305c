"""Where this process sits: rank, world, node-local peers and the expert-parallel (EP) size.

EP size, first match wins:

1. the explicit argument (``HostOptions.ep_size`` / ``offload(..., ep_size=)``);
2. ``MAGI_EP_SIZE``;
3. launcher variables, in this order: ``EXPERT_MODEL_PARALLEL_SIZE`` (Megatron-style launch scripts),
   ``EXPERT_PARALLEL_SIZE``, ``EP_SIZE``;
4. 1 (every rank holds the same weights).

The EP size is a hint: the ranks of a node share each tensor they hold byte for byte, and each differing
tensor gets a copy per distinct content (:func:`plan_sharing`): a sampled fingerprint of every tensor (or
the provenance of a tensor read from a weight source) groups the candidates, and a comparison of every byte
proves a group's members really hold the same bytes before any of them uses the copy; the members that
differ share a copy among those of them that hold the same bytes (further rounds). EP > 1 only says
differences are expected (no warning about them); tensors known to differ are never compared.

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
import weakref
from collections.abc import Callable, Mapping, Sequence
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


def node_key(shm_dir: str) -> tuple[str, int, int, int]:
    """What two ranks must share to open one file: host name, shm dir device and inode, uid."""
    st = os.stat(shm_dir)
    return (socket.gethostname(), int(st.st_dev), int(st.st_ino), os.getuid())


class GroupCache:
    """Process groups made once per default group and held by weak reference.

    Not keyed by id, so groups made after ``destroy_process_group`` and a new ``init_process_group`` are never
    taken for the old ones; not held, so ``destroy_process_group`` frees them (a group held past it keeps its
    worker threads into interpreter shutdown, where one that still drops a finished collective's tensors is killed
    taking the GIL: "terminate called without an active exception").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._default: weakref.ref[Any] | None = None
        self._groups: tuple[weakref.ref[Any], ...] = ()

    def get(self, make: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
        """The groups ``make()`` made for the current default group, made now when there are none alive."""
        default = dist.distributed_c10d._get_default_group()
        with self._lock:
            if self._default is not None and self._default() is default:
                groups = tuple(r() for r in self._groups)
                if all(g is not None and group_alive(g) for g in groups):
                    return groups
            groups = make()
            self._default = weakref.ref(default)
            self._groups = tuple(weakref.ref(g) for g in groups)
            return groups


_HOST_GROUP = GroupCache()


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
    """A gloo process group over all ranks, created once per default group (collective on first use); None when
    the default group already runs on gloo."""
    groups = _HOST_GROUP.get(lambda: () if dist.get_backend() == "gloo" else (dist.new_group(backend="gloo"),))
    return groups[0] if groups else None


def group_alive(group: Any) -> bool:
    """True while ``group`` is registered with torch.distributed (``destroy_process_group`` forgets it)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or group in pg_map


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


#: What a rank knows about one slot's values, to decide whom it can share a copy with: ``("tok", key)`` its
#: provenance (read from the same bytes of the same file with the same conversion: equal by construction, never
#: compared); ``("fp", n)`` a sampled fingerprint of the values it holds (equal ones are candidates, compared in
#: full); ``("unk",)`` values a source produces on request (candidates, compared in full); ``("own",)`` never shared.
Claim = tuple[Any, ...]


@dataclass(frozen=True)
class Share:
    """How one slot of one rank is held on its node: which ranks hold one copy of it together, who writes it."""

    #: The ranks holding this copy (sorted); ``(rank,)``: a copy of its own.
    members: tuple[int, ...]
    #: The member that writes the copy's bytes (from its own values or from the source); the others map it.
    filler: int
    #: The members other than the filler compare their own values with the copy, every byte, before using it.
    verify: bool


def plan_sharing(node: Sequence[int], slots: Mapping[int, Sequence[tuple[str, Claim, int]]], *,
                 unsafe: bool = False) -> dict[int, list[Share]]:
    """Per rank of ``node``, one :class:`Share` per slot of ``slots[rank]`` (``(signature, claim, nbytes)`` in
    that rank's order); the same answer on every rank.

    Ranks whose slots have one signature (names, dtypes, shapes) are grouped by claim: equal provenance shares
    without comparison, equal fingerprints and source-produced values share after a full comparison. A copy of
    values the ranks already hold is written by its lowest member (a memory copy); reading a source is spread
    over the members, fewest bytes first (each tensor is still read by one rank). ``unsafe`` (tests only): one
    copy per signature, written by the lowest rank, never compared (corrupts ranks whose weights differ).
    """
    index = {r: {sig: i for i, (sig, _, _) in enumerate(slots[r])} for r in node}
    out: dict[int, list[Share | None]] = {r: [None] * len(slots[r]) for r in node}
    load = dict.fromkeys(node, 0)
    for sig in global_order(node, slots):
        holders = [r for r in node if sig in index[r]]
        nbytes = slots[holders[0]][index[holders[0]][sig]][2]
        groups: dict[Any, list[int]] = {}
        for r in holders:
            claim = slots[r][index[r][sig]][1]
            key = ("all",) if unsafe else ("own", r) if claim[0] == "own" else claim
            groups.setdefault(key, []).append(r)
        for key, members in groups.items():
            verify = key[0] in ("fp", "unk") and len(members) > 1
            spread = key[0] in ("tok", "unk")
            filler = min(members, key=lambda m: (load[m], m)) if spread else members[0]
            load[filler] += nbytes
            share = Share(tuple(members), filler, verify)
            for r in members:
                out[r][index[r][sig]] = share
    return {r: [s for s in shares if s is not None] for r, shares in out.items()}


def global_order(node: Sequence[int], slots: Mapping[int, Sequence[tuple[str, Claim, int]]]) -> dict[str, int]:
    """Signature -> position in the node's slot order (first appearance, ranks in order): arenas shared by several
    ranks are laid out in this order, so every member computes the same offsets."""
    order: dict[str, int] = {}
    for r in node:
        for sig, _, _ in slots[r]:
            order.setdefault(sig, len(order))
    return order
