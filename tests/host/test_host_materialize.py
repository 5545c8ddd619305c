"""Single-process host materialisation: values, identity, tying, aliasing, moves, options and lifecycle."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import subprocess
import sys

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from torch import nn

from magi_core import get_backend
from magi_core.errors import ConfigError, HostRegisterError
from magi_core.host import HostOptions, HostStateError, HostWeights, materialize
from magi_core.host.topology import resolve_ep_size
from magi_core.plugin.cpu import registered_ranges

OPTS = HostOptions(progress=False)


class Net(nn.Module):
    """Mixed dtypes, a buffer, tied weights, a transposed parameter and a slice of a bigger storage."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16).to(torch.bfloat16)
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.a.weight  # tied: one Parameter in two modules
        self.register_buffer("steps", torch.arange(7))
        self.t = nn.Parameter(torch.randn(8, 24).t())  # non-contiguous, covers its storage
        big = torch.randn(100)
        self.part = nn.Parameter(big[10:30].view(4, 5))  # a small view of a larger storage
        base = torch.randn(6, 6)
        self.register_buffer("alias_a", base[:3])  # two buffers sharing one storage
        self.register_buffer("alias_b", base[3:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.out(self.b(h.to(torch.bfloat16)).float())


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()}


def _in_arena(hw: HostWeights, t: torch.Tensor) -> bool:
    lo = t.data_ptr()
    return any(a.buf.data_ptr() <= lo < a.buf.data_ptr() + a.nbytes for a in hw.arenas)


def test_values_identity_and_layout_kept(shm_dir: str) -> None:
    m = Net()
    ref, params = _state(m), dict(m.named_parameters())
    x = torch.randn(3, 16)
    y_ref = m(x)
    with materialize(m, options=OPTS) as hw:
        for k, v in m.state_dict().items():
            assert torch.equal(v, ref[k]), k
            assert v.stride() == ref[k].stride(), k
        assert all(m.get_parameter(k) is p for k, p in params.items())
        assert m.out.weight is m.a.weight
        assert all(_in_arena(hw, t) for t in [*m.parameters(), *m.buffers()])
        assert m.alias_a.untyped_storage().data_ptr() == m.alias_b.untyped_storage().data_ptr()
        assert m.alias_b.data_ptr() - m.alias_a.data_ptr() == 3 * 6 * 4  # still two halves of one storage
        assert torch.equal(m(x), y_ref)
        assert {a.key for a in hw.arenas} == {"float32", "bfloat16", "int64"}
        assert all(a.nbytes % 4096 == 0 for a in hw.arenas)
        assert all(t.data_ptr() % 256 == 0 for t in [m.a.weight, m.a.bias, m.b.weight, m.steps, m.part])
        assert hw.weight_bytes < sum(a.nbytes for a in hw.arenas) <= hw.weight_bytes + 3 * (4096 + 256 * 10)
        assert hw.files and all(not os.path.exists(p) for p in hw.files)
        assert hw.pinned_bytes == sum(a.nbytes for a in hw.arenas)
        assert sorted(registered_ranges().items()) == sorted(hw.pinned_ranges)
        assert hw.is_pinned(m.a.weight) and not hw.is_pinned(torch.ones(3))
    assert hw.released and hw.pinned_bytes == 0


def test_move_leaves_host_weights_other_state_moves(shm_dir: str) -> None:
    m = Net()
    hw = materialize(m, options=OPTS)
    ptrs = {k: v.data_ptr() for k, v in m.state_dict().items()}
    m.extra = nn.Linear(2, 2)  # added after offloading: not host weights, so it moves
    m.to("meta")
    assert all(v.device.type == "cpu" and v.data_ptr() == ptrs[k] for k, v in m.state_dict().items()
               if not k.startswith("extra"))
    assert m.extra.weight.device.type == "meta"
    m.a.to(torch.float32)  # no dtype change for fp32 host weights: fine
    with pytest.raises(HostStateError, match="cast the model"):
        m.b.float()
    assert m.b.weight.dtype == torch.bfloat16
    with pytest.raises(HostStateError, match="cast the model"):
        m.half()
    assert m.a.weight.dtype == torch.float32 and m.a.weight.data_ptr() == ptrs["a.weight"]
    hw.release()
    m2 = nn.Linear(3, 3)
    hw2 = materialize(m2, options=OPTS)
    hw2.release(restore=True)
    m2.to("meta")  # the patch is gone after release
    assert m2.weight.device.type == "meta"


def test_release_unregisters_unmaps_and_blocks_use(shm_dir: str) -> None:
    m = Net()
    hw = materialize(m, options=OPTS)
    assert registered_ranges()
    hw.release()
    hw.release()  # idempotent
    gc.collect()
    assert registered_ranges() == {}
    assert hw.unmapped()
    assert all(p.numel() == 0 for p in m.parameters())
    with pytest.raises(HostStateError, match="released"):
        m(torch.randn(1, 16))


def test_release_says_what_a_mapping_still_viewed_means(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """A tensor kept from the model keeps its mapping: release says so, and that nothing needs doing."""
    m = Net()
    hw = materialize(m, options=OPTS)
    kept = m.a.weight.detach()
    with caplog.at_level(logging.WARNING, logger="magi_core.host"):
        hw.release()
    assert "1 host mapping(s) of the released weights" in caplog.text
    assert "while tensors still view them" in caplog.text and "Nothing to do" in caplog.text
    assert hw.report["released"]["still_mapped"] == 1 and not hw.unmapped()
    del kept
    gc.collect()
    assert hw.unmapped()


EXIT_SCRIPT = """
import logging, sys, torch
from magi_core.host import HostOptions, materialize
logging.basicConfig(level=getattr(logging, sys.argv[1]), format="%(levelname)s %(message)s")
model = torch.nn.Linear(8, 8)
materialize(model, options=HostOptions(progress=False))
kept = model.weight.detach()  # still viewing its mapping when the interpreter exits
"""


@pytest.mark.parametrize("level", ["WARNING", "DEBUG"])
def test_release_at_exit_is_quiet(shm_dir: str, level: str) -> None:
    """At interpreter exit the mappings go with the process: what is still mapped is logged at DEBUG only."""
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, level], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "stay mapped" in line]
    assert [s.split()[0] for s in said] == ([] if level == "WARNING" else ["DEBUG"]), out.stderr


