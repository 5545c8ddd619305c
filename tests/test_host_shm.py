"""Shared-memory files: names, exclusive 0600 create, stale cleanup, no room, exit-time release."""

from __future__ import annotations

import json
import mmap
import os
import stat
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from host_workers.common import child_env, shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

from magi_core.host import HostOptions, ShmSpaceError, materialize, shm


def _dead_pid() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = shm.process_start_time(p.pid)
    assert start is not None
    p.kill()
    p.wait()
    return p.pid, start


def test_names_are_job_unique_and_parse_back() -> None:
    a, b = shm.Owner.current(), shm.Owner.current()
    na, nb = shm.file_name(a, "node0-float32"), shm.file_name(b, "node0-float32")
    assert na != nb and str(os.getpid()) in na and na.startswith(f"magi-u{os.getuid()}-")
    fields = shm.parse_name(na)
    assert fields is not None and int(fields["pid"]) == os.getpid() and fields["tag"] == "node0-float32"
    assert shm.parse_name("magi-Linear.bin") is None
    with pytest.raises(ValueError):
        shm.file_name(a, "../etc")


def test_create_is_exclusive_0600_and_reserves_space(shm_dir: str) -> None:
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "t"))
    old = os.umask(0)
    try:
        fd = shm.create(path, 3 * 4096)
    finally:
        os.umask(old)
    try:
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 3 * 4096
        assert st.st_blocks * 512 >= 3 * 4096  # allocated up front, not sparse
        with pytest.raises(FileExistsError):
            shm.create(path, 4096)
        assert os.path.exists(path)  # the failed second create did not remove the first file
    finally:
        os.close(fd)
        shm.unlink(path)


def test_cleanup_removes_only_dead_owners(shm_dir: str) -> None:
    pid, start = _dead_pid()
    dead = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "job", "aa"), "node0-float32"))
    me = shm.Owner.current()
    live = os.path.join(shm_dir, shm.file_name(me, "node0-float32"))
    reused = os.path.join(shm_dir, shm.file_name(shm.Owner(os.getpid(), me.start + 1, "job", "bb"), "x"))
    other_user = os.path.join(shm_dir, f"magi-u{os.getuid() + 1}-p{pid}.{start}-job-cc-x.bin")
    unrelated = os.path.join(shm_dir, "something-else.bin")
    for p in (dead, live, reused, other_user, unrelated):
        open(p, "wb").close()
    removed = shm.cleanup_stale(shm_dir)
    assert sorted(removed) == sorted([dead, reused])  # a recycled pid with another start time is dead too
    assert sorted(os.listdir(shm_dir)) == sorted(os.path.basename(p) for p in (live, other_user, unrelated))
    for p in (live, other_user, unrelated):
        os.unlink(p)


def _model_state(m: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {k: (v.data_ptr(), v.clone()) for k, v in m.state_dict().items()}


@pytest.fixture
def tiny_tmpfs() -> str:
    """A real 1 MiB tmpfs (needs permission to mount; skipped otherwise)."""
    path = os.path.join("/tmp", f"magi-tiny-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", path],
                        capture_output=True).returncode if os.geteuid() == 0 else 1
    if rc != 0:
        os.rmdir(path)
        pytest.skip("cannot mount a tmpfs here (the RLIMIT_FSIZE test covers the error path)")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=True)
        os.rmdir(path)


def test_no_room_in_small_tmpfs_leaves_model_unchanged(tiny_tmpfs: str) -> None:
    m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 MiB > 1 MiB
    before = _model_state(m)
    with pytest.raises(ShmSpaceError) as info:
        materialize(m, options=HostOptions(shm_dir=tiny_tmpfs, progress=False))
    err = info.value
    assert err.needed >= 2 * 512 * 513 * 4 and err.available <= 1 << 20
    assert str(err.needed) in str(err) and str(err.available) in str(err) and "MAGI_SKIP_SHM" in str(err)
    assert os.listdir(tiny_tmpfs) == []
    after = _model_state(m)
    assert all(after[k][0] == p and torch.equal(after[k][1], t) for k, (p, t) in before.items())
    with materialize(nn.Linear(8, 8), options=HostOptions(shm_dir=tiny_tmpfs, progress=False)) as hw:
        assert hw.weight_bytes > 0  # a model that fits works in the same directory
    assert os.listdir(tiny_tmpfs) == []


