"""Loading a model built on the meta device straight into the host arenas (one process): safetensors files, a
directory, a sharded index, a function; dtype conversion, tied and aliased tensors, non-persistent buffers, key
errors, strict=False, clean failure, progress, and ``magi_core.load`` end to end."""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from safetensors.torch import save_file
from torch import nn

import magi_core
from magi_core.host import CallableSource, HostOptions, WeightSourceError, materialize, open_source
from magi_core.host.loading import SafetensorsSource, Staging, staging_window
from magi_core.plugin.cpu import registered_ranges

OPTS = HostOptions(progress=False)


class Rotary(nn.Module):
    """Computes its non-persistent buffer in ``__init__`` from arguments it keeps (like most rotary embeddings)."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self.alias = self.inv_freq  # a plain attribute aliasing the buffer (transformers' original_inv_freq did)


class Causal(nn.Module):
    """Sets its non-persistent buffer in ``reset_parameters`` (its constructor takes nothing it keeps)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.empty(size, size, dtype=torch.bool), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.mask.copy_(torch.ones_like(self.mask).tril())


class Net(nn.Module):
    """Linear layers, a tied output, a transposed parameter, two views of one storage, a persistent buffer, two
    non-persistent buffers, an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.a.weight
        self.t = nn.Parameter(torch.empty(8, 24).t())  # non-contiguous, covers its storage
        base = torch.empty(6, 6)
        self.register_buffer("alias_a", base[:3])
        self.register_buffer("alias_b", base[3:])
        self.register_buffer("steps", torch.arange(7))
        self.empty = nn.Parameter(torch.empty(0, 4))
        self.rot = Rotary(8)
        self.causal = Causal(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(x))) + self.t.sum() + self.alias_b.sum() + self.rot.inv_freq.sum()


def reference() -> Net:
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        m.t.copy_(torch.randn(24, 8))
        m.alias_a.copy_(torch.randn(3, 6))
        m.alias_b.copy_(torch.randn(3, 6))
    return m


def meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def checkpoint(ref: nn.Module, dtype: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The state dict a checkpoint would hold (tied weight once, as transformers saves it)."""
    sd = {k: v.detach().contiguous().clone() for k, v in ref.state_dict().items() if k != "out.weight"}
    for k, d in (dtype or {}).items():
        sd[k] = sd[k].to(d)
    return sd


def _check_loaded(m: Net, ref: Net, hw: magi_core.host.HostWeights) -> None:
    for k, v in ref.state_dict().items():
        got = m.state_dict()[k]
        assert got.device.type == "cpu" and got.dtype == v.dtype and torch.equal(got, v), k
    assert m.out.weight is m.a.weight and isinstance(m.a.weight, nn.Parameter)
    assert m.alias_a.untyped_storage().data_ptr() == m.alias_b.untyped_storage().data_ptr()  # still one storage
    assert torch.equal(m.rot.inv_freq, ref.rot.inv_freq) and m.rot.alias is m.rot.inv_freq
    assert torch.equal(m.causal.mask, ref.causal.mask)
    assert m.empty.device.type == "cpu" and m.empty.shape == (0, 4)
    assert all(hw.locate(t) is not None for t in m.state_dict().values() if t.numel())
    assert hw.pinned_bytes > 0 and all(not os.path.exists(p) for p in hw.files)
    assert torch.equal(m(torch.ones(2, 16)), ref(torch.ones(2, 16)))


def test_safetensors_file_with_conversion_tying_aliasing_and_buffers(shm_dir: str, tmp_path: Path) -> None:
    ref = reference()
    path = tmp_path / "model.safetensors"
    save_file(checkpoint(ref, {"b.weight": torch.bfloat16, "a.weight": torch.float16}), str(path))
    with torch.no_grad():  # what the model holds after conversion back to its float32
        ref.b.weight.copy_(ref.b.weight.to(torch.bfloat16).float())
        ref.a.weight.copy_(ref.a.weight.to(torch.float16).float())
    m = meta_net()
    with materialize(m, options=HostOptions(progress=False, load_threads=2), source=path) as hw:
        _check_loaded(m, ref, hw)  # converting, in 2 threads
        rep = hw.report["load"]
        assert rep["threads"] == 2
        assert rep["missing"] == rep["unexpected"] == [] and rep["kept"] == []
        assert rep["buffers"] == {"rot.inv_freq": "re-running Rotary(dim, base)",
                                  "causal.mask": "Causal.reset_parameters()"}
        assert rep["staging_bytes"] == staging_window(hw.weight_bytes) == 4096
        assert rep["bytes_read"] == sum(t.numel() * t.element_size() for t in checkpoint(
            ref, {"b.weight": torch.bfloat16, "a.weight": torch.float16}).values())
    gc.collect()
    assert registered_ranges() == {}


