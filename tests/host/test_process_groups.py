"""The process groups magi-core makes for itself follow the default group: after ``destroy_process_group`` and a
new ``init_process_group`` (a script that re-initialises, a test suite) they are made again, never reused dead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from magi_core.compile import exchange
from magi_core.host import topology

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(name="single_rank")
def single_rank_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One-rank groups in this process, whatever a test leaves initialised is destroyed afterwards."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend
    monkeypatch.setattr(topology, "_HOST_GROUP", topology.GroupCache())
    monkeypatch.setattr(exchange, "_NODE_GROUPS", topology.GroupCache())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init(backend: str) -> None:
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def test_host_group_is_made_again_for_a_new_default_group(single_rank: None) -> None:
    _init("gloo")
    assert topology._host_group() is None  # a gloo default group already runs on the host
    dist.destroy_process_group()
    _init("fake")  # a default group that is not gloo (as NCCL): a gloo group of its own
    g = topology._host_group()
    assert g is not None and dist.get_backend(g) == "gloo" and topology._host_group() is g
    dist.destroy_process_group()
    assert not topology.group_alive(g)
    _init("fake")
    g2 = topology._host_group()
    assert g2 is not g and topology.group_alive(g2)
    dist.barrier(group=g2)  # usable
    dist.destroy_process_group()
    _init("gloo")
    assert topology._host_group() is None  # not the fake default's gloo group, long gone


def test_exchange_groups_are_made_again_for_a_new_default_group(single_rank: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # node_groups() splits the world into nodes with new_subgroups, which needs more than one rank: here the
    # split is one new gloo group over this rank (the caching around it is what is tested)
    made: list[object] = []

    def subgroups(group_size: int, backend: str | None = None, timeout: object = None) -> tuple[object, list[object]]:
        g = dist.new_group(ranks=[0], backend="gloo")
        made.append(g)
        return g, [g]

    monkeypatch.setattr(exchange, "_node_size", lambda: 1)
    _init("gloo")
    assert exchange.node_groups() is None  # a node of one rank: nothing to exchange
    monkeypatch.setattr(dist, "new_subgroups", subgroups)
    monkeypatch.setattr(exchange, "_node_size", lambda: 2)
    monkeypatch.setattr(exchange.dist, "get_world_size", lambda group=None: 2)
    first = exchange.node_groups()
    assert first is not None and exchange.node_groups() == first and len(made) == 2
    dist.destroy_process_group()
    _init("gloo")
    second = exchange.node_groups()
    assert second is not None and second is not first and len(made) == 4
    assert all(topology.group_alive(g) for g in second) and not any(topology.group_alive(g) for g in first)


def test_destroy_process_group_frees_the_groups_magi_made(single_rank: None) -> None:
    """The caches hold no group: destroy_process_group() frees the default group and magi's own (their worker
    threads stop there, not at interpreter shutdown, where a gloo worker taking the GIL aborts the process)."""
    import gc
    import weakref

    import torch

    _init("fake")
    default = weakref.ref(dist.distributed_c10d._get_default_group())
    host = weakref.ref(topology._host_group())
    with torch.device("meta"):  # a torch._refs op: imports torch._dynamo and torch.distributed.nn.functional
        torch.nn.Embedding(4, 2)
    dist.destroy_process_group()
    gc.collect()
    assert default() is None and host() is None
