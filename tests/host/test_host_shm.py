"""Shared-memory files: names, exclusive 0600 create, stale cleanup, no room, exit-time release."""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import stat
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from host_workers.common import child_env, shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

from magi_core.errors import ConfigError
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


def test_reader_opens_only_the_writers_regular_0600_file_of_the_planned_size(
    shm_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what a reader rank checks before mapping the file another rank created (shm.open_existing)
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "t"))
    fd = shm.create(path, 8192)
    try:
        os.close(shm.open_existing(path, 8192))  # the writer's file as created: accepted
        with pytest.raises(PermissionError, match="expected a regular 0600 file"):
            shm.open_existing(path, 4096)  # not the planned size
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match=r"mode 0o644"):
            shm.open_existing(path, 8192)  # readable by others: not the file the writer made
        os.chmod(path, 0o600)
        with monkeypatch.context() as m:  # owned by another uid (posing as the next uid: no root needed)
            m.setattr(shm.os, "getuid", lambda: os.stat(path).st_uid + 1)
            with pytest.raises(PermissionError, match="found uid"):
                shm.open_existing(path, 8192)
        link = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "link"))
        target = tmp_path / "elsewhere.bin"
        target.write_bytes(b"\0" * 8192)
        os.symlink(target, link)
        try:
            with pytest.raises(OSError) as info:
                shm.open_existing(link, 8192)  # never followed
            assert info.value.errno == errno.ELOOP
        finally:
            os.unlink(link)
    finally:
        os.close(fd)
        shm.unlink(path)


def test_reader_refuses_a_fifo_in_place_of_the_file_at_once(shm_dir: str) -> None:
    """A FIFO put where the writer's file should be: refused at once, not a reader waiting for a writer forever."""
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "fifo"))
    os.mkfifo(path, 0o600)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            os.close(shm.open_existing(path, 8192))
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    try:
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(5)
        blocked = t.is_alive()
        if blocked:  # a writer opens and closes the FIFO: the reader gets end-of-file
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
        assert not blocked, "the reader waited on a FIFO"
        assert isinstance(outcome[0], PermissionError) and "expected a regular 0600 file" in str(outcome[0])
    finally:
        os.unlink(path)


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


_TAKEN_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from magi_core.host import CallableSource, HostOptions, ShmSpaceError, materialize
    shm_dir, how = sys.argv[1], sys.argv[2]
    def build():
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])  # 8 x 66 KB of 1 MiB
    taken = []
    lock = threading.Lock()  # a second loading thread waits until the room is gone (else it may allocate first)
    def take_the_rest(*_):  # another process fills the filesystem while we write
        with lock:
            if not taken:
                taken.append(os.path.join(shm_dir, "someone-else"))
                fd = os.open(taken[0], os.O_WRONLY | os.O_CREAT)
                try:
                    while os.write(fd, bytes(4096)):
                        pass
                except OSError:
                    pass
                os.close(fd)
    out = {}
    try:
        if how == "model":  # copied from the model's tensors, one thread, through the file
            m = build()
            before = {k: v.clone() for k, v in m.state_dict().items()}
            materialize(m, options=HostOptions(shm_dir=shm_dir, progress=False), on_progress=take_the_rest)
        else:
            ref = build()
            with torch.device("meta"):
                m = build()
            if how == "files":  # one thread, through the file (sendfile)
                path = os.path.join(sys.argv[3], "w.safetensors")
                save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
                source, opts, hook = path, HostOptions(shm_dir=shm_dir, progress=False, load_threads=1), take_the_rest
            elif how.startswith("files_threads"):  # two threads reading straight into the mapping, no page
                from magi_core.host.loading import sources  # allocated first; or converting (allocated first)
                path = os.path.join(sys.argv[3], "w.safetensors")
                save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
                if how == "files_threads_convert":
                    m = m.to(torch.bfloat16)
                real = sources.SafetensorsSource.read_into
                def read_into(self, *a, **k):
                    take_the_rest()
                    return real(self, *a, **k)
                sources.SafetensorsSource.read_into = read_into
                source, opts, hook = path, HostOptions(shm_dir=shm_dir, progress=False, load_threads=2), None
            else:  # a function: "threads" from two threads through the mapping, "function" one (pwrite)
                def fn(name, meta):
                    take_the_rest()
                    return ref.state_dict()[name]
                source = CallableSource(fn, thread_safe=how == "threads")
                opts, hook = HostOptions(shm_dir=shm_dir, progress=False, load_threads=2), None
            materialize(m, options=opts, on_progress=hook, source=source)
        out["error"] = None
    except ShmSpaceError as exc:
        out.update(error=type(exc).__name__, message=str(exc))
    if how == "model":
        out["unchanged"] = all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    else:
        out["unchanged"] = all(p.device.type == "meta" for p in m.parameters())
    out["left"] = sorted(os.listdir(shm_dir))
    print(json.dumps(out))
