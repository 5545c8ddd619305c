"""``magi_core.api.offload``: host weights, forward through magi_offload, model stays a usable nn.Module."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Iterator

import pytest
import torch
from helpers.ranges import registered_ranges
from torch import nn

import magi_core.api as api
from magi_core.api import handle, offload, release
from magi_core.bench.models import TransformerSpec, build_transformer, example_input
from magi_core.compile.device_inputs import ProxyPool
from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError, MagiError
from magi_core.plugin.manager import get_backend


def test_offload_keeps_module_and_runs_through_backend():
    torch._dynamo.reset()
    before = registered_ranges()
    spec = TransformerSpec(layers=2, hidden=32, heads=2)
    model = build_transformer(spec)
    keys = set(model.state_dict())
    x = example_input(spec, tokens=6)
    with torch.no_grad():
        ref = model(x)
    try:
        out_model = offload(model, OffloadConfig(policy="COST_EFFECTIVE", gpu_resident_weight_ratio=0.5,
                                                 unit_compiler="eager"))
        assert out_model is model and type(model).__name__ == "SyntheticTransformer"
        assert len(registered_ranges()) > len(before), "weights should sit in registered host arenas"
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(model(x).cpu(), ref)
        assert handle(model).compile_count == 1
        rt = handle(model).runtime
        assert rt.phase == "planned" and str(rt.config.policy) == "COST_EFFECTIVE"
        assert set(model.state_dict()) == keys
        model.to(get_backend().device())  # offloaded weights stay on the host
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        release(model, restore=True)
        torch._dynamo.reset()
    assert registered_ranges() == before
    torch.testing.assert_close(model.state_dict()["norm.weight"], model.norm.weight)


# -- modules whose forward lives in torch.nn, hooks, device inputs, many instances ---------------------------
CFG = OffloadConfig(unit_compiler="eager", warmup_calls=2)


class Stack(nn.Module):
    """A ModuleList-based model."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return x


def _torch_nn_models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "Sequential": nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        "Linear": nn.Linear(8, 8),
        "ModuleList": Stack(),
    }




@pytest.mark.parametrize("kind", ["Sequential", "Linear", "ModuleList"])
@pytest.mark.parametrize("device_inputs", [False, True], ids=["host-inputs", "device-inputs"])
def test_offload_modules_whose_forward_lives_in_torch_nn(kind, device_inputs, shm_dir):
    model = _torch_nn_models()[kind].eval()
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    model.register_forward_hook(lambda mod, args, out: out + 1.0)
    before = registered_ranges()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    try:
        assert offload(model, CFG) is model
        h = handle(model)
        fwd = h.forward
        assert fwd is not None
        if device_inputs:  # Dynamo sees a NaN-filled host proxy of the device input
            backend = get_backend()
            if backend.is_accelerator:
                x = x.to(backend.device())
            else:  # no device tensors on the CPU backend: treat x as one
                fwd.is_device = lambda t: t is x
            fwd.pool = ProxyPool(fill_value=math.nan)
        with torch.no_grad():
            for _ in range(4):  # warm-up, profile, planned
                torch.testing.assert_close(model(x).cpu(), ref)  # hooks included
        assert h.compile_count == 1 and h.runtime.phase == "planned"
        assert fwd.substituted_calls == (4 if device_inputs else 0)
    finally:
        release(model, restore=True)
    assert registered_ranges() == before and list(shm_dir.iterdir()) == []
    with torch.no_grad():
        torch.testing.assert_close(model(x.cpu()), ref)  # the eager forward is back


def test_offload_many_instances_of_one_class(shm_dir):
    """Each offloaded model compiles its own entry: no shared Dynamo cache, no recompile limit across models."""
    models = [nn.Linear(8, 4).eval() for _ in range(10)]
    x = torch.randn(2, 8)
    with torch.no_grad():
        refs = [m(x) for m in models]
    try:
        for m in models:
            offload(m, CFG)
        with torch.no_grad():
            for _ in range(2):
                for m, ref in zip(models, refs, strict=True):
                    torch.testing.assert_close(m(x).cpu(), ref)
        assert [handle(m).compile_count for m in models] == [1] * 10
    finally:
        for m in models:
            release(m, restore=True)


def _assert_nothing_left(model, before, shm_dir, x, ref):
    assert registered_ranges() == before
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(MagiError, match="not offloaded"):
        handle(model)
    assert model.__dict__.get("_compiled_call_impl") is None
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref)  # plain eager module, weights restored
    offload(model, CFG)  # and it can be offloaded again
    release(model, restore=True)
    assert registered_ranges() == before