def test_sharded_index_directory_list_and_rename(shm_dir: str, tmp_path: Path) -> None:
    ref = reference()
    sd = checkpoint(ref)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / name))
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for source, threads in ((tmp_path, None), (tmp_path / "model.safetensors.index.json", 3),
                            (sorted(tmp_path.glob("*.safetensors")), 1)):
        m = meta_net()
        with materialize(m, options=HostOptions(progress=False, load_threads=threads), source=source) as hw:
            _check_loaded(m, ref, hw)  # by the kernel into the arena's file, or into its mapping, from 1-8 threads
            tensors = hw.report["load"]["tensors"]
            assert hw.report["load"]["threads"] == (min(threads, tensors) if threads else
                                                    min(8, os.cpu_count() or 1, tensors))
    # a checkpoint saved with a prefix: rename maps its names onto the model's
    save_file({f"model.{k}": v for k, v in sd.items()}, str(tmp_path / "prefixed.safetensors"))
    m = meta_net()
    with materialize(m, options=OPTS, source=tmp_path / "prefixed.safetensors",
                     rename=lambda n: n.removeprefix("model.")) as hw:
        _check_loaded(m, ref, hw)


def test_source_paths_refused_with_advice(tmp_path: Path) -> None:
    with pytest.raises(WeightSourceError, match="does not exist"):
        open_source(tmp_path / "nope.safetensors")
    with pytest.raises(WeightSourceError, match="no \\*.safetensors file"):
        open_source(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(WeightSourceError, match="convert them to safetensors"):
        open_source(tmp_path)
    with pytest.raises(WeightSourceError, match="only safetensors"):
        open_source(tmp_path / "pytorch_model.bin")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(WeightSourceError, match="header is not JSON"):
        open_source(tmp_path / "bad.safetensors")
    deep = b"[" * 100_000  # deeper than Python's JSON parser goes: a damaged file, not a RecursionError
    (tmp_path / "deep.safetensors").write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(WeightSourceError, match=r"deep.safetensors: not a safetensors file \(its header nests JSON"):
        open_source(tmp_path / "deep.safetensors")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "model.safetensors.index.json").write_bytes(deep)
    with pytest.raises(WeightSourceError, match=r"cannot read the checkpoint index .*index.json: its JSON nests"):
        open_source(tmp_path / "deep" / "model.safetensors.index.json")
    save_file({"w": torch.ones(4)}, str(tmp_path / "one.safetensors"))
    data = (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-4])
    with pytest.raises(WeightSourceError, match="truncated or corrupt"):
        open_source(tmp_path / "cut.safetensors")
    save_file({"w": torch.ones(4)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(WeightSourceError, match="in two weight files"):
        SafetensorsSource([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "one.safetensors", "v": "one.safetensors"}}))
    with pytest.raises(WeightSourceError, match="not in the file it names"):
        open_source(idx)
    with pytest.raises(TypeError, match="weights must be"):
        open_source(42)  # type: ignore[arg-type]


def _files(shm_dir: str) -> list[str]:
    return sorted(os.listdir(shm_dir))


