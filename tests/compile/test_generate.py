"""transformers' ``generate`` with a KV cache on offloaded language models: greedy tokens as eager, bounded compiles.

Tiny random float32 models (no downloads): a Llama and a Mixtral-style MoE, with the default ``DynamicCache`` (grown
by concatenation, its tensors assigned to the cache's attributes) and ``cache_implementation="static"`` (a
``StaticCache``: preallocated tensors written in place with ``index_copy_``), batch 1 and batch 2 with left padding.
The reference is eager ``generate`` on the same device. On an accelerator backend (magidev) the cache holds device
tensors, handed to the compiled forward as host proxies; on the CPU backend every tensor argument, the cache's
included, is made to count as a device tensor, so the same hand-over runs there too. Proxies are filled with NaN (and
integer proxies with an index no lookup takes): a read of one would change the tokens.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from magi_core.api import handle, offload, release
from magi_core.compile.device_inputs import ProxyPool
from magi_core.config import OffloadConfig
from magi_core.errors import ConfigError
from magi_core.plugin.manager import get_backend

transformers = pytest.importorskip("transformers", minversion="5.0")

CFG = OffloadConfig(unit_compiler="eager", warmup_calls=2)
#: Enough new tokens that a compile per token would show (32 or more).
LONG = 33


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _config(kind: str) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if get_backend().is_accelerator:
        # the default experts code (grouped_mm) counts tokens per expert with an integer histc off the host, which
        # the emulated magidev device (host kernels) cannot run eagerly: the reference would fail, not the offload
        cfg._experts_implementation = "batched_mm"
    return cfg


def _models(kind: str) -> tuple[Any, Any]:
    """(the model to offload, its eager twin on the backend's device), the same random weights."""
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MixtralForCausalLM
    return _twins(cls, _config(kind))


def _twins(cls: Any, cfg: Any) -> tuple[Any, Any]:
    """A model of ``cls`` on the host and its eager twin built on the backend's device, the same random weights."""
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.device(get_backend().device()):
        ref = cls(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask; with batch 2 the second row is left-padded by three tokens."""
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (batch, 7))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids, mask


def _proxies_everywhere(model: Any) -> None:
    """NaN proxies; on the CPU backend every tensor argument of more than 0 dims counts as a device tensor."""
    fwd = handle(model).forward
    assert fwd is not None
    fwd.pool = ProxyPool(fill_value=math.nan)
    if not get_backend().is_accelerator:
        fwd.is_device = lambda t: t.dim() > 0


def _cache_kw(model: Any, cache: Any) -> dict[str, Any]:
    """The cache as the model's forward names it (``cache``, or ``past_key_values`` in earlier transformers)."""
    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _cache_out(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    return [v for layer in cache.layers for v in vars(layer).values() if isinstance(v, torch.Tensor)]


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
    device = get_backend().device()
    with torch.no_grad():
        return model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              return_dict_in_generate=True, **kw)


@pytest.mark.parametrize(
    ("kind", "cache", "batch", "new_tokens", "compiles"),
    [
        pytest.param("llama", "dynamic", 1, LONG, 3, id="llama-dynamic-b1"),
        pytest.param("llama", "static", 2, LONG, 2, id="llama-static-b2-left-padded"),
        pytest.param("llama", "dynamic", 2, 6, None, id="llama-dynamic-b2-left-padded"),
        pytest.param("mixtral", "dynamic", 2, 6, None, id="mixtral-dynamic-b2-left-padded"),
        pytest.param("mixtral", "static", 1, 6, None, id="mixtral-static-b1"),
    ],
)
def test_greedy_generate_with_a_kv_cache_matches_eager(kind: str, cache: str, batch: int, new_tokens: int,
                                                       compiles: int | None) -> None:
    """Same tokens as eager ``generate``; prefill and decode are two graphs (a ``DynamicCache``'s growing length
    becomes dynamic at its second length: one more), not one per token; the cache holds the caller's tensors."""
    model, ref = _models(kind)
    ids, mask = _prompt(batch)
    kw: dict[str, Any] = {"max_new_tokens": new_tokens}
    if cache == "static":
        kw["cache_implementation"] = "static"
    expected = _generate(ref, ids, mask, **kw).sequences.cpu()
    offload(model, CFG)
    try:
        _proxies_everywhere(model)
        out = _generate(model, ids, mask, **kw)
        torch.testing.assert_close(out.sequences.cpu(), expected, rtol=0, atol=0)
        h = handle(model)
        fwd = h.forward
        assert fwd is not None and fwd.substituted_calls >= new_tokens - 1, "the cache was handed over each step"
        if compiles is not None:
            assert h.compile_count == compiles
        backend = get_backend()
        tensors = _cache_tensors(_cache_out(out))
        proxies = {id(p) for p in fwd.pool.proxies()}
        assert tensors and not any(id(t) in proxies for t in tensors), "no proxy left in the cache"
        if backend.is_accelerator:
            kv = [t for t in tensors if t.dim() == 4]
            assert kv and all(t.device.type == backend.device_type for t in kv)
    finally:
        release(model, restore=True)


def test_inductor_units_serve_every_length_of_a_growing_cache() -> None:
    """With Inductor units (the accelerator default), the decode graph Dynamo made dynamic in the cache's length runs
    every step with one compiled code per unit: eager's tokens, no compile per token."""
    try:
        get_backend().resolve_unit_compiler("inductor")
    except ConfigError as e:
        pytest.skip(str(e))
    model, ref = _models("llama")
    ids, mask = _prompt(1)
    expected = _generate(ref, ids, mask, max_new_tokens=12).sequences.cpu()
    offload(model, OffloadConfig(unit_compiler="inductor", warmup_calls=2))
    try:
        for _ in range(2):  # again: the graphs and their units are reused
            out = _generate(model, ids, mask, max_new_tokens=12)
            torch.testing.assert_close(out.sequences.cpu(), expected, rtol=0, atol=0)
        h = handle(model)
        assert h.compile_count == 3
        per_graph = [rt.executor.compiled_units.compiles for rt in h.runtimes]
        assert sum(per_graph) <= 3 * len(h.runtimes) + 6, per_graph  # a few unit structures per graph, not per token
    finally:
        release(model, restore=True)


def _seq2seq(kind: str) -> tuple[Any, Any]:
    """(an encoder-decoder to offload, its eager twin on the backend's device), the same random weights."""
    if kind == "t5":
        cls: Any = transformers.T5ForConditionalGeneration
        cfg: Any = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2,
                                         num_heads=4, d_kv=16, decoder_start_token_id=0, pad_token_id=0,
                                         eos_token_id=None)
    else:
        cls = transformers.BartForConditionalGeneration
        cfg = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                      decoder_ffn_dim=128, max_position_embeddings=64, eos_token_id=None,
                                      forced_eos_token_id=None)
    return _twins(cls, cfg)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate_runs_the_encoder_offloaded(kind: str, cache: str) -> None:
    """An encoder-decoder's ``generate`` calls the encoder on its own, then the model for each token: on a device of
    its own the encoder's direct call (device inputs, host weights) runs offloaded too, and the scores of every step
    are eager's."""
    model, ref = _seq2seq(kind)
    ids, mask = _prompt(2)
    kw: dict[str, Any] = {"max_new_tokens": 6, "output_scores": True}
    if cache == "static":
        kw["cache_implementation"] = "static"
    expected = _generate(ref, ids, mask, **kw)
    offload(model, CFG)
    try:
        for _ in range(2):
            out = _generate(model, ids, mask, **kw)
            torch.testing.assert_close(out.sequences.cpu(), expected.sequences.cpu(), rtol=0, atol=0)
            for got, want in zip(out.scores, expected.scores, strict=True):
                torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)
        h = handle(model)
        encoder = model.get_encoder()
        (path,) = [p for p, entry in h.submodules.items() if entry.module is encoder]
        on_device = get_backend().is_accelerator  # else the host is the device: the encoder runs eagerly there
        assert (h.submodules[path].forward is not None) == on_device, "the encoder's direct call ran offloaded"
        assert all(e.forward is None for p, e in h.submodules.items() if p != path), "nothing else ran on its own"
    finally:
        release(model, restore=True)
    assert encoder.__dict__.get("_compiled_call_impl") is None, "release(restore=True) gives the eager call back"


