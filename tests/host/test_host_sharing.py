"""Sharing across ranks, single-process parts: the byte comparison, the options, read-only protection, and the
verification-cost benchmark at a tiny size (the multi-rank behaviour is in test_host_distributed.py)."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from host_workers.common import child_env, shm_dir_fixture  # noqa: F401  (fixture)

from magi_core.errors import ConfigError
from magi_core.host import HostOptions, shm
from magi_core.host.arena import fingerprint, same_bytes

ROOT = Path(__file__).resolve().parents[2]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def test_same_bytes_is_bitwise() -> None:
    a = torch.randn(262144)
    b = a.clone()
    assert same_bytes(_u8(a), _u8(b))
    b[448] = torch.nextafter(b[448], torch.tensor(float("inf")))  # one ulp in one element
    assert not same_bytes(_u8(a), _u8(b))
    nan = torch.tensor([float("nan")])
    assert same_bytes(_u8(nan), _u8(nan.clone()))  # equal bits count as equal (torch.equal says False)
    assert not same_bytes(_u8(torch.tensor([0.0])), _u8(torch.tensor([-0.0])))  # torch.equal says True
    assert not same_bytes(_u8(a), _u8(a[:-1]))
    strided = torch.arange(40, dtype=torch.uint8)[::2]
    assert same_bytes(strided, strided.clone()) and same_bytes(strided[:0], strided[:0])


def test_fingerprint_sees_value_dtype_and_shape() -> None:
    # the sampled pre-check ranks agree on before sharing a file: equal tensors agree, and a change of a sampled
    # value (the first and the last element are always sampled), of the dtype or of the shape does not
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    fp = fingerprint(t, 8)
    assert fingerprint(t.clone(), 8) == fp and fingerprint(t.t().contiguous().t(), 8) == fp  # strides do not count
    for changed in (0, -1):
        u = t.clone()
        u.view(-1)[changed] += 1
        assert fingerprint(u, 8) != fp, f"element {changed} is sampled"
    assert fingerprint(t.view(torch.int32), 8) != fp  # the same bytes read as another dtype
    assert fingerprint(t.reshape(4, 16), 8) != fp and fingerprint(t.reshape(64), 8) != fp
    assert fingerprint(torch.tensor(1.0), 8) != fingerprint(torch.tensor(2.0), 8)  # 0-dim
    assert fingerprint(torch.empty(0, 8), 8) != fingerprint(torch.empty(8, 0), 8)  # no elements: the shape decides


def test_sharing_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="verify_shared"):
        HostOptions(verify_shared="none").resolve()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="shared_writes"):
        HostOptions(shared_writes="shared").resolve()  # type: ignore[arg-type]
    opts = HostOptions().resolve()
    assert opts.verify_shared == "full" and opts.shared_writes == "read_only"


_PROTECT = textwrap.dedent("""
    import os, resource, sys
    import torch
    from magi_core.host import shm
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    path = os.path.join(sys.argv[1], shm.file_name(shm.Owner.current(), "t"))
    fd = shm.create(path, 4096)
    mm = shm.map_fd(fd, 4096)
    shm.unlink(path)
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.float32)
    t.fill_(1.0)
    shm.protect(t.data_ptr(), 4096, writable=False)
    print(float(t.sum()), flush=True)  # reading works
    t.add_(1)  # a write is a SIGSEGV
    print("not reached", flush=True)
""")


def test_protected_mapping_reads_and_a_write_kills_the_process(shm_dir: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _PROTECT, shm_dir], env=child_env(shm_dir), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1024.0"]


def test_protect_can_make_it_writable_again(shm_dir: str) -> None:
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "t"))
    fd = shm.create(path, mmap.PAGESIZE)
    mm = shm.map_fd(fd, mmap.PAGESIZE)
    shm.unlink(path)
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    shm.protect(t.data_ptr(), mmap.PAGESIZE, writable=False)
    shm.protect(t.data_ptr(), mmap.PAGESIZE, writable=True)
    t.fill_(3)
    assert int(t.sum()) == 3 * mmap.PAGESIZE
    with pytest.raises(OSError):
        shm.protect(t.data_ptr() + 1, mmap.PAGESIZE, writable=False)  # not page aligned: EINVAL
    del t


def test_private_mapping_keeps_writes_to_this_process(shm_dir: str) -> None:
    """copy_on_write: a write changes this mapping only, never the file (what other ranks map)."""
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "t"))
    fd = shm.create(path, mmap.PAGESIZE)
    try:
        shared = torch.frombuffer(shm.map_fd(fd, mmap.PAGESIZE), dtype=torch.uint8)
        shared.fill_(1)
        private = torch.frombuffer(shm.map_fd(fd, mmap.PAGESIZE, private=True), dtype=torch.uint8)
        assert int(private[0]) == 1
        private.add_(5)
        assert int(private[0]) == 6 and int(shared[0]) == 1
        shared[1] = 9  # an untouched private page would see this; ours is already this process's own
        assert int(private[1]) == 6
    finally:
        shm.unlink(path)
        os.close(fd)


def test_verify_cost_benchmark_writes_its_figures(tmp_path: Path, shm_dir: str) -> None:
    out = tmp_path / "share_verify.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "share_verify_cost.py"), "--mb", "4",
                           "--model-mb", "2", "--repeats", "1", "--shm-dir", shm_dir, "--out", str(out)],
                          env=child_env(shm_dir), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["date"] and doc["hardware"]["cpu"] and doc["files_left"] == []
    assert all(r["gb_per_s_median"] > 0 for r in doc["compare"])
    e2e = doc["end_to_end"]
    assert e2e["mode"] == "shared" and e2e["reader_verify_gb_per_s"] > 0


def test_plan_sharing_groups_by_claim_and_spreads_reading() -> None:
    """Which ranks hold one copy of each tensor together, who writes it, who must compare (the same answer on every
    rank): equal provenance shares without comparing, reading spread over the ranks; equal fingerprints share after
    comparing, written by the lowest member; different fingerprints or 'own' never share; a tensor one rank lacks
    is shared by the others."""
    from magi_core.host.topology import Share, plan_sharing

    node = (0, 1, 2, 3)
    slots = {r: [("tok", ("tok", "file-a"), 100), ("tok2", ("tok", "file-b"), 100),
                 ("fp", ("fp", r % 2), 10), ("own", ("own",), 10), ("unk", ("unk",), 50)] for r in node}
    slots[3] = [s for s in slots[3] if s[0] != "tok2"]  # rank 3's model has no such tensor
    shares = plan_sharing(node, slots)
    by = {r: dict(zip([s[0] for s in slots[r]], shares[r], strict=True)) for r in node}
    assert {by[r]["tok"] for r in node} == {Share(node, 0, False)}
    assert {by[r]["tok2"] for r in (0, 1, 2)} == {Share((0, 1, 2), 1, False)}  # rank 0 already reads 100 bytes
    assert by[0]["fp"] == by[2]["fp"] == Share((0, 2), 0, True) and by[1]["fp"] == by[3]["fp"] == Share((1, 3), 1, True)
    assert [by[r]["own"] for r in node] == [Share((r,), r, False) for r in node]
    assert {by[r]["unk"] for r in node} == {Share(node, 2, True)}  # the rank with the fewest bytes to write so far
    unsafe = plan_sharing(node, slots, unsafe=True)
    assert all(sh.members in (node, (0, 1, 2)) and sh.filler == 0 and not sh.verify for r in node for sh in unsafe[r])