def test_missing_unexpected_misshaped_listed_nothing_changed(shm_dir: str, tmp_path: Path) -> None:
    ref = reference()
    sd = checkpoint(ref)
    del sd["b.bias"], sd["steps"]
    sd["extra.weight"] = torch.ones(3)
    sd["a.bias"] = torch.ones(31)
    save_file(sd, str(tmp_path / "m.safetensors"))
    m = meta_net()
    state = dict(m.state_dict(keep_vars=True))
    with pytest.raises(WeightSourceError) as err:
        materialize(m, options=OPTS, source=tmp_path / "m.safetensors")
    msg = str(err.value)
    assert "2 tensor(s) of the model are not in the source: 'b.bias', 'steps'" in msg
    assert "1 tensor(s) of the source are not in the model: 'extra.weight'" in msg
    assert "a.bias: source [31], model [32]" in msg and "left unchanged" in msg
    after = m.state_dict(keep_vars=True)
    assert all(after[k] is v and v.is_meta for k, v in state.items())  # the same meta tensors, nothing replaced
    assert m.rot.inv_freq.is_meta and m.empty.is_meta  # buffers recomputed and empty tensors: put back too
    assert _files(shm_dir) == [] and registered_ranges() == {}
    # strict=False: missing tensors zero-filled, unexpected ones skipped (both listed); a wrong shape still fails
    sd["a.bias"] = ref.a.bias.detach().clone()
    save_file(sd, str(tmp_path / "m.safetensors"))
    with materialize(m, options=OPTS, source=tmp_path / "m.safetensors", strict=False) as hw:
        assert hw.report["load"]["missing"] == ["b.bias", "steps"]
        assert hw.report["load"]["unexpected"] == ["extra.weight"]
        assert not m.b.bias.any() and not m.steps.any() and torch.equal(m.a.weight, ref.a.weight)


def test_unresolvable_buffer_named_with_the_fix(shm_dir: str, tmp_path: Path) -> None:
    class Opaque(nn.Module):
        def __init__(self, table: list[float]) -> None:  # the argument is not kept: nothing can recompute it
            super().__init__()
            self.register_buffer("table", torch.tensor(table), persistent=False)

    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("opaque", Opaque([1.0, 2.0]))
    save_file(checkpoint(m), str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2))
        meta.add_module("opaque", Opaque([1.0, 2.0]))
    with pytest.raises(WeightSourceError, match="'opaque.table'.*register_buffer.*init_empty_weights"):
        materialize(meta, options=OPTS, source=tmp_path / "m.safetensors")
    assert meta[0].weight.is_meta and _files(shm_dir) == [] and registered_ranges() == {}
    # the same buffer saved in the checkpoint (older checkpoints kept some): read from there
    save_file({**checkpoint(m), "opaque.table": torch.tensor([1.0, 2.0])}, str(tmp_path / "m.safetensors"))
    with materialize(meta, options=OPTS, source=tmp_path / "m.safetensors") as hw:
        assert torch.equal(meta.opaque.table, torch.tensor([1.0, 2.0]))
        assert hw.report["load"]["buffers"] == {"opaque.table": "read from the source (opaque.table)"}


class Unset(nn.Module):
    """``reset_parameters`` resets the weight and writes only the first element of ``part``: neither buffer is
    recomputed by it (a meta copy's buffers keep whatever they were filled with), and the constructor's argument is
    not kept, so nothing can recompute them."""

    def __init__(self, table: list[float]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2))
        self.register_buffer("table", torch.tensor(table), persistent=False)
        self.register_buffer("part", torch.tensor(table), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        with torch.no_grad():
            self.part[0] = 1.0


def test_a_reset_that_does_not_write_a_buffer_never_gives_it_values(shm_dir: str, tmp_path: Path) -> None:
    """The reset runs on two copies whose buffers are filled with other bytes; a buffer it does not set (wholly)
    comes out different and is not taken from it: an error naming the buffers, not a model computing with the fill."""
    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("unset", Unset([3.0, 4.0]))
    save_file({k: v for k, v in checkpoint(m).items() if not k.startswith("unset.")} | {"unset.weight": torch.ones(2)},
              str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2))
        meta.add_module("unset", Unset([3.0, 4.0]))
    with pytest.raises(WeightSourceError, match="2 non-persistent buffer.*'unset.part', 'unset.table'"):
        materialize(meta, options=OPTS, source=tmp_path / "m.safetensors")
    assert meta.unset.table.is_meta and meta.unset.part.is_meta and _files(shm_dir) == [] and registered_ranges() == {}


