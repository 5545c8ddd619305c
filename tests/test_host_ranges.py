"""HostRangeTable: the register/unregister bookkeeping every backend shares."""

from __future__ import annotations

import pytest
import torch

from magi_core.errors import HostRegisterError
from magi_core.plugin.host_ranges import ALREADY_REGISTERED, NOT_REGISTERED, SUCCESS, HostRangeTable


class Runtime:
    """A runtime that answers with the codes a real one gives and records every call."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[str] = []
        self.pending_error = SUCCESS

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append("register")
        if ptr in self.pinned:
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