_FSIZE_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    import torch
    from torch import nn
    from magi_core.host import HostOptions, ShmSpaceError, materialize
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # a real limit; Python ignores SIGXFSZ
    m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    before = {k: (v.data_ptr(), v.clone()) for k, v in m.state_dict().items()}
    out = {}
    try:
        materialize(m, options=HostOptions(progress=False))
        out["error"] = None
    except ShmSpaceError as exc:
        out.update(error=type(exc).__name__, message=str(exc), needed=exc.needed)
    out["unchanged"] = all(v.data_ptr() == before[k][0] and torch.equal(v, before[k][1])
                           for k, v in m.state_dict().items())
    out["left"] = os.listdir(os.environ["MAGI_SHM_DIR"])
    print(json.dumps(out))
""")


def test_no_room_file_size_limit_clear_error_no_partial_file(shm_dir: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT], env=child_env(shm_dir), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "ShmSpaceError", out
    assert "bytes needed" in out["message"] and "File too large" in out["message"]
    assert out["unchanged"] and out["left"] == []


_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, json, os
    results = {}
    def check():  # registered first, so it runs after magi-core's own exit handler
        from magi_core.plugin.cpu import registered_ranges
        results["registered_at_exit"] = len(registered_ranges())
        print(json.dumps(results), flush=True)
    atexit.register(check)
    from torch import nn
    from magi_core.plugin.cpu import registered_ranges
    from magi_core.host import HostOptions, materialize
    m = nn.Linear(64, 64)
    hw = materialize(m, options=HostOptions(progress=False))
    results["registered_before_exit"] = len(registered_ranges())
""")


def test_process_exit_unregisters_everything(shm_dir: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=child_env(shm_dir), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["registered_before_exit"] == 1 and out["registered_at_exit"] == 0



@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_mapping_memory_counts_only_the_arena(shm_dir: str) -> None:
    """The sharing tests' measure: the arena mapping alone, found by address or by its unlinked file."""
    from magi_core.host.memstat import mapping_memory

    m = nn.Linear(512, 512)  # ~1 MiB of fp32
    with materialize(m, options=HostOptions(progress=False)) as hw:
        m.weight.sum()
        (path,) = hw.files
        ((_, nbytes),) = hw.mapped_ranges
        alone = hw.mapping_memory()
        assert alone["mappings"] == 1 and alone["Size"] == nbytes
        assert alone["Rss"] == alone["Pss"] == nbytes  # every page touched, mapped by us only
        assert not os.path.exists(path) and mapping_memory([], [path]) == alone
        assert mapping_memory([(0, 4096)]) == {"Size": 0, "Rss": 0, "Pss": 0, "mappings": 0}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_mapping_memory_splits_pages_shared_with_another_process(shm_dir: str) -> None:
    from magi_core.host.memstat import mapping_memory

    nbytes = 64 * mmap.PAGESIZE
    path = os.path.join(shm_dir, "pss-probe.bin")
    fd = shm.create(path, nbytes)
    mm = shm.map_fd(fd, nbytes)
    os.close(fd)
    mm[:] = b"\1" * nbytes
    ptr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    script = textwrap.dedent(f"""
        import mmap, os, sys
        fd = os.open({path!r}, os.O_RDONLY)
        mm = mmap.mmap(fd, {nbytes}, prot=mmap.PROT_READ)
        sum(mm[i] for i in range(0, {nbytes}, mmap.PAGESIZE))
        print("mapped", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        shm.unlink(path)
        shared = mapping_memory([(ptr, nbytes)])
        assert mapping_memory([], [path]) == shared
    finally:
        child.communicate("")
        shm.unlink(path)
    alone = mapping_memory([(ptr, nbytes)])
    del mm
    assert shared == {"Size": nbytes, "Rss": nbytes, "Pss": nbytes // 2, "mappings": 1}
    assert alone == {"Size": nbytes, "Rss": nbytes, "Pss": nbytes, "mappings": 1}
