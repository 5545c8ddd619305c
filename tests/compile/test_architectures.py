"""Offloading library models of other architectures than the bench's, end to end on the active backend.

Each is a tiny configuration of a real transformers / diffusers class, offloaded with the default config (eager
units, so outputs can be compared closely): every stack of repeated blocks is found and each of its blocks is one
unit, in graph order; no unit holds more weights than the largest block; the output equals the model's own.
The architectures: a joint-attention DiT whose last block differs (SD3), a dual-stream video DiT with a token
refiner (HunyuanVideo), a 3D DiT (CogVideoX), a cross-attention DiT (PixArt), an audio encoder-decoder (Whisper),
a vision-language model (Llava: a CLIP tower and a Llama), GPT-2 (Conv1D weights), Gemma 2 (tied embedding,
sliding window) and a VAE (down / mid / up stacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import magi_core
from magi_core.api import handle


@dataclass
class Case:
    """A model, its call, and the stacks (paths from the model) whose blocks must each be a unit."""

    model: nn.Module
    call: Callable[[nn.Module], Any]
    stacks: tuple[str, ...]


def _first(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _sd3() -> Case:
    diffusers = pytest.importorskip("diffusers")
    m = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=16)
    x, e, p, t = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 16), torch.randn(1, 8), torch.tensor([3.0])
    return Case(m, lambda f: f(hidden_states=x, encoder_hidden_states=e, pooled_projections=p, timestep=t,
                               return_dict=False), ("transformer_blocks",))


def _hunyuan_video() -> Case:
    diffusers = pytest.importorskip("diffusers")
    m = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2, num_single_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    x, e, p = torch.randn(1, 4, 2, 4, 4), torch.randn(1, 5, 16), torch.randn(1, 8)
    mask = torch.ones(1, 5, dtype=torch.bool)
    t, g = torch.tensor([3]), torch.tensor([3500.0])
    return Case(m, lambda f: f(hidden_states=x, timestep=t, encoder_hidden_states=e, encoder_attention_mask=mask,
                               pooled_projections=p, guidance=g, return_dict=False),
                ("transformer_blocks", "single_transformer_blocks"))


def _cogvideox() -> Case:
    diffusers = pytest.importorskip("diffusers")
    m = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=5)
    x, e, t = torch.randn(1, 2, 4, 4, 4), torch.randn(1, 5, 16), torch.tensor([3])
    return Case(m, lambda f: f(hidden_states=x, encoder_hidden_states=e, timestep=t, return_dict=False),
                ("transformer_blocks",))


def _pixart() -> Case:
    diffusers = pytest.importorskip("diffusers")
    m = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, norm_num_groups=4,
        use_additional_conditions=False)
    x, e, t = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 16), torch.tensor([3])
    return Case(m, lambda f: f(x, encoder_hidden_states=e, timestep=t, return_dict=False), ("transformer_blocks",))


def _vae() -> Case:
    diffusers = pytest.importorskip("diffusers")
    m = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=16)
    x = torch.randn(1, 3, 16, 16)
    return Case(m, lambda f: f(x, sample_posterior=False, return_dict=False),
                ("encoder.down_blocks", "decoder.up_blocks"))


def _whisper() -> Case:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, decoder_start_token_id=1)
    feats, dec = torch.randn(1, 8, 32), torch.randint(0, 64, (1, 4))
    return Case(transformers.WhisperForConditionalGeneration(cfg),
                lambda f: f(input_features=feats, decoder_input_ids=dec, use_cache=False, return_dict=False),
                ("model.encoder.layers", "model.decoder.layers"))


def _llava() -> Case:
    transformers = pytest.importorskip("transformers")
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=63,
                                   vision_feature_layer=-1, projector_hidden_act="gelu")
    ids = torch.randint(0, 60, (1, 10))
    ids[0, 1:5] = 63  # one image: (8 / 4) ** 2 patches
    pixels = torch.randn(1, 3, 8, 8)
    return Case(transformers.LlavaForConditionalGeneration(cfg),
                lambda f: f(input_ids=ids, pixel_values=pixels, use_cache=False, return_dict=False),
                ("model.vision_tower.encoder.layers", "model.language_model.layers"))


def _gpt2() -> Case:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2, bos_token_id=0,
                                  eos_token_id=0)
    ids = torch.randint(0, 64, (1, 8))
    return Case(transformers.GPT2LMHeadModel(cfg), lambda f: f(input_ids=ids, use_cache=False, return_dict=False),
                ("transformer.h",))


def _gemma2() -> Case:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4)
    ids = torch.randint(0, 64, (1, 8))
    return Case(transformers.Gemma2ForCausalLM(cfg), lambda f: f(input_ids=ids, use_cache=False, return_dict=False),
                ("model.layers",))


def _stack(model: nn.Module, path: str) -> nn.ModuleList:
    stack = model.get_submodule(path)
    assert isinstance(stack, nn.ModuleList), path
    return stack


CASES: dict[str, Callable[[], Case]] = {
    "sd3": _sd3, "hunyuan_video": _hunyuan_video, "cogvideox": _cogvideox, "pixart": _pixart, "vae": _vae,
    "whisper": _whisper, "llava": _llava, "gpt2": _gpt2, "gemma2": _gemma2,
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_each_block_of_every_stack_is_a_unit_and_outputs_match(name: str) -> None:
    torch.manual_seed(0)
    case = CASES[name]()
    model = case.model.eval()
    block_bytes = {f"{path}.{i}": sum(p.nbytes for p in block.parameters())
                   for path in case.stacks for i, block in enumerate(_stack(model, path))}
    with torch.no_grad():
        reference = _first(case.call(model)).clone()
    offloaded = magi_core.offload(model, magi_core.OffloadConfig(unit_compiler="eager"))
    try:
        with torch.no_grad():
            outs = [_first(case.call(offloaded)) for _ in range(3)]  # warm-up, profile, planned
        for out in outs:  # a device's own kernels (a convolution) may round differently; a stale weight is far off
            torch.testing.assert_close(out.cpu(), reference, rtol=1e-5, atol=1e-5)
        runtimes = handle(offloaded).runtimes
        assert len(runtimes) == 1
        split = runtimes[0].executor.split
        labels = [u.label for u in split.units]
        in_blocks = [label for label in labels if label in block_bytes]
        assert in_blocks == list(block_bytes), labels  # every block one unit, in graph order
        for unit in split.units:
            if unit.label in block_bytes:
                assert unit.nbytes == block_bytes[unit.label], unit.label
        assert all(path in split.containers for path in case.stacks), split.containers
        assert max(u.nbytes for u in split.units) <= max(block_bytes.values()) == split.max_unit_bytes
    finally:
        magi_core.release(offloaded)
