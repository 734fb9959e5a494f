"""Fast mode's fused, channels-last 2-D VAE decoder and encoder (``patches/vae.py``) and their kernels, on the
CPU.

* The Triton kernels in Triton's interpreter (``_vae_fused_interpret.py``, a process of its own) against
  their references, and a tiny decoder with the kernels forced on against diffusers' own.
* The references against PyTorch's modules (group norm, SiLU, the resnet's residual), in float64.
* The patched forwards against diffusers' original forwards (the references run on the CPU), their
  fallbacks to the original, and ``undo``.
* The feature: fast mode's default where the kernels can run (forced here), leaving the weights and a
  module sharing them as they were, and the other choices; the encoder of an image-conditioned pipeline
  (FLUX.1 Kontext) fused too.

The kernels on a GPU: ``test_vae_fused_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _checks import needs_triton, run_interpreted

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import vae_decoder, vae_encoder
from bcg_diffusion.kernels import group_norm as kernel
from bcg_diffusion.kernels import vae_glue
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import vae as vae_decoder_patch
from bcg_diffusion.patches.group_norm import VAE_GROUP_NORM_PATCH
from bcg_diffusion.patches.vae import VAE_ENCODER_FUSED_PATCH, VAE_FUSED_PATCH, fuse_decoder, fuse_encoder


@needs_triton
def test_kernels_in_the_interpreter_match_their_references():
    run_interpreted("_vae_fused_interpret.py")


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_reference_group_norm_is_pytorch_group_norm_with_bias_and_silu(memory_format):
    torch.manual_seed(0)
    x = (torch.randn(2, 12, 5, 4, dtype=torch.float64) * 4 + 3).contiguous(memory_format=memory_format)
    weight, bias, pre_bias = torch.randn(3, 12, dtype=torch.float64)
    expected = F.silu(F.group_norm(x + pre_bias.view(1, -1, 1, 1), 3, weight, bias, 1e-6))
    got = kernel.group_norm(x, 3, weight, bias, 1e-6, pre_bias=pre_bias, silu=True)
    # float32 inside, as on the GPU
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.dtype == x.dtype and got.stride() == x.stride()
    plain = kernel.group_norm(x.float(), 3)
    torch.testing.assert_close(plain, F.group_norm(x.float(), 3), atol=1e-5, rtol=1e-5)


def test_group_norm_refuses_bad_groups_and_autograd():
    with pytest.raises(ValueError, match="6 channels cannot be split into 4 groups"):
        kernel.group_norm(torch.randn(1, 6, 2, 2), 4)
    with pytest.raises(ValueError, match="no backward"):
        kernel.group_norm(torch.randn(1, 4, 2, 2, requires_grad=True), 2)


def test_what_the_kernels_refuse_is_named():
    x = torch.randn(1, 12, 4, 4)
    assert kernel.unsupported(x, 4) == "3 channels per group is not a power of two"
    assert kernel.unsupported(x.to(torch.int32), 4).startswith("dtype")
    assert "dense" in kernel.unsupported(torch.randn(1, 8, 4, 8)[..., ::2], 4)
    assert kernel.unsupported(torch.randn(1, 8, 4, 4), 4, weight=torch.randn(4)).startswith("weight")
    assert kernel.unsupported(torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last), 4) is None


def test_residual_sum_and_upsampling_match_pytorch():
    hidden, residual = torch.randn(2, 1, 4, 3, 5, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(
        vae_glue.residual_sum(hidden, residual, bias, 2.0), (residual + hidden + bias.view(1, -1, 1, 1)) / 2
    )
    with pytest.raises(ValueError, match="no backward"):
        vae_glue.residual_sum(hidden.clone().requires_grad_(), residual)
    with pytest.raises(ValueError, match="one \\[N, C, \\*\\] shape"):
        vae_glue.residual_sum(hidden, residual[:, :2])
    x = torch.randn(1, 4, 3, 5).contiguous(memory_format=torch.channels_last)
    assert torch.equal(vae_glue.upsample_nearest2x(x), F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _vae():
    vae = build_pipeline("z-image", "tiny").vae.eval()
    torch.manual_seed(1)
    for module in vae.modules():  # norms and biases away from their defaults: their use is checked
        if isinstance(module, (torch.nn.GroupNorm, torch.nn.Conv2d)) and module.bias is not None:
            module.bias.data.normal_(0, 0.5)
        if isinstance(module, torch.nn.GroupNorm):
            module.weight.data.normal_(1, 0.5)
    return vae


def _latents(vae, size: int = 8) -> torch.Tensor:
    return torch.randn(1, vae.config.latent_channels, size, size, generator=torch.Generator().manual_seed(0))


def test_fused_decoder_decodes_as_diffusers_and_undo_gives_everything_back():
    vae = _vae()
    latents = _latents(vae)
    resnets = [m for m in vae.decoder.modules() if type(m).__name__ == "ResnetBlock2D"]
    shortcuts = sum(m.conv_shortcut is not None for m in resnets)
    with torch.no_grad():
        original = vae.decode(latents).sample
        patches = MethodPatches()
        counts = fuse_decoder(vae.decoder, patches)
        fused = vae.decode(latents).sample
        fused_again = vae.decode(latents).sample
        weights = [p for p in vae.decoder.parameters() if p.dim() == 4]
        patches.undo()
        restored = vae.decode(latents).sample
    upsamplers = sum(type(m).__name__ == "Upsample2D" for m in vae.decoder.modules())
    assert counts == {"resnets": len(resnets), "upsamplers": upsamplers, "norms": 2} and shortcuts > 0, counts
    assert weights and all(w.is_contiguous() for w in weights)  # never changed: other modules may share them
    torch.testing.assert_close(fused, original, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused, fused_again) and fused.is_contiguous()
    assert torch.equal(restored, original)
    assert not any("forward" in m.__dict__ for m in vae.decoder.modules())


def test_fused_forwards_run_the_original_outside_their_plain_form(monkeypatch):
    vae = _vae()
    resnet = next(m for m in vae.decoder.modules() if type(m).__name__ == "ResnetBlock2D")
    upsampler = next(m for m in vae.decoder.modules() if type(m).__name__ == "Upsample2D")
    x = torch.randn(1, resnet.in_channels, 4, 4)
    up_x = torch.randn(1, upsampler.channels, 4, 4)
    upsample = vae_decoder_patch.upsample_nearest2x

    def no_autograd(x: torch.Tensor) -> torch.Tensor:  # the kernel has no backward: never under autograd
        assert not torch.is_grad_enabled(), "the upsampling kernel ran with autograd on"
        return upsample(x)

    monkeypatch.setattr(vae_decoder_patch, "upsample_nearest2x", no_autograd)
    patches = MethodPatches()
    fuse_decoder(vae.decoder, patches)
    try:
        with torch.no_grad():
            resnet.output_scale_factor = 2.0  # read on every call, as diffusers' forward reads it
            expected = type(resnet).forward(resnet, x, None)
            torch.testing.assert_close(resnet(x), expected, atol=1e-5, rtol=1e-5)
            expected_up = type(upsampler).forward(upsampler, up_x, (6, 6))
            assert torch.equal(upsampler(up_x, output_size=(6, 6)), expected_up)  # not ×2: the original
        with torch.enable_grad():  # autograd: the original forwards, which have a backward
            y = resnet(x.requires_grad_())
            y.sum().backward()
            assert x.grad is not None
            z = upsampler(up_x.contiguous(memory_format=torch.channels_last).requires_grad_())
            assert z.requires_grad
    finally:
        patches.undo()


def test_fuse_decoder_refuses_another_decoder():
    with pytest.raises(ValueError, match="2-D VAE Decoder"):
        fuse_decoder(torch.nn.Linear(2, 2), MethodPatches())
    with pytest.raises(ValueError, match="2-D VAE Encoder"):
        fuse_encoder(_vae().decoder, MethodPatches())


def test_fused_encoder_encodes_as_diffusers_and_undo_gives_everything_back():
    vae = _vae()
    image = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    resnets = [m for m in vae.encoder.modules() if type(m).__name__ == "ResnetBlock2D"]
    with torch.no_grad():
        original = vae.encode(image).latent_dist.mode()
        patches = MethodPatches()
        counts = fuse_encoder(vae.encoder, patches)
        fused = vae.encode(image).latent_dist.mode()
        assert torch.equal(fused, vae.encode(image).latent_dist.mode())
        patches.undo()
        assert torch.equal(vae.encode(image).latent_dist.mode(), original)
    assert counts == {"resnets": len(resnets), "upsamplers": 0, "norms": 2}, counts
    torch.testing.assert_close(fused, original, atol=1e-5, rtol=1e-5)
    assert not any("forward" in m.__dict__ for m in vae.encoder.modules())


@pytest.mark.filterwarnings("ignore:.*falls back to graphs of the eager blocks")  # the VAE alone, on purpose
def test_fast_mode_fuses_an_image_conditioned_pipelines_encoder(kernels_available, monkeypatch):
    """FLUX.1 Kontext encodes its input image on every call, outside the decoder's graphs: fast mode fuses
    the encoder, each call equal to the same fused code without graphs and near eager."""
    from bench.coverage_models import TINY

    monkeypatch.setattr(vae_encoder, "triton_unavailable", lambda device: None)
    pipe, inputs = TINY["FLUX.1 Kontext"]()
    check_fast_mode_fuses_the_encoder(pipe, inputs, VAE_ENCODER_FUSED_PATCH)


def check_fast_mode_fuses_the_encoder(pipe, inputs, patch_name: str, coder_forward: bool = False) -> None:
    """Fast mode on ``pipe``'s VAE alone, in debug mode (the kernels' references run where the caller pretends
    Triton is there): the encoder fused (``patch_name`` reported, its ``conv_in`` patched, with ``coder_forward``
    its own forward too), each call equal to the same fused code without graphs and near the call before
    ``accelerate``; ``restore`` gives every forward back."""
    from bench.coverage import _call

    with torch.no_grad():
        plain = _call(pipe, inputs)
    accelerate(pipe, mode="fast", components=("vae",), debug=True)
    try:
        assert patch_name in stats(pipe)["patches"] and "forward" in pipe.vae.encoder.conv_in.__dict__
        assert not coder_forward or "forward" in pipe.vae.encoder.__dict__
        fast = _call(pipe, inputs)
        with eager(pipe):
            assert torch.equal(fast, _call(pipe, inputs))
        torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    finally:
        restore(pipe)
    assert not any("forward" in m.__dict__ for m in pipe.vae.encoder.modules())


@pytest.fixture
def kernels_available(monkeypatch):
    """Fast mode's fused decoder needs the kernels (CUDA and Triton): pretend, the references run."""
    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: None)


