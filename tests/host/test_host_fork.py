"""A forked child (os.fork, a multiprocessing or DataLoader worker) never writes into its parent's offloaded
weights: its writable shared arenas are mapped copy-on-write in the child, which keeps working with its own
edits while the parent's weights and outputs stay as they were. Before, the child's ``bias.add_(100)`` moved the
parent's output by 100 (the arena is a MAP_SHARED mapping, shared across fork)."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
from typing import Any

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

import magi_core
from magi_core.compile.exchange import host_identity
from magi_core.host import fork

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layer(x)))


def _child_edits(model: Net) -> dict[str, Any]:
    """What the child does: edit a weight in place and look at what it holds afterwards."""
    before = model.layer.bias.detach().clone()
    with torch.no_grad():
        model.layer.bias.add_(100)
        model.head.weight.mul_(0)
    hw = magi_core.handle(model).host
    return {"bias_delta": float((model.layer.bias - before).min()), "head_zero": not bool(model.head.weight.any()),
            "layer_weight_sum": float(model.layer.weight.sum()),
            "identity": repr(host_identity(hw)(model.layer.bias))}


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_a_forked_childs_write_stays_in_the_child(shm_dir: str) -> None:
    fds = _fd_count()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 8)
    magi_core.offload(model)
    out = model(x)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hw = magi_core.handle(model).host
    assert hw.arenas and all(a.mapping is not None and not a.private for a in hw.arenas)
    assert host_identity(hw)(model.layer.bias) is not None  # the parent's mapping is its own, shared one
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 3
        try:
            os.close(r)
            os.write(w, json.dumps(_child_edits(model)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    child = json.loads(data)
    assert child["bias_delta"] == pytest.approx(100.0) and child["head_zero"], child  # the child sees its writes
    assert child["layer_weight_sum"] == pytest.approx(float(weights["layer.weight"].sum()))  # and reads the rest
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    assert changed == [], f"the child's writes reached the parent's {changed}"
    assert torch.equal(model(x), out)
    assert child["identity"] == "None", child  # private pages: never exchanged as the file's bytes
    magi_core.release(model)
    del model
    torch._dynamo.reset()  # compiled code holds the weights until then
    gc.collect()
    assert hw.unmapped() and fork.fork_tracked() == 0 and _fd_count() == fds  # the kept descriptors are closed too


def _worker(model: Net, queue: Any) -> None:
    queue.put(_child_edits(model))


def test_a_multiprocessing_fork_worker_cannot_change_the_parent(shm_dir: str) -> None:
    """The way DataLoader workers and multiprocessing pools start (the fork start method)."""
    torch.manual_seed(1)
    model = Net().eval()
    magi_core.load(model.to("meta"), lambda name, meta: torch.full(meta.shape, 0.5, dtype=meta.dtype),
                   host_options=magi_core.host.HostOptions(progress=False))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(model, queue))
    proc.start()
    child = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0 and child["bias_delta"] == pytest.approx(100.0) and child["head_zero"]
    assert bool((model.layer.bias == 0.5).all()) and bool((model.head.weight == 0.5).all())
    magi_core.release(model)
