"""Fast mode's Wan and Qwen-Image VAE decoders and encoders (``patches/wan_vae.py``) and their norm kernel's
reference, on the CPU.

* The reference of the per-pixel RMS norm against diffusers' ``WanRMS_norm`` and SiLU, in float64.
* The fused decoder against diffusers' own on tiny Wan 2.1 and Wan 2.2 (residual, patchified) VAEs,
  several chunks so that every cache path runs; its fallbacks; ``undo``. Qwen-Image's the same.
* A single frame after the causal zeros convolved in 2-D (no three-tap 3-D convolution runs for an image).
* The fused encoders (Wan 2.1, Wan 2.2, Qwen-Image) against diffusers' own at one, two and three chunks.
* The features: fast mode's default for a Wan or Qwen-Image pipeline's VAE where the kernels can run (forced
  here), the encoder of an edit pipeline included, and what leaves the encoder alone; Wan's image-to-video
  exact in exact mode, its encoder and decoder fused in fast mode.

The kernels in Triton's interpreter: ``_vae_fused_interpret.py`` (``test_vae_fused.py`` runs it); on a GPU:
``test_vae_fused_cuda.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import vae_decoder
from bcg_diffusion.kernels import vae_glue
from bcg_diffusion.patches.wan_vae import WAN_VAE_FUSED_PATCH, fusable, fuse_decoder

WAN21 = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
# Wan 2.2 TI2V's VAE: residual up blocks (DupUp3D shortcuts), patch size 2, its own decoder width
WAN22 = {**WAN21, "z_dim": 8, "is_residual": True, "patch_size": 2, "in_channels": 12, "out_channels": 12,
         "decoder_base_dim": 12}  # fmt: skip


def _vae(config: dict) -> AutoencoderKLWan:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for parameter in vae.parameters():  # away from the initialisation's ones and zeros
            parameter.normal_(0.0, 0.3)
    return vae


def _latents(vae: AutoencoderKLWan, frames: int = 4) -> torch.Tensor:
    return torch.randn(1, vae.config.z_dim, frames, 4, 6, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("images", [False, True])
def test_reference_channel_norm_is_diffusers_rms_norm_with_silu(images):
    torch.manual_seed(0)
    norm = WanRMS_norm(12, images=images, bias=True).double()
    with torch.no_grad():
        norm.gamma.normal_()
        norm.bias.normal_()
    shape = (2, 12, 5, 4) if images else (2, 12, 3, 5, 4)
    x = torch.randn(*shape, dtype=torch.float64) * 3
    channels_last = x.contiguous(memory_format=torch.channels_last if images else torch.channels_last_3d)
    with torch.no_grad():
        got = vae_glue.channel_rms_norm(x, norm.gamma, norm.bias, norm.scale, silu=True)
        torch.testing.assert_close(got, F.silu(norm(x)), atol=1e-5, rtol=1e-5)  # float32 inside, as on the GPU
        plain = vae_glue.channel_rms_norm(channels_last, norm.gamma, None, norm.scale)
    assert plain.stride() == channels_last.stride()


def test_channel_norm_refuses_a_wrong_weight_and_autograd():
    with pytest.raises(ValueError, match="weight of 3 values for an input of 4 channels"):
        vae_glue.channel_rms_norm(torch.randn(1, 4, 2, 2), torch.ones(3))
    with pytest.raises(ValueError, match="no backward"):
        vae_glue.channel_rms_norm(torch.randn(1, 4, 2, 2, requires_grad=True), torch.ones(4))


@pytest.mark.parametrize("config", [WAN21, WAN22], ids=["Wan 2.1", "Wan 2.2 TI2V"])
def test_fused_decoder_decodes_as_diffusers_and_undo_gives_everything_back(config):
    vae = _vae(config)
    latents = _latents(vae)
    with torch.no_grad():
        expected = vae.decode(latents).sample
        patches = MethodPatches()
        counts = fuse_decoder(vae.decoder, patches)
        got = vae.decode(latents).sample
        assert got.is_contiguous()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)  # float32, rounded elsewhere
        patches.undo()
        assert torch.equal(vae.decode(latents).sample, expected)
    # every upsampler, residual block and causal convolution of the decoder; the mid block's attention norm
    assert counts["upsamplers"] == 3 and counts["norms"] == 1 and counts["resnets"] == 10
    assert not any("forward" in module.__dict__ for module in vae.decoder.modules())


def test_fused_decoder_in_bfloat16_is_as_near_float32_as_diffusers():
    vae = _vae(WAN21)
    latents = _latents(vae)
    with torch.no_grad():
        exact = vae.decode(latents).sample
        vae.to(torch.bfloat16)
        eager = vae.decode(latents.bfloat16()).sample.float()
        fuse_decoder(vae.decoder, MethodPatches())
        fused = vae.decode(latents.bfloat16()).sample.float()
    # rounded once per norm instead of after every operator: no farther from float32 than eager bf16
    assert (fused - exact).abs().mean() <= (eager - exact).abs().mean()


def test_fused_forwards_run_the_original_under_autograd():
    vae = _vae(WAN21)
    latents = _latents(vae, frames=2)
    expected = vae.decode(latents).sample
    fuse_decoder(vae.decoder, MethodPatches())
    with torch.enable_grad():
        assert torch.equal(vae.decode(latents).sample, expected)


def test_fuse_decoder_refuses_another_decoder_or_a_changed_one():
    with pytest.raises(ValueError, match="not diffusers' WanDecoder3d"):
        fuse_decoder(torch.nn.Linear(2, 2), MethodPatches())
    vae = _vae(WAN21)
    assert fusable(vae.decoder)
    vae.decoder.up_blocks[0].resnets[0].forward = lambda *args, **kwargs: None
    assert not fusable(vae.decoder)


@pytest.mark.filterwarnings("ignore:.*falls back to graphs of the eager blocks")  # the VAE alone, on purpose
@pytest.mark.filterwarnings("ignore:.*no adapter for WanPipeline")
def test_fast_mode_fuses_a_wan_pipelines_decoder_and_replays_its_bytes(monkeypatch):
    from bench.coverage import _call
    from bench.coverage_models import TINY

    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: None)  # the references run
    pipe, inputs = TINY["Wan 2.1 T2V"]()
    with torch.no_grad():
        plain = _call(pipe, inputs)
    accelerate(pipe, mode="fast", components=("vae",), debug=True)
    try:
        assert WAN_VAE_FUSED_PATCH in stats(pipe)["patches"]
        fast = _call(pipe, inputs)
        with eager(pipe):  # the fused decoder without graphs: what fast mode must equal
            assert torch.equal(fast, _call(pipe, inputs))
        torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    finally:
        restore(pipe)
    assert not any("forward" in module.__dict__ for module in pipe.vae.decoder.modules())


# -- Qwen-Image's VAE: diffusers' copy of Wan 2.1's under other names -------------------------------------

QWEN = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}


def _qwen_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**QWEN).eval()
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.normal_(0.0, 0.3)
    return vae


@pytest.mark.parametrize("frames", [1, 3], ids=["an image", "a video"])
def test_fused_qwenimage_decoder_decodes_as_diffusers_and_undo_gives_everything_back(frames):
    """Qwen-Image decodes one latent frame (an image); the cache paths of several frames run too."""
    from bcg_diffusion.patches.wan_vae import qwenimage_fusable

    vae = _qwen_vae()
    latents = torch.randn(1, QWEN["z_dim"], frames, 4, 6, generator=torch.Generator().manual_seed(1))
    assert qwenimage_fusable(vae.decoder) and not fusable(vae.decoder)
    assert not qwenimage_fusable(_vae(WAN21).decoder)
    with torch.no_grad():
        expected = vae.decode(latents).sample
        patches = MethodPatches()
        counts = fuse_decoder(vae.decoder, patches)
        got = vae.decode(latents).sample
        assert got.is_contiguous()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)  # float32, rounded elsewhere
        with torch.enable_grad():  # the originals under autograd
            assert torch.equal(vae.decode(latents).sample, expected)
        patches.undo()
        assert torch.equal(vae.decode(latents).sample, expected)
    assert counts["upsamplers"] == 3 and counts["norms"] == 1 and counts["resnets"] == 10
    assert not any("forward" in module.__dict__ for module in vae.decoder.modules())
    vae.decoder.up_blocks[0].resnets[0].forward = lambda *args, **kwargs: None
    assert not qwenimage_fusable(vae.decoder)


@pytest.mark.filterwarnings("ignore:.*falls back to graphs of the eager blocks")  # the VAE alone, on purpose
def test_fast_mode_fuses_a_qwenimage_pipelines_decoder_and_replays_its_bytes(monkeypatch):
    from _cases import tiny_pipeline

    from bcg_diffusion.patches.wan_vae import QWENIMAGE_VAE_FUSED_PATCH

    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: None)  # the references run
    pipe = tiny_pipeline("qwen-image")

    def call() -> torch.Tensor:
        return pipe(prompt="a fox", height=32, width=32, num_inference_steps=2, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images  # fmt: skip

    plain = call()
    accelerate(pipe, mode="fast", components=("vae",), debug=True)
    try:
        assert QWENIMAGE_VAE_FUSED_PATCH in stats(pipe)["patches"]
        fast = call()
        with eager(pipe):  # the fused decoder without graphs: what fast mode must equal
            assert torch.equal(fast, call())
        torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    finally:
        restore(pipe)
    assert not any("forward" in module.__dict__ for module in pipe.vae.decoder.modules())


# -- a single frame convolved in 2-D; the encoder ---------------------------------------------------------


def _time_taps(monkeypatch) -> list[int]:
    """The time extent of every 3-D convolution's kernel from now on (diffusers' and ours)."""
    taps: list[int] = []
    conv3d = F.conv3d

    def counting(x, weight, *args, **kwargs):
        taps.append(weight.shape[2])
        return conv3d(x, weight, *args, **kwargs)

    monkeypatch.setattr(F, "conv3d", counting)
    return taps


def test_a_single_frame_after_the_causal_zeros_convolves_in_2d(monkeypatch):
    """An image meets only each kernel's last time tap: no 3-D convolution with three taps runs for it, and the
    decode still equals diffusers'; a video's later chunks (cached frames before them) stay 3-D."""
    vae = _qwen_vae()
    image = torch.randn(1, QWEN["z_dim"], 1, 4, 6, generator=torch.Generator().manual_seed(1))
    video = torch.randn(1, QWEN["z_dim"], 3, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.decode(image).sample
        fuse_decoder(vae.decoder, MethodPatches())
        taps = _time_taps(monkeypatch)
        got = vae.decode(image).sample
        assert 3 not in taps
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        vae.decode(video)
        assert 3 in taps


ENCODERS = {"Wan 2.1": ("wan", WAN21), "Wan 2.2 TI2V": ("wan", WAN22), "Qwen-Image": ("qwen", QWEN)}


def _any_vae(kind: str, config: dict) -> torch.nn.Module:
    return _vae(config) if kind == "wan" else _qwen_vae()


@pytest.mark.parametrize("frames", [1, 5, 9], ids=["an image", "two chunks", "three chunks"])
@pytest.mark.parametrize("name", list(ENCODERS))
def test_fused_encoder_encodes_as_diffusers_and_undo_gives_everything_back(name, frames):
    from bcg_diffusion.patches.wan_vae import encoder_fusable, fuse_encoder, qwenimage_encoder_fusable

    kind, config = ENCODERS[name]
    vae = _any_vae(kind, config)
    assert (encoder_fusable if kind == "wan" else qwenimage_encoder_fusable)(vae.encoder)
    assert not (qwenimage_encoder_fusable if kind == "wan" else encoder_fusable)(vae.encoder)
    video = torch.randn(1, 3, frames, 32, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.encode(video).latent_dist.mode()
        patches = MethodPatches()
        counts = fuse_encoder(vae.encoder, patches)
        got = vae.encode(video).latent_dist.mode()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)  # float32, rounded elsewhere
        with torch.enable_grad():  # the originals under autograd
            assert torch.equal(vae.encode(video).latent_dist.mode(), expected)
        patches.undo()
        assert torch.equal(vae.encode(video).latent_dist.mode(), expected)
    assert counts == {"resnets": 6, "norms": 1, "convs": 17}  # the mid block's attention norm; its 2 + 4 resnets
    assert not any("forward" in module.__dict__ for module in vae.encoder.modules())


def test_fuse_encoder_refuses_another_encoder_or_a_changed_one():
    from bcg_diffusion.patches.wan_vae import encoder_fusable, fuse_encoder

    with pytest.raises(ValueError, match="not diffusers' WanEncoder3d"):
        fuse_encoder(_vae(WAN21).decoder, MethodPatches())
    vae = _vae(WAN21)
    vae.encoder.down_blocks[0].forward = lambda *args, **kwargs: None
    assert not encoder_fusable(vae.encoder)


@pytest.mark.filterwarnings("ignore:.*falls back to graphs of the eager blocks")  # the VAE alone, on purpose
@pytest.mark.filterwarnings("ignore:.*outside the tested set")
def test_fast_mode_fuses_an_edit_pipelines_encoder_and_restore_gives_it_back(monkeypatch):
    """Qwen-Image-Edit encodes its input image on every call: fast mode's encoder is fused (the decoder's
    graphs do not serve that call), each call equal to the same fused code without graphs."""
    from test_vae_fused import check_fast_mode_fuses_the_encoder

    from bcg_diffusion.features import vae_encoder
    from bcg_diffusion.patches.wan_vae import QWENIMAGE_VAE_ENCODER_FUSED_PATCH
    from bench.coverage_models import TINY

    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: None)  # the references run
    monkeypatch.setattr(vae_encoder, "triton_unavailable", lambda device: None)
    pipe, inputs = TINY["Qwen-Image Edit Plus"]()
    check_fast_mode_fuses_the_encoder(pipe, inputs, QWENIMAGE_VAE_ENCODER_FUSED_PATCH, coder_forward=True)
    for options in ({"mode": "exact"}, {"mode": "fast", "components": ("transformer",)}):
        accelerate(pipe, debug=True, **options)
        try:  # exact mode, and fast mode without the VAE, leave the encoder alone
            assert "forward" not in pipe.vae.encoder.__dict__
        finally:
            restore(pipe)
    vae_decoder.choose(pipe.vae, "patched")  # the encoder follows the decoder's choice
    accelerate(pipe, mode="fast", components=("vae",), debug=True)
    try:
        assert "forward" not in pipe.vae.encoder.__dict__
    finally:
        restore(pipe)


def _wan_image_to_video() -> tuple[Any, Callable[[], torch.Tensor]]:
    """A tiny Wan image-to-video pipeline (Wan 2.2 A14B's kind: the image conditions through the latents' channels,
    no image encoder) and a call of it on a fixed image and fixed prompt embeddings."""
    import numpy as np
    import PIL.Image
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=12, out_channels=4, text_dim=32, freq_dim=16,
        ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )  # fmt: skip
    vae = AutoencoderKLWan(**{**WAN21, "dim_mult": [1, 1, 1, 1], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4})
    pipe = WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))

    def call() -> torch.Tensor:
        embeds = [torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
        return pipe(image=image, prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=32, width=32,
                    num_frames=5, num_inference_steps=2, guidance_scale=4.0, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).frames  # fmt: skip

    return pipe, call


@pytest.mark.filterwarnings("ignore:.*no adapter for WanImageToVideoPipeline")
@pytest.mark.filterwarnings("ignore:.*falls back to graphs of the eager blocks")  # the VAE alone, on purpose
def test_wan_image_to_video_is_exact_and_fast_mode_fuses_its_encoder(monkeypatch):
    """Wan's image-to-video encodes the first frame and the zeros after it on every call: exact mode replays
    eager's bytes with the encode left eager, and fast mode fuses the encoder as well as the decoder."""
    from bcg_diffusion.features import vae_encoder
    from bcg_diffusion.patches.wan_vae import WAN_VAE_ENCODER_FUSED_PATCH

    pipe, call = _wan_image_to_video()
    with torch.no_grad():
        plain = call()
    accelerate(pipe, debug=True)
    try:
        assert torch.equal(call(), plain) and stats(pipe)["replays"] > 0
        assert "forward" not in pipe.vae.encoder.__dict__
    finally:
        restore(pipe)
    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: None)  # the references run
    monkeypatch.setattr(vae_encoder, "triton_unavailable", lambda device: None)
    accelerate(pipe, mode="fast", components=("vae",), debug=True)
    try:
        assert {WAN_VAE_FUSED_PATCH, WAN_VAE_ENCODER_FUSED_PATCH} <= set(stats(pipe)["patches"])
        fast = call()
        with eager(pipe):
            assert torch.equal(fast, call())
        torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    finally:
        restore(pipe)