def test_function_source_and_clean_failure(shm_dir: str) -> None:
    ref = reference()
    sd = checkpoint(ref)
    calls: list[str] = []

    def fn(name: str, meta: torch.Tensor) -> torch.Tensor | None:
        calls.append(name)
        assert meta.is_meta and meta.shape == ref.state_dict()[name].shape
        return sd.get(name)

    m = meta_net()
    with materialize(m, options=OPTS, source=fn) as hw:
        _check_loaded(m, ref, hw)
        assert sorted(set(calls)) == sorted(k for k, v in sd.items() if v.numel())  # once per tensor (not empty)
        assert hw.report["load"]["largest_temporary"] == max(t.numel() * t.element_size() for t in sd.values())

    def broken(name: str, meta: torch.Tensor) -> torch.Tensor | None:
        if name == "b.weight":
            raise RuntimeError("disk gone")
        return sd.get(name)

    for bad, match in ((broken, "disk gone"), (lambda n, meta: None if n == "steps" else sd[n], "'steps'"),
                       (lambda n, meta: torch.ones(2) if n == "t" else sd[n], "t: source \\[2\\], model \\[24, 8\\]")):
        m = meta_net()
        state = dict(m.state_dict(keep_vars=True))
        with pytest.raises((RuntimeError, WeightSourceError), match=match):
            materialize(m, options=OPTS, source=bad)
        after = m.state_dict(keep_vars=True)
        assert all(after[k] is v and v.is_meta for k, v in state.items()), "the model is not back on meta"
        assert m.rot.inv_freq.is_meta and _files(shm_dir) == [] and registered_ranges() == {}
    m = meta_net()
    with materialize(m, options=OPTS, source=CallableSource(lambda n, meta: None if n == "steps" else sd[n]),
                     strict=False) as hw:
        assert hw.report["load"]["missing"] == ["steps"] and not m.steps.any()


def test_thread_safe_function_source_is_called_from_several_threads(shm_dir: str) -> None:
    ref = reference()
    sd = checkpoint(ref)
    callers: dict[str, set[str]] = {"default": set(), "thread_safe": set()}

    def fn_of(kind: str) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
        def fn(name: str, meta: torch.Tensor) -> torch.Tensor | None:
            callers[kind].add(threading.current_thread().name)
            time.sleep(0.01)  # long enough that the pool's threads overlap
            return sd.get(name)
        return fn

    for kind, source in (("default", CallableSource(fn_of("default"))),
                         ("thread_safe", CallableSource(fn_of("thread_safe"), thread_safe=True))):
        m = meta_net()
        with materialize(m, options=HostOptions(progress=False, load_threads=3), source=source) as hw:
            _check_loaded(m, ref, hw)
            assert hw.report["load"]["threads"] == (3 if kind == "thread_safe" else 1)
    assert callers["default"] == {threading.main_thread().name}
    assert len(callers["thread_safe"]) > 1 and all(n.startswith("magi-load") for n in callers["thread_safe"])
    assert registered_ranges() == {} and _files(shm_dir) == []


def test_real_tensors_overwritten_when_held_kept_otherwise(shm_dir: str, tmp_path: Path) -> None:
    ref = reference()
    sd = checkpoint(ref)
    del sd["steps"]  # the model's real buffer keeps its value
    sd["rot.inv_freq"], sd["layers.0.rot.inv_freq"] = torch.zeros(4), torch.zeros(4)  # older copies: recomputed
    save_file(sd, str(tmp_path / "m.safetensors"))
    m = reference()
    with torch.no_grad():
        m.a.weight.zero_()  # the source holds it: overwritten, as load_state_dict would
    with materialize(m, options=OPTS, source=tmp_path / "m.safetensors") as hw:
        assert torch.equal(m.a.weight, ref.a.weight) and torch.equal(m.steps, torch.arange(7))
        assert torch.equal(m.rot.inv_freq, ref.rot.inv_freq)
        assert hw.report["load"]["kept"] == ["steps"] and hw.report["load"]["ignored"] == ["layers.0.rot.inv_freq"]
        assert hw.report["load"]["unexpected"] == []