""")


@pytest.mark.parametrize("how", ["model", "files", "files_threads", "files_threads_convert", "function", "threads"])
def test_space_taken_while_filling_is_a_clear_error_not_sigbus(tiny_tmpfs: str, tmp_path: Path, how: str) -> None:
    """Files are created sparse where the kernel can allocate a range with an error instead of SIGBUS: another
    process taking the room between the check and the writes gives ShmSpaceError, the model as it was and no
    file of ours left (a model's tensors copied, a file or a function read by one thread through the file, a
    file read by two threads straight into the mapping (the read fails, EFAULT) or converted there (allocated
    first), a function called by two threads writing through the mapping)."""
    if not shm.can_populate():
        pytest.skip("the kernel reserves whole files up front here (no MADV_POPULATE_WRITE)")
    proc = subprocess.run([sys.executable, "-c", _TAKEN_SCRIPT, tiny_tmpfs, how, str(tmp_path)],
                          env=child_env(tiny_tmpfs), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -7 would be SIGBUS
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "ShmSpaceError" and "while filling" in out["message"], out
    if how.startswith("files_threads"):  # pages allocated by the read itself, unless converted (stored through)
        assert ("a read found no room" in out["message"]) == (how == "files_threads"), out
    assert out["unchanged"] and out["left"] == ["someone-else"], out


def test_sparse_file_allocates_what_is_written(shm_dir: str) -> None:
    """A file created without reserving holds no pages until a range is allocated, through the fd or a mapping."""
    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "sparse"))
    fd = shm.create(path, 64 * 4096, reserve=False)
    try:
        assert os.fstat(fd).st_size == 64 * 4096 and os.fstat(fd).st_blocks == 0
        shm.allocate(shm_dir, 8 * 4096, fd=fd, offset=0)
        assert os.fstat(fd).st_blocks * 512 == 8 * 4096
        if shm.can_populate():
            mm = shm.map_fd(fd, 64 * 4096)
            first = torch.frombuffer(mm, dtype=torch.uint8)
            shm.allocate(shm_dir, 4096 + 1, ptr=first.data_ptr() + 32 * 4096 - 1)  # two pages, unaligned
            assert os.fstat(fd).st_blocks * 512 == 8 * 4096 + 2 * 4096
            assert int(first[31 * 4096:33 * 4096].sum()) == 0
            del first
            mm.close()
    finally:
        os.close(fd)
        shm.unlink(path)


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


# -- liveness across PID namespaces: the owner's lock, not its pid ---------------------------------------------
_HOLDER = textwrap.dedent("""
    import sys
    from magi_core.host import shm
    fd = shm.create(sys.argv[1], 4096)  # locked for as long as it is open, as a writer holds it
    print("ready", flush=True)
    sys.stdin.read()
