"""HostRangeTable: the register/unregister bookkeeping every backend shares."""

from __future__ import annotations

import pytest
import torch

from magi_core.errors import HostRegisterError
from magi_core.plugin.host_ranges import ALREADY_REGISTERED, NOT_REGISTERED, SUCCESS, HostRangeTable


class Runtime:
    """A runtime with a real table of pinned ranges, answering as CUDA's and MUSA's do, recording every call.

    Register answers 712 when the range overlaps a pinned one (whoever pinned it); unregister answers 713 unless
    a pinned range starts exactly at ``ptr``. A non-zero answer leaves a pending error until :meth:`clear`.
    """

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[str] = []
        self.pending_error = SUCCESS

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append("register")
        if any(ptr < start + size and start < ptr + nbytes for start, size in self.pinned.items()):
            self.pending_error = ALREADY_REGISTERED
            return ALREADY_REGISTERED
        if nbytes > 1 << 40:
            self.pending_error = 2
            return 2
        self.pinned[ptr] = nbytes
        return SUCCESS

    def unregister(self, ptr: int) -> int:
        self.calls.append("unregister")
        if self.pinned.pop(ptr, None) is None:
            self.pending_error = NOT_REGISTERED
            return NOT_REGISTERED
        return SUCCESS

    def clear(self) -> None:
        self.pending_error = SUCCESS


def _table(rt: Runtime) -> HostRangeTable:
    return HostRangeTable("X", rt.register, rt.unregister, error_text=lambda e: f"text-{int(e)}", clear_error=rt.clear)


def test_round_trip_and_repeat_register_skips_the_runtime() -> None:
    rt, t = Runtime(), torch.ones(64)
    table = _table(rt)
    table.register(t.data_ptr(), 256)
    table.register(t.data_ptr(), 256)
    assert rt.calls == ["register"] and table.ranges() == {t.data_ptr(): 256}
    table.unregister(t.data_ptr())
    assert table.ranges() == {} and rt.pinned == {}


def test_712_from_the_runtime_is_success_and_its_error_is_cleared() -> None:
    rt, t = Runtime(), torch.ones(64)
    rt.register(t.data_ptr(), 256)  # registered behind the table's back
    table = _table(rt)
    table.register(t.data_ptr(), 256)
    assert table.ranges() == {t.data_ptr(): 256} and rt.pending_error == SUCCESS


def test_other_codes_raise_with_the_runtime_text_and_code() -> None:
    rt = Runtime()
    with pytest.raises(HostRegisterError, match="text-2") as info:
        _table(rt).register(4096, 1 << 41)
    assert info.value.code == 2 and rt.pending_error == SUCCESS


def test_unknown_unregister_raises_713_without_calling_the_runtime() -> None:
    rt = Runtime()
    with pytest.raises(HostRegisterError, match="not registered") as info:
        _table(rt).unregister(4096)
    assert info.value.code == NOT_REGISTERED and rt.calls == []


def test_713_from_the_runtime_raises() -> None:
    rt, t = Runtime(), torch.ones(64)
    table = _table(rt)
    table.register(t.data_ptr(), 256)
    rt.unregister(t.data_ptr())  # gone behind the table's back
    with pytest.raises(HostRegisterError, match="text-713") as info:
        table.unregister(t.data_ptr())
    assert info.value.code == NOT_REGISTERED and table.ranges() == {}


@pytest.mark.parametrize("ptr,nbytes", [(0, 16), (4096, 0), (-1, 8)])
def test_invalid_ranges_raise_before_the_runtime(ptr: int, nbytes: int) -> None:
    rt = Runtime()
    with pytest.raises(HostRegisterError, match="invalid range"):
        _table(rt).register(ptr, nbytes)
    assert rt.calls == []


# -- ownership: only what the table registered is unregistered through the runtime --------------------------------


def test_a_range_someone_else_registered_is_accepted_and_left_registered() -> None:
    """712 on register: the range is found, not owned; unregister forgets it and never removes their registration."""
    rt, t = Runtime(), torch.ones(64)
    ptr = t.data_ptr()
    assert rt.register(ptr, 256) == SUCCESS  # another component (torch's pinned allocator, a library) pinned it
    rt.calls.clear()
    table = _table(rt)
    table.register(ptr, 256)
    assert table.ranges() == {ptr: 256}
    assert rt.pending_error == SUCCESS, "the 712 left the runtime's pending error for the next kernel"
    table.unregister(ptr)
    assert rt.calls == ["register"], "unregistering a found range called the runtime"
    assert rt.pinned == {ptr: 256}, "our unregister removed the other component's registration"
    assert table.ranges() == {}
    assert rt.unregister(ptr) == SUCCESS  # theirs to remove, and it is still there
    with pytest.raises(HostRegisterError, match="not registered") as info:
        table.unregister(ptr)
    assert info.value.code == NOT_REGISTERED


