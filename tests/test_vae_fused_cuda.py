"""Fast mode's fused, channels-last VAE decoders and encoders on a GPU (marker: cuda).

* The kernels (``kernels/group_norm.py``, ``kernels/vae_glue.py``) against their references at the FLUX.1
  decoder's shapes and layouts, in float32 and bf16, and deterministic: the same bytes on every call.
* The full-size FLUX.1 decoder (Z-Image's VAE, random weights) fused against diffusers' own: near it
  (PSNR printed), the same bytes replayed from a CUDA graph as called eagerly, and diffusers' bytes
  again once undone.
* Wan's per-pixel RMS norm kernel against its reference, and the full-size Wan 2.1 decoder fused
  (``patches/wan_vae.py``) the same way, over five latent frames; Qwen-Image's decoder on a 1024² image.
* The encoders, fused: FLUX.1's 2-D encoder and Qwen-Image's causal one on a 1024² image, Wan's on 81 frames
  at 832×480, each near diffusers' own and repeating its bytes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels import group_norm as kernel
from bcg_diffusion.kernels import vae_glue
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches.vae import fuse_decoder

pytestmark = pytest.mark.cuda

# (shape, groups, layout): the decoder's resnet widths and sizes at 512², its attention's [N, C, H*W] view,
# and an odd size that fills no tile.
SHAPES = [
    ((1, 512, 64, 64), 32, "channels-last"),
    ((1, 128, 256, 256), 32, "channels-last"),
    ((1, 256, 128, 128), 32, "contiguous"),
    ((1, 512, 64, 64), 32, "channels-innermost"),
    ((2, 64, 30, 17), 32, "channels-last"),
]


def _input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> torch.Tensor:
    x = (torch.randn(*shape, device="cuda") * 2 + 1).to(dtype)
    if layout == "channels-last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "channels-innermost":
        return x.flatten(2).transpose(1, 2).contiguous().transpose(1, 2)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "groups", "layout"), SHAPES)
def test_group_norm_kernel_matches_its_reference_and_repeats_its_bytes(shape, groups, layout, dtype):
    torch.manual_seed(0)
    x = _input(shape, layout, dtype)
    weight, bias, pre_bias = (torch.randn(shape[1], device="cuda").to(dtype) for _ in range(3))
    assert kernel.unsupported(x, groups, weight, bias, pre_bias) is None
    for silu, pre in ((False, None), (True, pre_bias)):
        got = kernel.group_norm(x, groups, weight, bias, 1e-6, pre_bias=pre, silu=silu)
        expected = kernel.reference_group_norm(x, groups, weight, bias, 1e-6, pre_bias=pre, silu=silu)
        assert got.stride() == x.stride()
        # float32: moments in another order; bf16: at most about one step of the dtype
        atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2**-7)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        assert torch.equal(got, kernel.group_norm(x, groups, weight, bias, 1e-6, pre_bias=pre, silu=silu))


@pytest.mark.parametrize("layout", ["channels-last", "contiguous"])
def test_residual_and_upsampling_kernels(layout):
    torch.manual_seed(1)
    hidden, residual = (_input((1, 256, 128, 128), layout, torch.bfloat16) for _ in range(2))
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    for scale in (1.0, 2.0):
        got = vae_glue.residual_sum(hidden, residual, bias, scale)
        assert torch.equal(got, vae_glue.reference_residual_sum(hidden, residual, bias, scale))
    x = _input((1, 512, 64, 64), layout, torch.bfloat16)
    assert torch.equal(vae_glue.upsample_nearest2x(x), F.interpolate(x, scale_factor=2.0, mode="nearest"))


@pytest.fixture(scope="module")
def flux_vae():
    pipe = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16, num_layers=1)
    vae = pipe.vae
    del pipe
    torch.cuda.empty_cache()
    return vae


def _psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    mse = (image.float().clamp(-1, 1) - reference.float().clamp(-1, 1)).pow(2).mean().item()
    return 10 * math.log10(4.0 / mse) if mse else math.inf  # images in [-1, 1]


def _fused_near_eager_and_replayed(vae, latents, fuse):
    """Decode ``latents`` eagerly, then with ``fuse(vae.decoder, patches)``: the fused bytes equal on a second
    call and replayed from a CUDA graph, diffusers' bytes again once undone. Returns (fused, eager, counts)."""
    patches = MethodPatches()
    with torch.no_grad():
        eager_output = vae.decode(latents).sample
        try:
            counts = fuse(vae.decoder, patches)
            fused = vae.decode(latents).sample
            assert torch.equal(fused, vae.decode(latents).sample)
            graph = torch.cuda.CUDAGraph()
            vae.decode(latents)  # warm the allocator's pool on a side stream, as capture expects
            with torch.cuda.graph(graph):
                replayed = vae.decode(latents).sample
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, fused)
        finally:
            patches.undo()
        assert torch.equal(vae.decode(latents).sample, eager_output)
    assert fused.is_contiguous() and fused.shape == eager_output.shape
    return fused, eager_output, counts