""")


def _holder(path: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, path], env=child_env(os.path.dirname(path)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_cleanup_keeps_a_live_file_whose_owner_pid_is_not_visible(shm_dir: str) -> None:
    """A job in another PID namespace: the pid in the name means nothing here (simulated with a dead pid), but
    its owner still holds the lock, so the file stays; once the owner is gone it is removed."""
    pid, start = _dead_pid()
    path = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "otherns", "dd"), "node0-float32"))
    holder = _holder(path)
    try:
        assert shm.cleanup_stale(shm_dir) == [] and os.path.exists(path)
        with materialize(nn.Linear(4, 4), options=HostOptions(progress=False)) as hw:
            assert hw.report["stale_removed"] == []
        assert os.path.exists(path)
    finally:
        holder.communicate("")
    assert shm.cleanup_stale(shm_dir) == [path] and os.listdir(shm_dir) == []


_WRITER = textwrap.dedent("""
    import os, sys
    from magi_core.host import shm
    path = os.path.join(sys.argv[1], shm.file_name(shm.Owner.current(), "node0-float32"))
    fd = shm.create(path, 1 << 20)
    os.pwrite(fd, b"x" * 4096, 0)  # half written
    print(path, flush=True)
    sys.stdin.read()
""")


def test_file_of_a_writer_killed_mid_write_is_removed_by_the_next_run(shm_dir: str) -> None:
    """kill -9 while a file is being written (created, locked, partly filled): the kernel drops the lock and
    the next run removes the file."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, shm_dir], env=child_env(shm_dir), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    path = proc.stdout.readline().strip()
    assert os.path.exists(path) and shm.cleanup_stale(shm_dir) == []  # alive: kept
    proc.kill()
    proc.wait()
    assert os.listdir(shm_dir) == [os.path.basename(path)]
    with materialize(nn.Linear(4, 4), options=HostOptions(progress=False)) as hw:
        assert hw.report["stale_removed"] == [path]
    assert os.listdir(shm_dir) == []


def test_cleanup_never_touches_symlinks_fifos_or_other_users_files(shm_dir: str, tmp_path: Path) -> None:
    pid, start = _dead_pid()
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep")
    link = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "job", "aa"), "node0-float32"))
    os.symlink(target, link)
    fifo = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "job", "bb"), "node0-float32"))
    os.mkfifo(fifo, 0o600)
    kept = [link, fifo]
    if os.geteuid() == 0:  # a file named with our uid but owned by someone else
        other = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "job", "cc"), "node0-float32"))
        open(other, "wb").close()
        os.chown(other, 12345, 12345)
        kept.append(other)
    try:
        assert shm.cleanup_stale(shm_dir) == []
        assert all(os.path.lexists(p) for p in kept) and target.read_bytes() == b"keep"
    finally:
        for p in kept:
            os.unlink(p)