def test_progress_bar_shows_bytes_and_rate(shm_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference()
    save_file(checkpoint(ref), str(tmp_path / "m.safetensors"))
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    seen: list[tuple[str, int, int]] = []
    with materialize(meta_net(), options=HostOptions(progress=True), source=tmp_path / "m.safetensors",
                     on_progress=lambda *a: seen.append(a)) as hw:
        pass
    text = err.getvalue()
    assert "magi: load (rank 0)" in text and "B/s" in text, text[-500:]  # bytes done / total, and the rate
    copies = [s for s in seen if s[0] == "copy"]
    assert copies[-1][1] == copies[-1][2] == hw.weight_bytes


def test_staging_window_is_bounded() -> None:
    assert staging_window(10 << 30) == 64 << 20 and staging_window(1000) == 4096
    assert staging_window(100 << 20) == int(0.04 * (100 << 20)) and staging_window(1 << 30, explicit=8192) == 8192
    s = Staging(4096)
    assert s.take(4096).numel() == 4096 and s.elements(torch.bfloat16) == 2048
    with pytest.raises(ValueError, match="exceeds the window"):
        s.take(4097)


def test_load_end_to_end_offloads_and_runs(shm_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    save_file({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, str(tmp_path / "m.safetensors"))
    ref = ref.to(torch.bfloat16)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(torch.bfloat16).eval()
    with caplog.at_level(logging.INFO, logger="magi_core.host"):
        out = magi_core.load(model, tmp_path / "m.safetensors", host_options=OPTS)
    assert out is model and "read 4 tensor(s)" in caplog.text
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert magi_core.handle(model).host.report["load"]["bytes_read"] == sum(p.nbytes for p in ref.parameters())
    magi_core.release(model)
    gc.collect()
    assert registered_ranges() == {}
    with torch.device("meta"):
        again = nn.Linear(2, 2).eval()
    with pytest.raises(magi_core.host.HostStateError, match="magi_core.load"):
        magi_core.offload(again, host_options=OPTS)


class _Scaled(nn.Module):
    """A linear layer and a non-persistent buffer its constructor computes."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("scale", torch.arange(n, dtype=torch.float32), persistent=False)


def test_sources_of_another_shape_for_buffers_and_empty_tensors_are_refused(shm_dir: str, tmp_path: Path) -> None:
    """A non-persistent buffer the source holds with another shape, and an empty model tensor whose source tensor is
    not empty, are mis-shaped like any weight: named in the error, and the model left as it was."""
    sd = {k: v.contiguous() for k, v in nn.Sequential(_Scaled(), _Scaled()).state_dict().items()}
    sd["0.scale"], sd["1.scale"] = torch.arange(4.0), torch.arange(5.0)  # the second of another shape
    save_file(sd, str(tmp_path / "buffers.safetensors"))
    with torch.device("meta"):
        m = nn.Sequential(_Scaled(), _Scaled()).eval()
    before = {n: b for n, b in m.named_buffers()}
    with pytest.raises(WeightSourceError, match=r"1 tensor\(s\) have another shape in the source: "
                                                r"'1.scale: source \[5\], model \[4\]'.*left unchanged"):
        materialize(m, options=OPTS, source=tmp_path / "buffers.safetensors")
    assert all(b is before[n] and b.is_meta for n, b in m.named_buffers())  # the first buffer put back too
    save_file({"weight": torch.randn(4, 8), "bias": torch.randn(4)}, str(tmp_path / "linear.safetensors"))
    with torch.device("meta"):
        empty = nn.Linear(8, 0)
    with pytest.raises(WeightSourceError, match=r"2 tensor\(s\) have another shape in the source: "
                                                r"'weight: source \[4, 8\], model \[0, 8\]', 'bias: source \[4\]"):
        materialize(empty, options=OPTS, source=tmp_path / "linear.safetensors")
    assert empty.weight.is_meta and empty.bias.is_meta
    assert _files(shm_dir) == [] and registered_ranges() == {}


def test_loading_into_a_released_model_is_refused(shm_dir: str, tmp_path: Path) -> None:
    """release() without restore empties the model's tensors: filling it again would load nothing, so it is
    refused up front, saying to build the model again."""
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    save_file(ref.state_dict(), str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    hw = materialize(m, options=OPTS, source=tmp_path / "m.safetensors")
    hw.release()
    for source in (tmp_path / "m.safetensors", None):
        with pytest.raises(magi_core.MagiError, match=r"Sequential: its host weights were released .* Build the "
                                                      r"model again"):
            materialize(m, options=OPTS, source=source)
    assert _files(shm_dir) == [] and registered_ranges() == {}
