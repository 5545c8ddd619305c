"""Checkpoints that must never load: every field of a safetensors header checked as the safetensors library checks
it (byte ranges disjoint, in bounds and covering the data section; dtype, shape and offsets of the right types),
files that are not regular files (a FIFO would block forever), and index or file-list values of the wrong type.
Each is a WeightSourceError naming the file and the tensor or key, and nothing is left behind."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from magi_core.host import HostOptions, SafetensorsSource, WeightSourceError, materialize, open_source
from magi_core.host.loading import Staging
from magi_core.plugin.cpu import registered_ranges


def _write(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(name: str, n: int, begin: int) -> dict[str, Any]:
    return {name: {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n]}}


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(4))
        self.b = nn.Parameter(torch.empty(4))


def _safetensors_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                f.get_tensor(k)
    except Exception:
        return True
    return False


def test_a_tensor_given_the_bytes_of_another_is_refused(shm_dir: str, tmp_path: Path) -> None:
    """'b' claims 'a''s 16 bytes: before, the model loaded with b == a (and computed with the wrong bytes)."""
    a = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    same = _write(tmp_path / "same.safetensors", {**_f32("a", 4, 0), **_f32("b", 4, 0)}, a)
    half = _write(tmp_path / "half.safetensors", {**_f32("a", 4, 0), **_f32("b", 4, 8),
                                                  "c": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}},
                  a + a)
    for path in (same, half):
        assert _safetensors_refuses(path)  # the rule is the library's own
        m = Two().to("meta")
        with pytest.raises(WeightSourceError) as err:
            materialize(m, options=HostOptions(progress=False), source=path, strict=False)
        msg = str(err.value)
        assert str(path) in msg and "'a'" in msg and "'b'" in msg and "overlap" in msg, msg
        assert m.a.is_meta and m.b.is_meta and os.listdir(shm_dir) == [] and registered_ranges() == {}


def _entry(dtype: Any = "F32", shape: Any = (4,), offsets: Any = (0, 16)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


BAD_HEADERS = {
    "dtype a number": ({"w": _entry(dtype=5)}, "dtype 5"),
    "dtype unknown": ({"w": _entry(dtype="F33")}, "unknown dtype 'F33'"),
    "shape negative": ({"w": _entry(shape=(-4,))}, "shape [-4]"),
    "shape float": ({"w": _entry(shape=[4.0])}, "shape [4.0]"),
    "shape bool": ({"w": _entry(shape=[True, 4])}, "shape [True, 4]"),
    "shape a string": ({"w": _entry(shape="4")}, "shape '4'"),
    "offsets floats": ({"w": _entry(offsets=[0.0, 16.0])}, "data_offsets [0.0, 16.0]"),
    "offsets strings": ({"w": _entry(offsets=["0", "16"])}, "data_offsets ['0', '16']"),
    "offsets one int": ({"w": _entry(offsets=[16])}, "data_offsets [16]"),
    "offsets reversed": ({"w": _entry(offsets=(16, 0))}, "[16, 0)"),
    "offsets too short for the shape": ({"w": _entry(offsets=(0, 12))}, "[0, 12)"),
    "offsets negative": ({"w": _entry(offsets=(-16, 0))}, "[-16, 0)"),
    "entry not an object": ({"w": [0, 16]}, "not an object"),
    "entry without shape": ({"w": {"dtype": "F32", "data_offsets": [0, 16]}}, "no shape"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "w": _entry()}, "__metadata__"),
    "bytes of no tensor": ({"w": _entry(offsets=(0, 16)), "v": _entry(shape=(1,), offsets=(20, 24))},
                           "[16, 20) of the data section, before tensor 'v'"),
    "bytes past the last tensor": ({"w": _entry(shape=(3,), offsets=(0, 12))}, "cover 12 bytes"),
    "beyond the end": ({"w": _entry(shape=(8,), offsets=(0, 32))}, "truncated or corrupt"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_every_header_field_is_checked(case: str, tmp_path: Path) -> None:
    header, expect = BAD_HEADERS[case]
    path = _write(tmp_path / "m.safetensors", header, bytes(24 if case == "bytes of no tensor" else 16))
    with pytest.raises(WeightSourceError) as err:
        open_source(path)
    msg = str(err.value)
    assert str(path) in msg and expect in msg, msg
    if case != "metadata not strings":
        assert "'w'" in msg or "'v'" in msg, msg  # the tensor is named


def test_a_name_given_twice_in_the_header_is_refused(tmp_path: Path) -> None:
    raw = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, ' \
          b'"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}'
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(32))
    with pytest.raises(WeightSourceError, match="names 'w' twice"):
        open_source(path)


def _returns_within(fn: Any, seconds: float, fifos: list[Path]) -> BaseException | None:
    """Run ``fn`` in a thread; fail when it has not returned after ``seconds`` (then unblock it: a writer opens and
    closes each FIFO, so a reader waiting in open() gets end-of-file). Returns what it raised."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    blocked = t.is_alive()
    for f in fifos:
        try:
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waiting
    t.join(5)
    assert not blocked, "opening the source blocked on a FIFO"
    return out[0]


def test_a_fifo_named_like_a_checkpoint_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    err = _returns_within(lambda: open_source(fifo), 5, [fifo])
    assert isinstance(err, WeightSourceError) and str(fifo) in str(err) and "FIFO" in str(err), err
    err = _returns_within(lambda: open_source(tmp_path), 5, [fifo])  # found in a directory
    assert isinstance(err, WeightSourceError) and "FIFO" in str(err), err
    shard = tmp_path / "idx"
    shard.mkdir()
    os.mkfifo(shard / "model-1.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    err = _returns_within(lambda: open_source(shard), 5, [shard / "model-1.safetensors"])  # named by an index
    assert isinstance(err, WeightSourceError) and "model-1.safetensors" in str(err) and "FIFO" in str(err), err
    index = tmp_path / "fifo" / "model.safetensors.index.json"
    index.parent.mkdir()
    os.mkfifo(index)
    err = _returns_within(lambda: open_source(index), 5, [index])  # the index itself
    assert isinstance(err, WeightSourceError) and str(index) in str(err) and "FIFO" in str(err), err


def test_index_and_file_list_values_of_the_wrong_type(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "one.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    for value, shown in ((5, "5 (int)"), (None, "None (NoneType)"), ("", "'' (str)"), (["one.safetensors"], "list")):
        index.write_text(json.dumps({"weight_map": {"w": value}}))
        with pytest.raises(WeightSourceError) as err:
            open_source(index)
        assert str(index) in str(err.value) and "weight_map['w']" in str(err.value) and shown in str(err.value)
    with pytest.raises(WeightSourceError, match="empty list"):
        open_source([])
    with pytest.raises(WeightSourceError, match="entry 1 is 7 \\(int\\), not a path"):
        open_source([tmp_path / "one.safetensors", 7])  # type: ignore[list-item]
    with pytest.raises(WeightSourceError, match="empty list"):
        SafetensorsSource([])
    with pytest.raises(WeightSourceError, match="weight_map\\['w'\\] is 3"):
        SafetensorsSource([tmp_path / "one.safetensors"], weight_map={"w": 3})  # type: ignore[dict-item]


def test_a_file_replaced_after_its_header_was_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    src = SafetensorsSource([path])
    save_file({"w": torch.ones(8)}, str(tmp_path / "other.safetensors"))
    os.replace(tmp_path / "other.safetensors", path)
    out = torch.empty(4)
    with pytest.raises(WeightSourceError, match="replaced or changed size"):
        src.read_into("w", out, Staging(4096))
    src.close()