def test_cleanup_keeps_a_file_named_like_ours_but_owned_by_another_uid(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same check as above without root (no file can be given away): this process poses as the next uid, so a
    # dead owner's file named with that uid is owned by someone else
    pid, start = _dead_pid()
    me = os.getuid()
    monkeypatch.setattr(shm.os, "getuid", lambda: me + 1)
    path = os.path.join(shm_dir, shm.file_name(shm.Owner(pid, start, "job", "aa"), "node0-float32"))
    open(path, "wb").close()
    try:
        assert os.path.basename(path).startswith(f"magi-u{me + 1}-") and os.stat(path).st_uid == me
        assert shm.cleanup_stale(shm_dir) == [] and os.path.exists(path)
    finally:
        os.unlink(path)


def test_create_locks_until_closed(shm_dir: str) -> None:
    import fcntl

    path = os.path.join(shm_dir, shm.file_name(shm.Owner.current(), "t"))
    fd = shm.create(path, 4096)
    probe = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shm.unlink(path)
        os.close(fd)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the owner's fd
    finally:
        os.close(probe)


# -- the shm directory: checked before any file is created -------------------------------------------------------
def _mount_tmpfs(options: str) -> str | None:
    path = os.path.join("/tmp", f"magi-mnt-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                                           capture_output=True).returncode != 0:
        os.rmdir(path)
        return None
    return path


def _umount(path: str) -> None:
    subprocess.run(["umount", path], check=True)
    os.rmdir(path)


def test_missing_shm_dir_is_a_config_error_and_is_not_created(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    m = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="does not exist") as info:
        materialize(m, options=HostOptions(shm_dir=missing, progress=False))
    assert "MAGI_SHM_DIR" in str(info.value) and not os.path.exists(missing)
    assert isinstance(m.weight, nn.Parameter) and m.weight.numel() == 16


def test_shm_dir_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        materialize(nn.Linear(4, 4), options=HostOptions(shm_dir=str(f), progress=False))


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[str]:
    """A read-only tmpfs mount (root), else a directory without write permission (non-root)."""
    mnt = _mount_tmpfs("ro,size=1m")
    if mnt is not None:
        try:
            yield mnt
        finally:
            _umount(mnt)
        return
    if os.geteuid() == 0:
        pytest.skip("root cannot mount here, and permissions do not stop root")
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        yield str(d)
    finally:
        d.chmod(0o700)


def test_read_only_shm_dir_is_a_config_error(readonly_dir: str) -> None:
    m = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="read-only|not writable") as info:
        materialize(m, options=HostOptions(shm_dir=readonly_dir, progress=False))
    assert "MAGI_SHM_DIR" in str(info.value) and os.listdir(readonly_dir) == []


def test_disk_shm_dir_works_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kind = shm.fs_type(str(tmp_path))
    if kind is None or kind in shm.MEMORY_FS:
        pytest.skip(f"{tmp_path} is not on a disk filesystem here ({kind})")
    m = nn.Linear(8, 8)
    ref = m.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="magi_core.host.shm"):
        with materialize(m, options=HostOptions(shm_dir=str(tmp_path), progress=False)) as hw:
            assert torch.equal(m.weight, ref) and hw.report["shm_fs"] == kind
    assert any("not in memory" in r.getMessage() and "MAGI_SHM_DIR" in r.getMessage() for r in caplog.records)
    assert os.listdir(tmp_path) == []


def test_memory_filesystems_are_recognised(shm_dir: str) -> None:
    assert shm.fs_type(shm_dir) in shm.MEMORY_FS


def test_no_free_inodes_is_a_space_error(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """statvfs says no inode is left: ShmSpaceError before anything is created; ENOSPC from the create itself
    (the filesystem ran out between the check and the create) is the same error."""
    m = nn.Linear(4, 4)
    with monkeypatch.context() as mp:
        mp.setattr(shm, "free_inodes", lambda d: 0)
        with pytest.raises(ShmSpaceError, match="inode") as info:
            materialize(m, options=HostOptions(progress=False))
    assert info.value.inodes and "nr_inodes" in str(info.value) and os.listdir(shm_dir) == []
    real_open = os.open

    def full(path: str, flags: int, *args: int) -> int:
        if str(path).startswith(shm_dir) and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args)

    with monkeypatch.context() as mp:
        mp.setattr(os, "open", full)
        with pytest.raises(ShmSpaceError, match="inode"):
            materialize(m, options=HostOptions(progress=False))
    assert os.listdir(shm_dir) == [] and m.weight.numel() == 16


def test_no_free_inodes_in_a_real_tmpfs() -> None:
    mnt = _mount_tmpfs("size=4m,nr_inodes=4,mode=0700")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (the monkeypatched test covers the error paths)")
    try:
        for i in range(16):  # use up every inode
            try:
                open(os.path.join(mnt, f"filler-{i}"), "wb").close()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        fillers = sorted(os.listdir(mnt))
        with pytest.raises(ShmSpaceError, match="inode"):
            materialize(nn.Linear(4, 4), options=HostOptions(shm_dir=mnt, progress=False))
        with pytest.raises(ShmSpaceError, match="inode"):  # the create itself: ENOSPC
            shm.create(os.path.join(mnt, shm.file_name(shm.Owner.current(), "t")), 4096)
        assert sorted(os.listdir(mnt)) == fillers
    finally:
        _umount(mnt)