def test_release_restore_and_repeated_cycles(shm_dir: str) -> None:
    m = Net()
    ref = _state(m)
    for _ in range(5):
        hw = materialize(m, options=OPTS)
        assert _in_arena(hw, m.a.weight)
        hw.release(restore=True)
        gc.collect()
        assert hw.unmapped() and registered_ranges() == {}
        assert all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())
        assert m.out.weight is m.a.weight
    m(torch.randn(2, 16))


def test_materialize_twice_is_idempotent_or_refused(shm_dir: str) -> None:
    m = Net()
    hw = materialize(m, options=OPTS)
    assert materialize(m, options=OPTS) is hw
    with pytest.raises(HostStateError, match="other options"):
        materialize(m, options=HostOptions(progress=False, pin=False))
    with pytest.raises(HostStateError, match="outer model"):
        materialize(m.a, options=OPTS)
    hw.release()


def test_skip_shm_keeps_plain_tensors(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAGI_SKIP_SHM", "1")
    m = Net()
    ptrs = {k: v.data_ptr() for k, v in m.state_dict().items()}
    with materialize(m, options=OPTS) as hw:
        assert hw.report["mode"] == "plain" and hw.files == [] and hw.pinned_bytes == 0
        assert registered_ranges() == {}
        assert {k: v.data_ptr() for k, v in m.state_dict().items()} == ptrs
        m.to("meta")
        assert m.a.weight.device.type == "cpu"


def test_pin_budget_and_no_pin(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # ~2 MiB of fp32
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", str(1 / 1024))  # 1 MiB
    with materialize(m, options=OPTS) as hw:
        assert hw.pinned_bytes == 1 << 20 < hw.weight_bytes
        assert hw.is_pinned(m[0].weight) and not hw.is_pinned(m[1].weight)
        assert hw.report["pin"]["budget"] == 1 << 20
    with materialize(nn.Linear(4, 4), options=HostOptions(pin=False, progress=False)) as hw2:
        assert hw2.pinned_bytes == 0 and registered_ranges() == {}


def test_pin_budget_never_cuts_through_a_tensor(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor half pinned cannot be copied to a CUDA device at all (CUDA refuses the copy): the budget's
    cut moves back to a page no tensor straddles."""
    m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # weights of 1 MiB each, small biases between
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", str(1.5 / 1024))  # 1.5 MiB: the raw cut lands inside m[1].weight
    with materialize(m, options=OPTS) as hw:
        assert 0 < hw.pinned_bytes <= 1.5 * (1 << 20)
        for name, p in m.named_parameters():
            lo, hi = p.data_ptr(), p.data_ptr() + p.nbytes
            inside = sum(max(0, min(hi, r + n) - max(lo, r)) for r, n in hw.pinned_ranges)
            assert inside in (0, p.nbytes), f"{name}: {inside} of {p.nbytes} bytes pinned"
        assert hw.is_pinned(m[0].weight) and not hw.is_pinned(m[1].weight)


def test_refused_pinning_logs_memlock_and_keeps_going(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """A runtime that refuses registration after 1 MiB (as under a low RLIMIT_MEMLOCK): partial pin, clear log."""
    real = get_backend()
    budget = [1 << 20]

    def register(ptr: int, nbytes: int) -> None:
        if nbytes > budget[0]:
            raise HostRegisterError("out of locked memory", code=2)
        budget[0] -= nbytes
        real.host_register(ptr, nbytes)

    be = dataclasses.replace(real, _register=register)
    m = nn.Sequential(nn.Linear(512, 512).half(), nn.Linear(1024, 1024))  # fp16 arena 0.5 MiB, then 4 MiB fp32
    with caplog.at_level(logging.WARNING, logger="magi_core.host"):
        with materialize(m, options=OPTS, backend=be) as hw:
            assert 0 < hw.pinned_bytes < sum(a.nbytes for a in hw.arenas)
            assert "out of locked memory" in hw.report["pin"]["error"]
            assert "soft" in hw.report["pin"]["memlock"]
    assert "memlock limit" in caplog.text


def test_a_register_hook_raising_another_error_is_named_a_backend_bug(shm_dir: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Not the HostRegisterError of the hook spec: the log blames the backend, not the memlock limit; the weights
    stay right (pageable)."""
    real = get_backend()

    def register(ptr: int, nbytes: int) -> None:
        raise AttributeError("'NoneType' object has no attribute 'cudaHostRegister'")

    be = dataclasses.replace(real, _register=register)
    m = nn.Linear(64, 64)
    want = m.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="magi_core.host"):
        with materialize(m, options=OPTS, backend=be) as hw:
            assert hw.pinned_bytes == 0 and "AttributeError" in hw.report["pin"]["error"]
            assert torch.equal(m.weight, want)
    assert "a bug in that backend" in caplog.text and f"backend {real.name!r}" in caplog.text
    assert "memlock limit" not in caplog.text and registered_ranges() == {}


def test_progress_callback_reports_every_byte(shm_dir: str) -> None:
    seen: list[tuple[str, int, int]] = []
    m = Net()
    with materialize(m, options=OPTS, on_progress=lambda *a: seen.append(a)) as hw:
        copies = [s for s in seen if s[0] == "copy"]
        assert copies[-1][1] == copies[-1][2] == hw.weight_bytes
        assert [s[1] for s in copies] == sorted(s[1] for s in copies)
        pins = [s for s in seen if s[0] == "pin"]
        assert pins[-1][1] == hw.pinned_bytes


def test_unsupported_tensors_refused_with_advice(shm_dir: str) -> None:
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with pytest.raises(HostStateError, match="load real weights"):
        materialize(m, options=OPTS)


def test_env_options_validated(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAGI_PIN_CONCURRENCY", "zero")
    with pytest.raises(ConfigError, match="MAGI_PIN_CONCURRENCY"):
        HostOptions().resolve()
    monkeypatch.setenv("MAGI_PIN_CONCURRENCY", "3")
    assert HostOptions().resolve().pin_concurrency == 3
    assert HostOptions(pin_concurrency=5).resolve().pin_concurrency == 5
    monkeypatch.setenv("MAGI_SKIP_SHM", "maybe")
    with pytest.raises(ConfigError, match="MAGI_SKIP_SHM"):
        HostOptions().resolve()
    with pytest.raises(ConfigError, match="on_mismatch"):
        HostOptions(on_mismatch="ignore").validate()  # type: ignore[arg-type]


def test_ep_size_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MAGI_EP_SIZE", "EXPERT_MODEL_PARALLEL_SIZE", "EXPERT_PARALLEL_SIZE", "EP_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_ep_size(None) == 1
    monkeypatch.setenv("EP_SIZE", "4")
    assert resolve_ep_size(None) == 4
    monkeypatch.setenv("MAGI_EP_SIZE", "2")
    assert resolve_ep_size(None) == 2
    assert resolve_ep_size(8) == 8
    monkeypatch.setenv("MAGI_EP_SIZE", "x")
    with pytest.raises(ConfigError, match="MAGI_EP_SIZE"):
        resolve_ep_size(None)