def test_static_cache_is_written_in_place_across_steps() -> None:
    """A ``StaticCache`` passed by the caller keeps its preallocated tensors: every decode step writes into the same
    device tensors (no copy of the cache per step), and they end up holding what eager generate's cache holds."""
    model, ref = _models("llama")
    ids, mask = _prompt(1)
    device = get_backend().device()
    n = 5
    ref_cache = transformers.StaticCache(config=ref.config, max_cache_len=ids.shape[1] + n)
    expected = _generate(ref, ids, mask, max_new_tokens=n, **_cache_kw(ref, ref_cache))
    offload(model, CFG)
    try:
        _proxies_everywhere(model)
        cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + n)
        with torch.no_grad():  # the prefill alone: the cache's tensors are made, on the device
            model(ids.to(device), attention_mask=mask.to(device), **_cache_kw(model, cache), use_cache=True)
        first = [(layer.keys, layer.values) for layer in cache.layers]
        cache.reset()  # back to empty: zeroed in place, the same tensors kept
        out = _generate(model, ids, mask, max_new_tokens=n, **_cache_kw(model, cache))
        torch.testing.assert_close(out.sequences.cpu(), expected.sequences.cpu(), rtol=0, atol=0)
        for (keys, values), layer, ref_layer in zip(first, cache.layers, ref_cache.layers, strict=True):
            assert layer.keys is keys and layer.values is values, "the same tensors, written in place"
            assert keys.device.type == device.type
            torch.testing.assert_close(keys.cpu(), ref_layer.keys.cpu())
            torch.testing.assert_close(values.cpu(), ref_layer.values.cpu())
    finally:
        release(model, restore=True)


def test_plain_generate_on_the_backend_as_users_run_it() -> None:
    """No test hooks: the default forward (on the CPU backend nothing is proxied) generates eager's tokens."""
    model, ref = _models("llama")
    ids, mask = _prompt(2)
    expected = _generate(ref, ids, mask, max_new_tokens=6).sequences.cpu()
    offload(model, CFG)
    try:
        out = _generate(model, ids, mask, max_new_tokens=6)
        torch.testing.assert_close(out.sequences.cpu(), expected, rtol=0, atol=0)
    finally:
        release(model, restore=True)


def test_static_cache_generate_after_a_new_prompt_length() -> None:
    """A second prompt length makes the prefill dynamic (one more graph each for prefill and decode, then none)."""
    model, ref = _models("llama")
    offload(model, CFG)
    try:
        _proxies_everywhere(model)
        for length in (7, 9, 5):
            torch.manual_seed(length)
            ids = torch.randint(1, 128, (1, length))
            mask = torch.ones_like(ids)
            kw: dict[str, Any] = {"max_new_tokens": 6, "cache_implementation": "static"}
            expected = _generate(ref, ids, mask, **kw).sequences.cpu()
            out = _generate(model, ids, mask, **kw)
            torch.testing.assert_close(out.sequences.cpu(), expected, rtol=0, atol=0)
        assert handle(model).compile_count == 4
    finally:
        release(model, restore=True)
