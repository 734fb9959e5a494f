"""The fused VAE decoder's Triton kernels in Triton's interpreter, against their plain-PyTorch references.

Run as a script by ``test_vae_fused.py`` in a process of its own: ``TRITON_INTERPRET=1`` must be set
before Triton is imported. Exits non-zero on the first case out of tolerance; prints one line per case.
float32 and float16 (the interpreter's bf16 is not reliable on this machine). Last, a tiny VAE's whole
decoder with the kernels forced on the CPU, against diffusers' own decoder.
"""

from __future__ import annotations

import itertools

import _interpreter  # noqa: F401 - first: Triton's interpreter on, its loop bounds read under NumPy 2.4
import torch
import torch.nn.functional as F

from bcg_diffusion.kernels import group_norm, vae_glue

# float32: moments summed in another order (a few ulps); float16: one step where a float32 difference
# crosses a rounding boundary.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 2e-3)}
# (elements per tile, warps, programs aimed at, partials per step): the library's, and small tiles that
# give several chunks, several tiles per chunk and a last tile cut short.
CONFIGS = (None, (64, 1, 8, 4))


def layout(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "channels-last":
        return x.contiguous(memory_format=torch.channels_last)
    if name == "channels-innermost":  # diffusers' VAE attention: [N, C, H*W] seen from [N, H*W, C]
        return x.flatten(2).transpose(1, 2).contiguous().transpose(1, 2)
    return x.contiguous()


def check(label: str, got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    assert got.stride() == expected.stride(), (label, got.stride(), expected.stride())
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
    print(f"{label}: max abs error {(got.float() - expected.float()).abs().max().item():.3g}", flush=True)


def group_norm_cases() -> None:
    torch.manual_seed(0)
    cases = [((2, 32, 9, 7), 8, torch.float32), ((1, 16, 5, 3), 4, torch.float16), ((1, 128, 6, 5), 32, torch.float16)]
    for (shape, groups, dtype), name in itertools.product(
        cases, ("contiguous", "channels-last", "channels-innermost")
    ):
        x = layout((torch.randn(*shape) * 3 + 5).to(dtype), name)  # a mean far from zero
        x = x.flatten(2) if name == "channels-innermost" else x
        weight, bias, pre_bias = (torch.randn(shape[1]).to(dtype) for _ in range(3))
        for (silu, pre), config in itertools.product(((False, None), (True, pre_bias)), CONFIGS):
            out = torch.empty_like(x)
            group_norm._launch(x, out, groups, weight, bias, 1e-6, pre, silu, config)
            expected = group_norm.reference_group_norm(x, groups, weight, bias, 1e-6, pre_bias=pre, silu=silu)
            label = f"group norm {shape} /{groups} {name} {dtype} silu={silu} pre_bias={pre is not None} {config}"
            check(label, out, expected, dtype)


def glue_cases() -> None:
    torch.manual_seed(1)
    for name in ("contiguous", "channels-last"):
        for dtype in (torch.float32, torch.float16):
            hidden, residual = (layout(torch.randn(2, 24, 5, 6).to(dtype), name) for _ in range(2))
            for bias in (None, torch.randn(24).to(dtype)):
                for scale in (1.0, 2.0):
                    out = torch.empty_like(hidden)
                    vae_glue._launch_residual(hidden, residual, bias, scale, out)
                    expected = vae_glue.reference_residual_sum(hidden, residual, bias, scale)
                    check(f"residual {name} {dtype} bias={bias is not None} scale={scale}", out, expected, dtype)
    for channels in (3, 16, 20):
        x = layout(torch.randn(2, channels, 5, 7), "channels-last")
        out = torch.empty(2, channels, 10, 14).contiguous(memory_format=torch.channels_last)
        vae_glue._launch_upsample(x, out)
        assert torch.equal(out, F.interpolate(x, scale_factor=2.0, mode="nearest")), channels
        print(f"upsample x2, {channels} channels: equal to F.interpolate", flush=True)


def decoder_case() -> None:
    """A tiny VAE's decoder fused, the kernels forced on (the library runs them on CUDA only)."""
    from bcg_diffusion.core.hooks import MethodPatches
    from bcg_diffusion.models import build_pipeline
    from bcg_diffusion.patches.vae import fuse_decoder

    group_norm.unavailable = vae_glue.triton_unavailable = lambda device: None
    vae = build_pipeline("z-image", "tiny").vae
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = vae.decode(latents).sample
        patches = MethodPatches()
        counts = fuse_decoder(vae.decoder, patches)
        got = vae.decode(latents).sample
    assert counts["resnets"] and counts["upsamplers"], counts
    check(f"tiny decoder fused {counts}", got, expected, torch.float32)


def channel_norm_cases() -> None:
    """Wan's per-pixel RMS norm: 5-D and 4-D channels-last, with and without bias and SiLU, channels that
    are and are not a power of two."""
    torch.manual_seed(2)
    for shape, dtype in (
        ((1, 12, 3, 5, 7), torch.float32),
        ((2, 16, 2, 3, 4), torch.float16),
        ((3, 20, 5, 6), torch.float32),
    ):
        memory_format = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
        x = (torch.randn(*shape) * 3 + 1).to(dtype).contiguous(memory_format=memory_format)
        weight, bias, pre_bias = (torch.randn(shape[1]).to(dtype) for _ in range(3))
        for with_bias, silu in ((False, True), (True, False)):
            b, pre = (bias, None) if with_bias else (None, pre_bias)
            out = torch.empty_like(x)
            vae_glue._launch_rms(x, weight, b, pre, 1.7, 1e-12, silu, out)
            expected = vae_glue.reference_channel_rms_norm(x, weight, b, 1.7, 1e-12, silu, pre)
            label = f"channel rms norm {shape} {dtype} bias={with_bias} pre_bias={not with_bias} silu={silu}"
            check(label, out, expected, dtype)


def wan_decoder_case() -> None:
    """A tiny Wan VAE's decoder fused, the kernels forced on, against diffusers' own."""
    from diffusers import AutoencoderKLWan

    from bcg_diffusion.core.hooks import MethodPatches
    from bcg_diffusion.patches.wan_vae import fuse_decoder

    vae_glue.triton_unavailable = lambda device: None
    torch.manual_seed(3)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1).eval()
    latents = torch.randn(1, 4, 3, 4, 6)
    with torch.no_grad():
        expected = vae.decode(latents).sample
        patches = MethodPatches()
        counts = fuse_decoder(vae.decoder, patches)
        got = vae.decode(latents).sample
    check(f"tiny Wan decoder fused {counts}", got, expected, torch.float32)


if __name__ == "__main__":
    group_norm_cases()
    glue_cases()
    channel_norm_cases()
    decoder_case()
    wan_decoder_case()
    print("all cases within tolerance")