@pytest.mark.parametrize("size", [512, 1024])
def test_full_size_decoder_fused_is_near_eager_and_replays_its_bytes(flux_vae, size):
    latents = torch.randn(1, 16, size // 8, size // 8, device="cuda", dtype=torch.bfloat16)
    fused, eager_image, counts = _fused_near_eager_and_replayed(flux_vae, latents, fuse_decoder)
    psnr = _psnr(fused, eager_image)
    difference = (fused.float() - eager_image.float()).abs().max().item()
    print(
        f"\nFLUX.1 decoder {size}² fused {counts}: PSNR {psnr:.1f} dB against eager, max difference {difference:.4f}"
    )
    assert counts["resnets"] == 14 and counts["upsamplers"] == 3
    assert psnr > 35.0, psnr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_rms_norm_kernel_matches_its_reference_and_repeats_its_bytes(dtype):
    # Wan's decoder widths: 96, 192 and 384 channels, a 5-D activation of 4 frames and a 4-D one
    torch.manual_seed(2)
    for shape in ((1, 96, 4, 60, 104), (1, 384, 2, 30, 52), (3, 192, 17, 23)):
        memory_format = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
        x = (torch.randn(*shape, device="cuda") * 2 + 0.5).to(dtype).contiguous(memory_format=memory_format)
        weight, bias, pre_bias = (torch.randn(shape[1], device="cuda").to(dtype) for _ in range(3))
        for b, pre, silu in ((None, pre_bias, True), (bias, None, False)):
            got = vae_glue.channel_rms_norm(x, weight, b, 9.8, silu=silu, pre_bias=pre)
            expected = vae_glue.reference_channel_rms_norm(x, weight, b, 9.8, silu=silu, pre_bias=pre)
            assert got.stride() == x.stride()
            atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2**-7)
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
            assert torch.equal(got, vae_glue.channel_rms_norm(x, weight, b, 9.8, silu=silu, pre_bias=pre))


def test_full_size_wan_decoder_fused_is_near_eager_and_replays_its_bytes():
    from bcg_diffusion.patches.wan_vae import fuse_decoder as fuse_wan_decoder
    from bench.coverage_models import _wan_vae

    vae = _wan_vae(torch.device("cuda")).to(torch.bfloat16)
    # 5 latent frames: the first chunk, the second (whose caches start from one frame) and steady ones
    latents = torch.randn(1, 16, 5, 30, 52, device="cuda", dtype=torch.bfloat16)
    fused, eager_video, counts = _fused_near_eager_and_replayed(vae, latents, fuse_wan_decoder)
    psnr = _psnr(fused, eager_video)
    print(f"\nWan decoder fused {counts}: PSNR {psnr:.1f} dB against eager")
    assert counts["resnets"] == 14 and counts["upsamplers"] == 3
    assert psnr > 35.0, psnr


def test_full_size_qwenimage_decoder_fused_is_near_eager_and_replays_its_bytes():
    """Qwen-Image's VAE (diffusers' copy of Wan 2.1's, its published config with random weights) decoding one
    1024² image, as Qwen-Image and its Edit variants do."""
    from bcg_diffusion.patches.wan_vae import fuse_decoder as fuse_causal_decoder
    from bench.coverage_models import _full_qwen_vae

    vae = _full_qwen_vae(torch.device("cuda")).to(torch.bfloat16)
    latents = torch.randn(1, 16, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    fused, eager_image, counts = _fused_near_eager_and_replayed(vae, latents, fuse_causal_decoder)
    psnr = _psnr(fused, eager_image)
    print(f"\nQwen-Image decoder fused {counts}: PSNR {psnr:.1f} dB against eager")
    assert counts["resnets"] == 14 and counts["upsamplers"] == 3
    assert psnr > 35.0, psnr


def _encoder_near_eager(vae, video: torch.Tensor, fuse, name: str) -> None:
    """Encode ``video`` eagerly, then with ``fuse(vae.encoder, patches)``: the fused latents equal on a second
    call and near eager's (SNR printed, over 30 dB), diffusers' bytes again once undone."""
    patches = MethodPatches()
    with torch.no_grad():
        expected = vae.encode(video).latent_dist.mode()
        try:
            counts = fuse(vae.encoder, patches)
            fused = vae.encode(video).latent_dist.mode()
            assert torch.equal(fused, vae.encode(video).latent_dist.mode())
        finally:
            patches.undo()
        assert torch.equal(vae.encode(video).latent_dist.mode(), expected)
    noise = (fused.float() - expected.float()).pow(2).sum().item()
    snr = 10 * math.log10(expected.float().pow(2).sum().item() / noise)
    print(f"\n{name} encoder fused {counts}: SNR of the latents {snr:.1f} dB against eager")
    assert counts["resnets"] == 10 and fused.shape == expected.shape
    assert snr > 30.0, snr


def _pixels(*shape: int) -> torch.Tensor:
    return (torch.rand(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 2 - 1).bfloat16()


@pytest.mark.parametrize("name", ["Qwen-Image 1024²", "Wan 81 frames"])
def test_full_size_encoder_fused_is_near_eager_and_repeats_its_bytes(name):
    """Qwen-Image-Edit encodes a 1024² image (one frame: every convolution in 2-D), Wan's image-to-video 81 frames
    at 832×480: fused, each near diffusers' own encoder, repeating its bytes."""
    from bcg_diffusion.patches.wan_vae import fuse_encoder
    from bench.coverage_models import _full_qwen_vae, _wan_vae

    qwen = name.startswith("Qwen")
    vae = (_full_qwen_vae if qwen else _wan_vae)(torch.device("cuda")).to(torch.bfloat16)
    _encoder_near_eager(vae, _pixels(1, 3, 1, 1024, 1024) if qwen else _pixels(1, 3, 81, 480, 832), fuse_encoder, name)


def test_full_size_2d_encoder_fused_is_near_eager_and_repeats_its_bytes(flux_vae):
    """FLUX.1 Kontext encodes a 1024² image through FLUX.1's 2-D encoder: fused, near diffusers' own, repeating
    its bytes."""
    from bcg_diffusion.patches.vae import fuse_encoder

    _encoder_near_eager(flux_vae, _pixels(1, 3, 1024, 1024), fuse_encoder, "FLUX.1 1024²")