def test_failure_inside_offload_leaves_nothing_behind(shm_dir, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    before = registered_ranges()
    seen: list[int] = []
    real_compile = api._compile_resolved

    def failing(*args, **kwargs):
        seen.append(len(registered_ranges()))  # the weights are in registered host arenas by now
        real_compile(*args, **kwargs)
        raise RuntimeError("injected failure after compile")

    monkeypatch.setattr(api, "_compile_resolved", failing)
    with pytest.raises(RuntimeError, match="injected"):
        offload(model, CFG)
    assert seen and seen[0] > len(before)
    monkeypatch.setattr(api, "_compile_resolved", real_compile)
    _assert_nothing_left(model, before, shm_dir, x, ref)
    # torch.compile itself refusing the arguments (mode and options together), after the host work
    with pytest.raises(RuntimeError, match="mode or options"):
        offload(model, CFG, mode="max-autotune")
    _assert_nothing_left(model, before, shm_dir, x, ref)


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-1"])
def test_bad_pin_budget_is_a_config_error_and_leaves_nothing(value, shm_dir, monkeypatch):
    model = nn.Linear(8, 8).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    before = registered_ranges()
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", value)
    with pytest.raises(ConfigError, match="MAGI_PIN_BUDGET_GB"):
        offload(model, CFG)
    monkeypatch.delenv("MAGI_PIN_BUDGET_GB")
    _assert_nothing_left(model, before, shm_dir, x, ref)


@contextlib.contextmanager
def _offloaded(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` (in eval mode) offloaded with the default config, released on the way out."""
    offload(model.eval(), OffloadConfig())
    try:
        yield model
    finally:
        release(model)




class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("how", ["buffer_then_to", "device_parameter"])
def test_a_weight_put_on_the_device_after_offload_is_a_clear_error(how, shm_dir, accelerator):
    backend = accelerator
    x = torch.randn(2, 16)
    with _offloaded(_Scaled()) as m, torch.no_grad():
        m(x)
        if how == "buffer_then_to":  # a buffer added after offload, then pipe.to(device) as users do
            m.register_buffer("scale", torch.full((16,), 2.0))
            m.to(backend.device())
            name = "scale"
        else:  # an adapter's weight made on the device
            m.lin.weight = nn.Parameter(torch.ones(16, 16, device=backend.device()))
            name = "lin.weight"
        with pytest.raises(MagiError, match=rf"{name} \({backend.device_type}:0\) is on the device.*Keep them on "
                                            r"the host: assign host tensors"):
            m(x)


class _Codec(nn.Module):
    """A model callers use through another method, as pipelines call a diffusers VAE's ``decode``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        self.dec = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)

    def decode(self, z: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor]:
        return (self.dec(z) * scale,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))[0]


def test_methods_other_than_forward_run_offloaded(shm_dir):
    torch.manual_seed(0)
    m = _Codec().eval()
    ref = _Codec().eval()
    ref.load_state_dict(m.state_dict())
    backend = get_backend()
    offload(m, OffloadConfig(gpu_resident_weight_ratio=0.5), methods=("decode",))
    try:
        h = handle(m)
        assert set(h.methods) == {"decode"} and m.decode is h.methods["decode"]
        z, x = torch.randn(3, 8), torch.randn(3, 16)
        with torch.no_grad():
            for _ in range(4):
                out = m.decode(z, scale=2.0)[0]
                assert out.device.type == backend.device_type  # it ran offloaded, not eagerly on the host
                torch.testing.assert_close(out.cpu(), ref.decode(z, scale=2.0)[0])
                torch.testing.assert_close(m(x).cpu(), ref(x))
            if backend.is_accelerator:  # a device input, as a pipeline hands its latents
                torch.testing.assert_close(m.decode(z.to(backend.device()))[0].cpu(), ref.decode(z)[0])
            m.encode(x)  # not listed: the class's method, eager (its weights are host tensors)
        assert len(h.runtimes) >= 2  # forward's graph and decode's
    finally:
        release(m, restore=True)
    assert "decode" not in m.__dict__ and m.decode.__func__ is _Codec.decode
    with torch.no_grad():
        torch.testing.assert_close(m.decode(z)[0], ref.decode(z)[0])  # eager again, weights kept
    assert list(shm_dir.iterdir()) == []


def test_a_submodule_called_on_its_own_runs_offloaded(shm_dir, accelerator):
    """A submodule called directly with device inputs (as an encoder-decoder's ``generate`` calls the encoder)
    compiles into the model's handle on its first such call and runs offloaded; with host inputs it runs eagerly on
    the host, as before offloading; inside the model's own graph it is traced inline."""
    torch.manual_seed(0)
    m = _Codec().eval()
    ref = _Codec().eval()
    ref.load_state_dict(m.state_dict())
    backend = accelerator
    offload(m, OffloadConfig(gpu_resident_weight_ratio=0.5))
    try:
        h = handle(m)
        assert set(h.submodules) == {"enc", "enc.0", "enc.2", "dec", "dec.0", "dec.2"}  # those holding weights
        x = torch.randn(3, 16)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(m(x).cpu(), ref(x))
            assert all(e.forward is None for e in h.submodules.values()), "traced inline in the model's graph"
            graphs = h.compile_count
            for _ in range(4):
                z = m.enc(x.to(backend.device()))  # a device input: host weights and device inputs meet offloaded
                assert z.device.type == backend.device_type
                torch.testing.assert_close(z.cpu(), ref.enc(x))
            assert h.submodules["enc"].forward is not None and h.compile_count == graphs + 1
            torch.testing.assert_close(m(x).cpu(), ref(x))
            host = m.dec(ref.enc(x))  # host inputs: eager with the host weights, nothing compiled
            assert host.device.type == "cpu" and h.submodules["dec"].forward is None
            torch.testing.assert_close(host, ref.dec(ref.enc(x)))
        assert len(h.runtimes) == 2 and all(s.phase == "planned" for s in h.stats())
    finally:
        release(m, restore=True)
    assert all("_compiled_call_impl" not in mod.__dict__ or mod._compiled_call_impl is None for mod in m.modules())
    with torch.no_grad():
        torch.testing.assert_close(m.enc(x), ref.enc(x))  # eager again, weights kept


def test_an_offloaded_model_nobody_holds_is_collected(shm_dir):
    """The submodules' entries hold the handle weakly: the host weights keep the submodules alive until the model
    goes, so an entry holding the model would keep it, its registered ranges and its files forever."""
    before = registered_ranges()
    m = offload(_Codec().eval(), OffloadConfig())
    x = torch.randn(3, 16)
    with torch.no_grad():
        m(x)
        m.enc(x.to(get_backend().device()))  # a direct call: compiled into the handle on an accelerator
    gone = weakref.ref(m)
    del m
    gc.collect()
    assert gone() is None and registered_ranges() == before


@pytest.mark.parametrize("methods", [("nope",), ("forward",), ("_private",), ("decode", 3)])
def test_methods_that_are_not_methods_are_refused_before_any_host_work(methods, shm_dir):
    m = _Codec().eval()
    before = registered_ranges()
    with pytest.raises(ConfigError, match=r"offload\(methods=\.\.\.\)"):
        offload(m, OffloadConfig(), methods=methods)
    assert registered_ranges() == before and list(shm_dir.iterdir()) == []
    assert "_magi_offload_handle" not in m.__dict__


class _State:
    """State a caller passes in an object of its own (as transformers' KV cache)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class _UsesState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, state: _State) -> torch.Tensor:
        return self.lin(x) + state.keys


def test_device_tensors_inside_an_object_argument_reach_the_forward(shm_dir, accelerator):
    """State held in an object of the caller's (a KV cache) may live on the device: the forward sees it."""
    backend = accelerator
    x = torch.randn(2, 16)
    with _offloaded(_UsesState()) as m, torch.no_grad():
        torch.testing.assert_close(m(x, _State(torch.ones(2, 16))).cpu(), m.lin(x) + 1)  # host state
        state = _State(torch.full((2, 16), 2.0, device=backend.device()))
        out = m(x, state)
        torch.testing.assert_close(out.cpu(), m.lin(x) + 2)
        assert state.keys.device.type == torch.device(backend.device()).type  # the caller's object is left as it was


def test_release_waits_for_the_step_running_and_refuses_later_ones() -> None:
    """A release racing calls: the step running finishes on intact weights (release waits for it), and a call that
    got past the "released" check before the release is refused with the same clear error, not a shape error."""
    import threading

    torch._dynamo.reset()
    model = Stack().eval()
    x = torch.randn(2, 8)
    offload(model, CFG)
    try:
        with torch.no_grad():
            for _ in range(4):
                model(x)
        executor = handle(model).runtime.executor
        step_lock = executor._lock
        step_lock.acquire()  # a step of the model is running
        releaser = threading.Thread(target=release, args=(model,))
        releaser.start()
        releaser.join(timeout=0.5)
        assert releaser.is_alive(), "release must wait for the running step"
        step_lock.release()
        releaser.join(timeout=30)
        assert not releaser.is_alive()
        with pytest.raises(MagiError, match="was released"):
            executor.run((x,), None)  # a call already past the forward's check
        with pytest.raises(MagiError, match="was released"):
            model(x)
    finally:
        release(model)
        torch._dynamo.reset()
