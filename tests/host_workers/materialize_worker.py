"""One rank of a host-materialisation scenario, started by torchrun from tests/host/test_host_distributed.py.

Writes ``<out>/rank<R>.json`` with what the test checks. Scenarios:
``ep``       every rank builds its own experts; EP size from MAGI_EP_SIZE (or --unsafe to force one file)
``shared``   identical weights on every rank (EP 1): one file per node
``mismatch`` EP 1 but different experts: error expected (on_mismatch='error'), then on_mismatch='copy'
``crash``    rank 0 kills itself in the middle of copying (the test then checks the cleanup)
``sparse``   EP 1, every rank equal except one embedding row on rank 1 (64 of 262144 elements: the sampled
             fingerprint cannot see it): error expected (on_mismatch='error'), then on_mismatch='copy'
``write``    EP 1, identical weights: after materialising, rank 0 writes in place into a parameter and a
             buffer (``--shared-writes copy_on_write``: itself; read_only: in forked children, which die)
``tamper``   EP 1, identical weights, but the shared file is rewritten (every byte inverted) after the writer's
             copy, just before rank 1 opens it: error expected, then a clean run with on_mismatch='copy'
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import hashlib
import json
import mmap
import os
import resource
import signal
import stat
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from magi_core import get_backend
from magi_core.compile.exchange import host_identity
from magi_core.host import HostOptions, HostWeights, materialize, memstat, shm
from magi_core.host.memstat import process_memory
from magi_core.plugin.cpu import registered_ranges


class Model(nn.Module):
    """A dense trunk (same on every rank) and an expert shard (rank-specific when ``own_experts``)."""

    def __init__(self, rank: int, own_experts: bool, dense_mb: int, sparse_rank: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        n = int((dense_mb * 2**20 / 4) ** 0.5)
        self.dense = nn.Linear(n, n, bias=True)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(n, n, generator=g))
            self.dense.bias.copy_(torch.randn(n, generator=g))
        eg = torch.Generator().manual_seed(1000 + rank if own_experts else 1000)
        self.experts = nn.Parameter(torch.randn(4, 64, 64, generator=eg).to(torch.bfloat16))
        self.register_buffer("router", torch.randn(64, 4, generator=g))
        self.head = nn.Linear(64, 8)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(8, 64, generator=g))
            self.head.bias.zero_()
        self.tied = self.head  # the same module (and weights) reachable twice
        self.emb = nn.Embedding(4096, 64)  # 262144 elements
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(4096, 64, generator=g))
            if sparse_rank:  # one row of 64 elements differs: no sampled element lies in it
                self.emb.weight[7].add_(1.0)


ARENA_KEYS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty", "Anonymous",
              "ShmemPmdMapped", "FilePmdMapped")


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (all of them)."""
    if t.device.type == "meta":  # no bytes to digest
        return f"meta{tuple(t.shape)}"
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def privatising_backend() -> Any:
    """The CPU backend, except that registering a range writes to each of its pages first (what pinning for
    write does to a copy-on-write mapping under CUDA: every page becomes the process's own)."""
    real = get_backend()

    def register(ptr: int, nbytes: int) -> None:
        pages = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
        pages[:: mmap.PAGESIZE].add_(0)
        real.host_register(ptr, nbytes)

    return dataclasses.replace(real, _register=register)


def tampering_open(real: Callable[..., int]) -> Callable[..., int]:
    """``shm.open_existing`` after another process rewrote the file (every byte inverted) since the writer's copy."""

    def open_existing(path: str, nbytes: int, **kwargs: Any) -> int:
        with open(path, "r+b") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            f.seek(0)
            f.write(data.bitwise_not().numpy().tobytes())
        return real(path, nbytes, **kwargs)

    return open_existing