def test_a_sub_range_is_covered_by_its_parent_and_never_unregistered_alone() -> None:
    """Inside a held range: accepted without a runtime call; its unregister calls nothing and raises nothing."""
    rt, t = Runtime(), torch.ones(1024)
    ptr = t.data_ptr()
    table = _table(rt)
    table.register(ptr, 4096)
    table.register(ptr + 512, 1024)
    table.register(ptr + 3072, 1024)  # ends where the parent ends
    assert rt.calls == ["register"]
    assert table.origins() == {ptr: "registered", ptr + 512: "covered", ptr + 3072: "covered"}
    table.unregister(ptr + 512)
    assert rt.calls == ["register"] and rt.pinned == {ptr: 4096}, "the sub-range's unregister reached the runtime"
    table.unregister(ptr)
    assert rt.calls == ["register", "unregister"] and rt.pinned == {}
    table.unregister(ptr + 3072)  # its parent went first: still no runtime call, no error
    assert rt.calls == ["register", "unregister"] and table.ranges() == {}
    assert rt.pending_error == SUCCESS


def test_a_sub_range_of_a_found_range_is_covered_too() -> None:
    rt, t = Runtime(), torch.ones(1024)
    ptr = t.data_ptr()
    rt.register(ptr, 4096)
    table = _table(rt)
    table.register(ptr, 4096)
    table.register(ptr + 1024, 256)
    assert table.origins() == {ptr: "found", ptr + 1024: "covered"} and rt.calls == ["register", "register"]
    table.unregister(ptr + 1024)
    table.unregister(ptr)
    assert rt.calls == ["register", "register"] and rt.pinned == {ptr: 4096}


def test_a_range_overlapping_a_held_one_reaches_the_runtime_and_is_found() -> None:
    """Not inside any held range: the runtime decides (712 for an overlap), and the range is found, not owned."""
    rt, t = Runtime(), torch.ones(2048)
    ptr = t.data_ptr()
    table = _table(rt)
    table.register(ptr, 4096)
    table.register(ptr + 2048, 4096)  # straddles the end of the first
    assert rt.calls == ["register", "register"] and rt.pending_error == SUCCESS
    table.unregister(ptr + 2048)
    assert rt.calls == ["register", "register"] and rt.pinned == {ptr: 4096}
    table.unregister(ptr)
    assert rt.pinned == {} and rt.calls[-1] == "unregister"
    table.register(ptr, 4096)
    table.register(ptr + 2048, 4096)
    assert table.origins() == {ptr: "registered", ptr + 2048: "found"}
    table.unregister(ptr + 2048)
    table.unregister(ptr)


def test_a_sub_range_left_behind_by_its_parent_registers_afresh() -> None:
    """Once its parent is unregistered, registering a held sub-range again pins it through the runtime."""
    rt, t = Runtime(), torch.ones(1024)
    ptr = t.data_ptr()
    table = _table(rt)
    table.register(ptr, 4096)
    table.register(ptr + 1024, 1024)
    table.unregister(ptr)
    table.register(ptr + 1024, 1024)  # not covered any more: the runtime pins it, and it is ours
    assert rt.calls == ["register", "unregister", "register"] and rt.pinned == {ptr + 1024: 1024}
    assert table.origins() == {ptr + 1024: "registered"}
    table.unregister(ptr + 1024)
    assert rt.pinned == {} and table.ranges() == {}


def test_a_covered_range_moves_to_another_holder_when_its_parent_goes() -> None:
    """Two held ranges cover a sub-range: when the first goes, the second covers it (no runtime call for it)."""
    rt, t = Runtime(), torch.ones(4096)
    ptr = t.data_ptr()
    table = _table(rt)
    table.register(ptr, 8192)
    table.register(ptr + 2048, 8192)  # overlaps the first: the runtime answers 712, found
    table.register(ptr + 4096, 2048)  # inside both: covered
    table.unregister(ptr)
    calls = list(rt.calls)
    table.register(ptr + 4096, 2048)  # still covered (by the found range): held, nothing to do
    assert rt.calls == calls and table.origins() == {ptr + 2048: "found", ptr + 4096: "covered"}
    table.unregister(ptr + 2048)
    table.register(ptr + 4096, 2048)  # nothing covers it now: registered afresh
    assert rt.calls == [*calls, "register"] and table.origins() == {ptr + 4096: "registered"}
    table.unregister(ptr + 4096)
    assert rt.pinned == {} and table.ranges() == {}


def test_loaded_libraries_finds_only_what_is_mapped() -> None:
    """The helper backends use to reach their runtime's error drain: libraries already mapped, none loaded anew."""
    from magi_core.plugin import loaded_libraries

    libc = loaded_libraries("libc.so") or loaded_libraries("libc-")
    assert libc and all(hasattr(lib, "getpid") for lib in libc)
    assert loaded_libraries("libmagi_no_such_runtime") == []
