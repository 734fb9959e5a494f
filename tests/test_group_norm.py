"""Fast mode's group norm (``patches/group_norm.py``) against PyTorch's, and its installation on a VAE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches.group_norm import VAE_GROUP_NORM_PATCH, group_norm, patch_group_norms

SHAPES = [((2, 64, 16, 16), 32), ((1, 128, 8, 8), 32), ((3, 6, 5), 3), ((2, 8), 4), ((1, 16, 2, 4, 4), 8)]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize(("shape", "groups"), SHAPES)
def test_matches_pytorch_in_float32(shape, groups, affine):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3 + 1
    weight, bias = (torch.randn(shape[1], generator=generator) for _ in range(2)) if affine else (None, None)
    torch.testing.assert_close(group_norm(x, groups, weight, bias, 1e-6), F.group_norm(x, groups, weight, bias, 1e-6))


@pytest.mark.parametrize(("shape", "groups"), SHAPES)
def test_bfloat16_rounds_like_pytorch(shape, groups):
    generator = torch.Generator().manual_seed(1)
    x, weight, bias = (
        (torch.randn(s, generator=generator) * 2 + 0.5).to(torch.bfloat16) for s in (shape, shape[1], shape[1])
    )
    ours = group_norm(x, groups, weight, bias, 1e-6)
    reference = F.group_norm(x.double(), groups, weight.double(), bias.double(), 1e-6)
    assert ours.dtype == torch.bfloat16
    # Moments and output rounded to bfloat16 once each, as in PyTorch's kernel: a couple of units in
    # the last place of the largest value.
    ulp = 2.0**-7 * reference.abs().max().item()
    assert (ours.double() - reference).abs().max().item() <= 2 * ulp


def test_other_layouts_go_to_pytorch_unchanged():
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    assert torch.equal(group_norm(x, 4), F.group_norm(x, 4))


def test_calls_that_autograd_records_go_to_pytorch():
    norm = torch.nn.GroupNorm(2, 4)
    x = torch.randn(1, 4, 3, 3, requires_grad=True)
    out = group_norm(x, 2, norm.weight, norm.bias, norm.eps)
    assert torch.equal(out, F.group_norm(x, 2, norm.weight, norm.bias, norm.eps))
    out.square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_refuses_channels_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match="6 channels cannot be split into 4 groups"):
        group_norm(torch.randn(1, 6, 2, 2), 4)


def test_patched_vae_decoder_decodes_the_same_and_undo_gives_the_original_back():
    vae = build_pipeline("z-image", "tiny").vae
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        original = vae.decode(latents).sample
        patches = MethodPatches()
        count = patch_group_norms(vae.decoder, patches)
        patched = vae.decode(latents).sample
        patches.undo()
        restored = vae.decode(latents).sample
    assert count == sum(isinstance(m, torch.nn.GroupNorm) for m in vae.decoder.modules()) > 0
    torch.testing.assert_close(patched, original, atol=1e-5, rtol=1e-5)
    assert torch.equal(restored, original)
    assert not any("forward" in m.__dict__ for m in vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm))


def test_fast_mode_patches_the_vae_decoder_and_restore_undoes_it():
    pipe = build_pipeline("z-image", "tiny")
    norms = [m for m in pipe.vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm)]
    accelerate(pipe, mode="fast", debug=True)
    try:
        assert VAE_GROUP_NORM_PATCH in stats(pipe)["patches"]
        assert all("forward" in m.__dict__ for m in norms)
    finally:
        restore(pipe)
    assert not any("forward" in m.__dict__ for m in norms)
    accelerate(pipe, debug=True)  # exact mode keeps PyTorch's group norm
    try:
        assert VAE_GROUP_NORM_PATCH not in stats(pipe)["patches"]
        assert not any("forward" in m.__dict__ for m in norms)
    finally:
        restore(pipe)