def _in_child(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child; its wait status as -signal (killed) or its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGSEGV leaves no core file
            fn()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def write_in_place(model: Model, hw: HostWeights, rank: int, mode: str, rec: dict[str, object]) -> None:
    """Rank 0 writes into a parameter and a buffer; every rank records what it sees afterwards."""
    bias_before = model.dense.bias.detach().clone()
    router_before = model.router.detach().clone()

    def add_param() -> None:
        with torch.no_grad():
            model.dense.bias.add_(100)

    def bump_buffer() -> None:
        model.router += 1

    if rank == 0:
        if mode == "copy_on_write":
            add_param()
            bump_buffer()
        else:  # a write to a read-only mapping kills the process: do it in children of this rank
            rec["param_write_child"] = _in_child(add_param)
            rec["buffer_write_child"] = _in_child(bump_buffer)
    dist.barrier()
    rec["bias_delta"] = float((model.dense.bias - bias_before).abs().max())
    rec["router_delta"] = float((model.router - router_before).abs().max())
    # what the exchange identifies the bias's bytes by across ranks (None: never exchanged)
    rec["bias_identity"] = repr(host_identity(hw)(model.dense.bias))
    dist.barrier()


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dense-mb", type=int, default=2)
    ap.add_argument("--unsafe", action="store_true")
    ap.add_argument("--shared-writes", default="copy_on_write")
    ap.add_argument("--verify", default="full", help="HostOptions.verify_shared")
    ap.add_argument("--privatising-pin", action="store_true",
                    help="register the way CUDA does for a private mapping: writing every page (copy-on-write breaks)")
    ap.add_argument("--device", action="store_true", help="use the accelerator (NCCL etc.) instead of gloo")
    args = ap.parse_args()
    if args.device:
        be = get_backend()
        count = be.device_module.device_count()
        index = int(os.environ["LOCAL_RANK"]) % count  # one device: both ranks on it, talking through gloo
        be.device_module.set_device(index)
        args.device_index = index
        if count >= int(os.environ["LOCAL_WORLD_SIZE"]):
            dist.init_process_group(device_id=be.device(index), timeout=datetime.timedelta(seconds=90))
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    shm_dir = os.environ["MAGI_SHM_DIR"]
    own = args.scenario in ("ep", "mismatch")
    model = Model(rank, own, args.dense_mb, sparse_rank=args.scenario == "sparse" and rank == 1)
    rec: dict[str, object] = {"rank": rank, "world": dist.get_world_size()}
    rec["emb_before"] = digest(model.emb.weight)
    rec["experts_before"] = digest(model.experts)
    rec["dense_before"] = digest(model.dense.weight)
    expert_param = model.experts
    seen_modes: list[int] = []

    def on_progress(phase: str, done: int, total: int) -> None:
        for name in os.listdir(shm_dir):
            try:
                seen_modes.append(stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode))
            except FileNotFoundError:  # another rank unlinked its file (mapped) since the listing
                continue
        if args.scenario == "crash" and rank == 0 and phase == "copy":
            os.kill(os.getpid(), signal.SIGKILL)

    opts = HostOptions(_unsafe_share_across_ranks=args.unsafe, progress=False, shared_writes=args.shared_writes,
                       verify_shared=args.verify,
                       on_mismatch="error" if args.scenario in ("mismatch", "sparse") else "copy")
    hw = None
    if args.scenario == "meta" and rank == 0:  # a tensor this rank cannot hold (left on the meta device)
        model.register_buffer("ghost", torch.empty(4, device="meta"))
    if args.scenario in ("mismatch", "sparse", "tamper", "meta"):
        ptr_before = model.experts.data_ptr()
        state_before = {k: digest(v) for k, v in model.state_dict().items()}
        real_open = shm.open_existing
        if args.scenario == "tamper" and rank == 1:
            shm.open_existing = tampering_open(real_open)  # type: ignore[assignment]
        try:
            hw = materialize(model, options=opts, on_progress=on_progress)
            rec["error"] = None
        except Exception as exc:
            rec["error"] = type(exc).__name__
            rec["message"] = str(exc)
        finally:
            shm.open_existing = real_open  # type: ignore[assignment]
        rec["unchanged_after_error"] = (model.experts.data_ptr() == ptr_before
                                        and digest(model.experts) == rec["experts_before"])
        rec["values_unchanged_after_error"] = {k: digest(v) for k, v in model.state_dict().items()} == state_before
        rec["registered_after_error"] = len(registered_ranges())
        dist.barrier()  # every rank has cleaned up before anyone lists the directory
        rec["files_after_error"] = sorted(os.listdir(shm_dir))
        dist.barrier()
        opts = HostOptions(on_mismatch="copy", progress=False)
        if "ghost" in model._buffers:
            del model._buffers["ghost"]
    if hw is None:
        hw = materialize(model, options=opts, on_progress=on_progress,
                         backend=privatising_backend() if args.privatising_pin else None)
    rec["private_copy_bytes"] = hw.report.get("private_copy_bytes")
    rec["identity_kept"] = model.experts is expert_param and model.tied.weight is model.head.weight
    rec["mode"] = hw.report["mode"]
    rec["inodes"] = sorted(f["inode"] for f in hw.report["files"])
    rec["files_unlinked"] = all(not os.path.exists(p) for p in hw.files)
    rec["file_modes"] = sorted(set(seen_modes))
    if args.device:  # the host weights reach the device intact (non_blocking from the pinned mapping)
        dev = torch.device(get_backend().device_type, args.device_index)
        on_dev = model.dense.weight.to(dev, non_blocking=True)
        model.to(dev)
        rec["device_copy_ok"] = bool(torch.equal(on_dev.cpu(), model.dense.weight))
        rec["host_after_to"] = model.dense.weight.device.type == "cpu"
    rec["experts_after"] = digest(model.experts)
    rec["dense_after"] = digest(model.dense.weight)
    rec["emb_after"] = digest(model.emb.weight)
    rec["mappings"] = sorted({str(f.get("mapping")) for f in hw.report["files"]})
    if args.scenario == "write":
        write_in_place(model, hw, rank, args.shared_writes, rec)
    rec["weight_bytes"] = hw.weight_bytes
    rec["pinned_bytes"] = hw.pinned_bytes
    rec["registered"] = len(registered_ranges())
    rec["pin"] = hw.report.get("pin")
    with torch.no_grad():  # touch every page so each rank's share of the mapping is resident
        for p in model.parameters():
            p.float().sum()
    dist.barrier()
    rec["pss_shmem"] = process_memory().get("Pss_Shmem", 0)  # whole process (drivers' mappings too): for logs only
    arena = hw.mapping_memory()  # only the arena mappings: what the sharing tests compare
    rec["arena_pss"], rec["arena_rss"], rec["arena_mappings"] = arena["Pss"], arena["Rss"], arena["mappings"]
    rec["arenas"] = len(hw.mapped_ranges)
    # where the arena's pages are accounted (a kernel may not split a large folio's Pss by its mappers)
    rec["arena_smaps"] = memstat.mapping_memory(hw.mapped_ranges, [a.path for a in hw.arenas if a.path],
                                                keys=ARENA_KEYS)
    rec["meminfo"] = memstat.system_memory(("Shmem", "AnonPages", "ShmemHugePages", "ShmemPmdMapped"))
    rec["thp_shmem"] = _read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    rec["shm_mount"] = [ln for ln in _read_text("/proc/mounts").splitlines() if " /dev/shm " in ln]
    dist.barrier()
    hw.release()
    rec["registered_after_release"] = len(registered_ranges())
    dist.barrier()
    rec["dir_after"] = sorted(os.listdir(shm_dir))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