def test_fast_mode_fuses_the_decoder_by_default_and_leaves_a_sharing_pipeline_as_it_was(kernels_available):
    pipe = build_pipeline("z-image", "tiny")
    # another module over the same weights, as the benchmark's pipeline copies are
    sharing = copy.deepcopy(pipe.vae, memo={id(t): t for t in (*pipe.vae.parameters(), *pipe.vae.buffers())})
    assert sharing.decoder.conv_in.weight is pipe.vae.decoder.conv_in.weight
    latents = _latents(pipe.vae)
    with torch.no_grad():
        before = sharing.decode(latents).sample
    accelerate(pipe, mode="fast", debug=True)
    try:
        assert VAE_FUSED_PATCH in stats(pipe)["patches"] and VAE_GROUP_NORM_PATCH not in stats(pipe)["patches"]
        with torch.no_grad():
            assert torch.equal(sharing.decode(latents).sample, before)
    finally:
        restore(pipe)
    assert not any("forward" in m.__dict__ for m in pipe.vae.decoder.modules())


def test_patched_choice_and_no_kernels_keep_the_group_norm_patch(kernels_available, monkeypatch):
    pipe = build_pipeline("z-image", "tiny")
    vae_decoder.choose(pipe.vae, "patched")
    accelerate(pipe, mode="fast", debug=True)
    try:
        assert VAE_GROUP_NORM_PATCH in stats(pipe)["patches"] and VAE_FUSED_PATCH not in stats(pipe)["patches"]
    finally:
        restore(pipe)
    vae_decoder.choose(pipe.vae, "fused")
    monkeypatch.setattr(vae_decoder, "triton_unavailable", lambda device: "no GPU here")
    accelerate(pipe, mode="fast", debug=True)
    try:
        assert VAE_GROUP_NORM_PATCH in stats(pipe)["patches"] and VAE_FUSED_PATCH not in stats(pipe)["patches"]
    finally:
        restore(pipe)
