"""Pinning that overlaps filling: pieces registered only once written, never through a tensor, undone on failure."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from magi_core import get_backend
from magi_core.host import HostOptions, materialize, pinning
from magi_core.host.arena import PAGE
from magi_core.plugin.cpu import registered_ranges

OPTS = HostOptions(progress=False)


@pytest.fixture(name="arena")
def arena_fixture() -> Iterator[tuple[int, mmap.mmap]]:
    """Twelve anonymous pages (page-aligned, like an arena's mapping)."""
    mm = mmap.mmap(-1, 12 * PAGE)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        yield ctypes.addressof(anchor), mm
    finally:
        del anchor
        mm.close()


def test_cut_after_moves_past_tensors_to_a_page() -> None:
    ext = [(0, 100), (100, PAGE + 10), (PAGE + 10, 3 * PAGE + 5)]
    assert pinning.cut_after(1, ext) == 4 * PAGE  # inside the second tensor, then the third: past both
    assert pinning.cut_after(4 * PAGE, ext) == 4 * PAGE
    assert pinning.cut_after(0, ext) == 0


@given(st.lists(st.tuples(st.integers(0, 3 * PAGE), st.integers(1, 3 * PAGE)), max_size=12),
       st.integers(0, 40 * PAGE))
def test_cut_after_is_the_first_page_no_tensor_straddles(parts: list[tuple[int, int]], n: int) -> None:
    ext, pos = [], 0
    for gap, size in parts:  # sorted, not overlapping, like an arena's slots
        ext.append((pos + gap, pos + gap + size))
        pos += gap + size
    cut = pinning.cut_after(n, ext)

    def clean(c: int) -> bool:
        return c % PAGE == 0 and not any(s < c < e for s, e in ext)

    assert cut >= n and clean(cut)
    assert not any(clean(c) for c in range(-(-n // PAGE) * PAGE, cut, PAGE))


def test_pieces_are_registered_only_once_every_tensor_in_them_is_written(arena: tuple[int, mmap.mmap]) -> None:
    """Regions written out of order: each registration covers written regions only, no region is split between
    two registrations, and together they cover the arena once, from its start."""
    ptr, _ = arena
    n = 12 * PAGE
    ext = [(0, PAGE // 2), (PAGE // 2, 2 * PAGE + 7), (2 * PAGE + 64, 5 * PAGE), (5 * PAGE, 5 * PAGE + 1),
           (6 * PAGE, 9 * PAGE + 300), (9 * PAGE + 512, n)]
    written: set[int] = set()
    calls: list[tuple[int, int, set[int]]] = []
    real = get_backend()

    def register(p: int, nbytes: int) -> None:
        calls.append((p - ptr, nbytes, set(written)))
        real.host_register(p, nbytes)

    be = dataclasses.replace(real, _register=register)
    ahead = pinning.PinAhead(be, [(ptr, n, ext)], group=PAGE)
    try:
        for start, _ in [ext[2], ext[0], ext[4], ext[1], ext[5], ext[3]]:
            written.add(start)  # before the pinner may see it
            ahead.written(ptr, start)
        ranges = ahead.finish()
        assert ahead.pinned_upto(ptr) == n and ahead.error is None
        assert sorted(ranges) == sorted((ptr + lo, k) for lo, k, _ in calls)
        cursor = 0
        for lo, k, seen in calls:
            assert lo == cursor and lo % PAGE == 0
            cursor += k
            for start, end in ext:
                if start < lo + k and end > lo:
                    assert start in seen, f"region at {start} registered before it was written"
                    assert lo <= start and end <= lo + k, f"region {start}..{end} split at a piece boundary"
        assert cursor == n
        assert len(calls) > 1
    finally:
        pinning.unpin_ranges(real, ahead.ranges)
    assert registered_ranges() == {}


def test_finish_leaves_unwritten_rest_and_abort_unregisters(arena: tuple[int, mmap.mmap]) -> None:
    ptr, _ = arena
    n = 12 * PAGE
    ext = [(0, 2 * PAGE), (2 * PAGE, 4 * PAGE), (4 * PAGE, n)]
    be = get_backend()
    ahead = pinning.PinAhead(be, [(ptr, n, ext)], group=PAGE)
    ahead.written(ptr, 0)
    ahead.written(ptr, 4 * PAGE)  # written, but after a region that is not: must wait
    ranges = ahead.finish()
    assert ranges == [(ptr, 2 * PAGE)] and ahead.pinned_upto(ptr) == 2 * PAGE
    assert registered_ranges() == {ptr: 2 * PAGE}
    assert ahead.abort() == [] and registered_ranges() == {} and ahead.pinned_upto(ptr) == 0


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(96, 96 + 8 * i) for i in range(6)], nn.LayerNorm(136).half())


@pytest.mark.parametrize("how", ["model", "files", "threads"])
def test_materialize_pins_while_filling_what_it_holds_alone(shm_dir: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """In small pieces (a model's tensors copied; a checkpoint read by one thread and by four): every byte a
    piece holds at its registration is the value it keeps, every tensor lies in one registration, and all of
    it was pinned while filling, then unregistered on release."""
    monkeypatch.setattr(pinning, "AHEAD_GROUP", PAGE)
    real = get_backend()
    seen: list[tuple[int, bytes]] = []

    def register(p: int, nbytes: int) -> None:
        seen.append((p, ctypes.string_at(p, nbytes)))
        real.host_register(p, nbytes)

    be = dataclasses.replace(real, _register=register)
    ref = _net()
    if how == "model":
        m, source, opts = ref, None, OPTS
        want = {k: v.clone() for k, v in ref.state_dict().items()}
    else:
        want = {k: v.clone() for k, v in ref.state_dict().items()}
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in want.items()}, str(path))
        with torch.device("meta"):
            m = _net()
        source, opts = str(path), HostOptions(progress=False, load_threads=1 if how == "files" else 4)
    with materialize(m, options=opts, backend=be, source=source) as hw:
        for k, v in m.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert len(seen) > 2
        for p, data in seen:
            assert ctypes.string_at(p, len(data)) == data, "a piece was registered before its bytes were written"
        assert hw.report["pin"]["ahead_bytes"] == hw.pinned_bytes == sum(a.nbytes for a in hw.arenas)
        assert sorted(registered_ranges().items()) == sorted(hw.pinned_ranges)
        assert all(hw.is_pinned(t) for t in m.state_dict().values())
    assert registered_ranges() == {}


def test_a_budget_pins_in_order_after_filling(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a pin budget nothing is pinned ahead: the budget takes the first arenas' first tensors, as before."""
    monkeypatch.setattr(pinning, "AHEAD_GROUP", PAGE)
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", str(40 * 1024 / 2**30))
    m = _net()
    with materialize(m, options=OPTS) as hw:
        assert hw.report["pin"]["ahead_bytes"] == 0
        assert 0 < hw.pinned_bytes <= 40 * 1024


def test_failed_fill_unregisters_what_was_pinned_ahead(shm_dir: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A source that fails half way: the pieces pinned meanwhile are unregistered, no file is left, the model
    keeps its meta tensors."""
    monkeypatch.setattr(pinning, "AHEAD_GROUP", PAGE)
    from magi_core.host import CallableSource

    ref = _net().state_dict()
    calls = []

    def fn(name: str, meta: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        if len(calls) > 8:
            raise RuntimeError("disk gone")
        return ref[name]

    with torch.device("meta"):
        m = _net()
    with pytest.raises(RuntimeError, match="disk gone"):
        materialize(m, options=OPTS, source=CallableSource(fn))
    assert registered_ranges() == {}
    assert all(p.is_meta for p in m.parameters())
    assert os.listdir(shm_dir) == []


class _TwoDevices:
    """A device module with two devices and a current one per thread (as CUDA keeps it)."""

    def __init__(self, with_set_device: bool = True) -> None:
        import threading

        self._local = threading.local()
        if with_set_device:
            self.set_device = self._set

    def _set(self, index: int) -> None:
        self._local.index = index

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def device_count(self) -> int:
        return 2

    def is_initialized(self) -> bool:
        return hasattr(self._local, "index") or self.initialized

    initialized = False


def test_device_binder_carries_the_current_device_to_another_thread() -> None:
    import threading

    dm = _TwoDevices()
    be = dataclasses.replace(get_backend(), device_type="fake", device_module=dm)  # type: ignore[arg-type]
    dm._set(1)
    bind = be.device_binder()
    assert bind is not None
    seen: list[int] = []

    def worker() -> None:
        seen.append(dm.current_device())
        bind()
        seen.append(dm.current_device())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [0, 1]
    other = _TwoDevices(with_set_device=False)
    other.initialized = True
    no_set = dataclasses.replace(be, device_module=other)  # type: ignore[arg-type]
    assert no_set.device_binder() is None  # two devices, no way to choose: the caller pins after filling
    fresh = _TwoDevices()
    fresh.current_device = None  # type: ignore[assignment,method-assign]  # would initialise the runtime
    untouched = dataclasses.replace(be, device_module=fresh)  # type: ignore[arg-type]
    bind = untouched.device_binder()  # nothing chose a device yet: nothing to carry, nothing initialised
    assert bind is not None and bind() is None


def test_materialize_pins_ahead_on_the_callers_device(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank on device 1: every registration, made by the pinning thread, happens with device 1 current there (a
    worker left on device 0 would register for, and open a context on, another device); without ``set_device``
    on a two-device host nothing is pinned ahead, and all is pinned after filling from the caller's thread."""
    import threading

    monkeypatch.setattr(pinning, "AHEAD_GROUP", PAGE)
    real = get_backend()
    for with_set in (True, False):
        dm = _TwoDevices(with_set_device=with_set)
        dm._set(1)
        dm.initialized = True
        calls: list[tuple[int, bool]] = []

        def register(p: int, n: int, dm: _TwoDevices = dm, calls: list[tuple[int, bool]] = calls) -> None:
            calls.append((dm.current_device(), threading.current_thread() is threading.main_thread()))
            real.host_register(p, n)

        be = dataclasses.replace(real, device_type="fake", device_module=dm,  # type: ignore[arg-type]
                                 _register=register)
        m = _net()
        with materialize(m, options=OPTS, backend=be) as hw:
            assert hw.pinned_bytes == sum(a.nbytes for a in hw.arenas)
            assert calls and all(dev == 1 for dev, _ in calls), calls
            if with_set:
                assert hw.report["pin"]["ahead_bytes"] == hw.pinned_bytes
                assert not any(main for _, main in calls)
            else:
                assert hw.report["pin"]["ahead_bytes"] == 0 and all(main for _, main in calls)
    assert registered_ranges() == {}
