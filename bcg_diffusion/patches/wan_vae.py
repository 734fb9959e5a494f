"""Fast mode's Wan VAE decoder and encoder, and Qwen-Image's copy of them: channels-last activations, each norm
with its SiLU one pass, a single frame convolved in 2-D.

Wan's causal 3-D VAE (``AutoencoderKLWan``: Wan 2.1, Wan 2.2 and the pipelines built on them) decodes a video one
latent frame at a time, each convolution taking the last frames of the previous one from a cache. At 832×480,
81 frames, on an H100 (run 163, ``bench.probes.probe_wan_vae``) eager bf16 decoding took 2.07 s, of which
0.71 s were convolutions and 1.35 s the work between them: each ``WanRMS_norm`` is about eight passes over
the activation, half of them in float32 (``x.float()``, the norm, the division, the rounding, ``* scale``,
``* gamma``, ``+ bias``), SiLU one more, each causal convolution copies its input twice (the cache joined
to it, then zero padding all round), cuDNN transposes channels-first activations to channels-last and
back around every convolution, and each upsampling goes through float32 at four times the size.

:func:`fuse_decoder` keeps the decoder's modules and weights and changes the forwards of its parts:

* the decoder's input is made channels-last (``channels_last_3d``) and every activation stays so; its
  output is made contiguous again for what follows it;
* each ``WanResidualBlock`` runs each norm with its SiLU as one pass
  (:func:`~bcg_diffusion.kernels.vae_glue.channel_rms_norm`), the first convolution's bias folded into
  the second norm, and the second convolution's and the shortcut's biases into one pass with the
  residual (:func:`~bcg_diffusion.kernels.vae_glue.residual_sum`): PyTorch adds a 3-D convolution's
  bias in a pass of its own. Every other ``WanRMS_norm`` (the mid block's attention's) is the norm
  without the SiLU, and the head's norm and SiLU are one pass;
* each ``WanCausalConv3d`` joins the cached frames (or the causal zeros) before its input in one
  channels-last copy and leaves the spatial zero padding to the convolution itself. A single frame after
  the causal zeros (an image: every convolution of Qwen-Image's VAE; the first chunk of a video) meets
  only its kernel's last time tap, every other tap multiplying zeros: it runs as that tap's 2-D
  convolution, a third of the 3-D convolution's work;
* each ``WanResample`` upsampling interleaves the time convolution's two halves in one channels-last
  copy and upsamples by two in bf16 (nearest: the same bytes as eager's round trip through float32).

The encoder (:func:`fuse_encoder`: ``WanEncoder3d``) gets the same residual blocks, causal convolutions and
norms, its head's norm and SiLU in one pass; its downsampling stays diffusers' own. Image-to-image, edit and
image-to-video pipelines encode their input with it on every call (Qwen-Image-Edit a 1024² image; Wan's
image-to-video the first frame and 80 frames of zeros).

Qwen-Image's VAE (``AutoencoderKLQwenImage``: Qwen-Image and its Edit variants) is diffusers' copy of Wan 2.1's
under other names (``QwenImageDecoder3d``, ``QwenImageResidualBlock``...), decoding an image as one latent
frame; its decoder's up blocks take no ``first_chunk``. Each family's classes are one :class:`_Family`, and
everything above serves both.

The cache bookkeeping (which convolution reads which cache entry, what each keeps for the next chunk)
is diffusers' own, copied; :mod:`~bcg_diffusion.patches.followed` checks that code before installing.
Each patched forward runs the original where it cannot serve a call (autograd on, training mode). The
norms round once instead of after every operator and the convolutions may pick other algorithms, so the
result differs from eager by rounding only: fast mode's kind of change, tested against diffusers' own
decoder and encoder in ``tests/test_wan_vae_fused.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..core.hooks import MethodPatches
from ..kernels.vae_glue import channel_rms_norm, residual_sum, upsample_nearest2x

__all__ = [
    "QWENIMAGE_VAE_ENCODER_FUSED_PATCH",
    "QWENIMAGE_VAE_FUSED_PATCH",
    "WAN_VAE_ENCODER_FUSED_PATCH",
    "WAN_VAE_FUSED_PATCH",
    "encoder_fusable",
    "fusable",
    "fuse_decoder",
    "fuse_encoder",
    "qwenimage_encoder_fusable",
    "qwenimage_fusable",
]

WAN_VAE_FUSED_PATCH = "wan vae decoder fused (channels-last)"  # its name in stats()["patches"]
QWENIMAGE_VAE_FUSED_PATCH = "qwen-image vae decoder fused (channels-last)"
WAN_VAE_ENCODER_FUSED_PATCH = "wan vae encoder fused (channels-last)"
QWENIMAGE_VAE_ENCODER_FUSED_PATCH = "qwen-image vae encoder fused (channels-last)"
_CL = torch.channels_last_3d


class _Family(NamedTuple):
    """One family of diffusers' causal 3-D VAE classes: Wan's, or Qwen-Image's copy of them."""

    module: Any  # diffusers' module holding them (its CACHE_T: how many frames a causal convolution keeps)
    conv: type
    norm: type
    upsample: type
    resample: type
    residual: type
    decoder: type
    encoder: type
    first_chunk: bool  # whether the decoder's up blocks take ``first_chunk`` (Wan's: Wan 2.2's residual blocks)


@functools.cache
def _families() -> tuple[_Family, _Family]:
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
    from diffusers.models.autoencoders import autoencoder_kl_wan as wan

    return (
        _Family(wan, wan.WanCausalConv3d, wan.WanRMS_norm, wan.WanUpsample, wan.WanResample, wan.WanResidualBlock,
                wan.WanDecoder3d, wan.WanEncoder3d, True),
        _Family(qwen, qwen.QwenImageCausalConv3d, qwen.QwenImageRMS_norm, qwen.QwenImageUpsample,
                qwen.QwenImageResample, qwen.QwenImageResidualBlock, qwen.QwenImageDecoder3d,
                qwen.QwenImageEncoder3d, False),
    )  # fmt: skip


def _family_of(decoder: Any) -> _Family | None:
    return next((family for family in _families() if type(decoder) is family.decoder), None)


def _encoder_family_of(encoder: Any) -> _Family | None:
    return next((family for family in _families() if type(encoder) is family.encoder), None)


def _own_forward(module: Any) -> bool:
    return "forward" not in module.__dict__


def fusable(decoder: Any) -> bool:
    """Whether ``decoder`` is diffusers' ``WanDecoder3d`` with its own forwards, SiLU as its activation and
    upsampling by nearest-exact ×2 then a convolution (every released Wan VAE)."""
    return type(decoder) is _families()[0].decoder and _fits(decoder, _families()[0], encoder=False)


def qwenimage_fusable(decoder: Any) -> bool:
    """:func:`fusable` for Qwen-Image's ``QwenImageDecoder3d`` (Qwen-Image's VAE and its Edit variants')."""
    return type(decoder) is _families()[1].decoder and _fits(decoder, _families()[1], encoder=False)


def encoder_fusable(encoder: Any) -> bool:
    """Whether ``encoder`` is diffusers' ``WanEncoder3d`` with its own forwards, SiLU as its activation and
    its causal convolutions padded as every released Wan VAE's (Wan 2.1's, Wan 2.2's)."""
    return type(encoder) is _families()[0].encoder and _fits(encoder, _families()[0], encoder=True)


def qwenimage_encoder_fusable(encoder: Any) -> bool:
    """:func:`encoder_fusable` for Qwen-Image's ``QwenImageEncoder3d``."""
    return type(encoder) is _families()[1].encoder and _fits(encoder, _families()[1], encoder=True)


def _fits(coder: Any, family: _Family, encoder: bool) -> bool:
    if type(coder.nonlinearity) is not torch.nn.SiLU:
        return False
    for module in coder.modules():
        if not _own_forward(module):
            return False
        if isinstance(module, family.residual) and type(module.nonlinearity) is not torch.nn.SiLU:
            return False
        if isinstance(module, family.norm) and not (
            module.channel_first and (isinstance(module.bias, torch.Tensor) or module.bias == 0.0)
        ):
            return False
        if isinstance(module, family.resample) and not _resample_fits(module, family, encoder):
            return False
        if isinstance(module, family.conv) and not _plain_conv(module):
            return False
    return True


def _resample_fits(block: Any, family: _Family, encoder: bool) -> bool:
    """The encoder's downsampling keeps diffusers' forward (its convolutions patched); the decoder's upsampling
    is patched where it is :func:`_plain_resample`."""
    return block.mode in ("downsample2d", "downsample3d") if encoder else _plain_resample(block, family)


def _plain_resample(block: Any, family: _Family) -> bool:
    if block.mode not in ("upsample2d", "upsample3d"):
        return False
    upsample, conv = block.resample
    return (
        type(upsample) is family.upsample
        and upsample.mode == "nearest-exact"
        and upsample.size is None
        and tuple(upsample.scale_factor) == (2.0, 2.0)
        and type(conv) is torch.nn.Conv2d
    )


def _grad_or_training(module: Any) -> bool:
    return torch.is_grad_enabled() or module.training


def _norm(norm: Any, x: torch.Tensor, silu: bool, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    bias = norm.bias if isinstance(norm.bias, torch.Tensor) else None
    if bias is None and norm.bias != 0.0:
        raise ValueError(f"WanRMS_norm with a bias of {norm.bias!r}, neither a tensor nor 0")
    return channel_rms_norm(_channels_last(x), norm.gamma, bias, norm.scale, silu=silu, pre_bias=pre_bias)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` channels-last (a copy only where an eager operator gave it another layout)."""
    return x.contiguous(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)


def _join_frames(parts: list[torch.Tensor], zeros: int) -> torch.Tensor:
    """``torch.cat([zeros frames of 0, *parts], dim=2)``, channels-last whatever the parts' layouts."""
    first = parts[0]
    batch, channels, _, height, width = first.shape
    frames = zeros + sum(part.shape[2] for part in parts)
    out = torch.empty((batch, channels, frames, height, width), dtype=first.dtype, device=first.device,
                      memory_format=_CL)  # fmt: skip
    if zeros:
        out[:, :, :zeros].zero_()
    start = zeros
    for part in parts:
        out[:, :, start : start + part.shape[2]].copy_(part)
        start += part.shape[2]
    return out


def _last_frames(x: torch.Tensor, cached: Any, family: _Family) -> torch.Tensor:
    """What a causal convolution keeps for the next chunk: ``x``'s last two frames; before a single one, the
    cached last frame, or a frame of zeros after the time upsampling's first chunk (its ``"Rep"`` marker)
    (diffusers' ``cache_x``)."""
    cache_x = x[:, :, -family.module.CACHE_T :]
    if cache_x.shape[2] < 2 and isinstance(cached, torch.Tensor):
        return _join_frames([cached[:, :, -1:], cache_x], 0)
    if cache_x.shape[2] < 2 and isinstance(cached, str):
        return _join_frames([cache_x], 1)
    return cache_x.clone()


def _plain_conv(conv: Any) -> bool:
    """Whether ``conv`` pads as every released Wan causal convolution: zeros, the same on both sides of
    each spatial dimension, twice the time padding before the frames and none after."""
    width, height, time = conv._padding[0], conv._padding[2], conv._padding[4]
    return conv.padding_mode == "zeros" and tuple(conv._padding) == (width, width, height, height, time, 0)


def _causal_conv(conv: Any, x: torch.Tensor, cache_x: torch.Tensor | None, bias: bool = True) -> torch.Tensor:
    """``conv(x, cache_x)`` (diffusers' ``WanCausalConv3d``, :func:`_plain_conv`) channels-last: the cached
    frames, or the causal zeros, joined before ``x`` in one copy; the spatial padding left to the
    convolution. ``bias=False`` leaves the bias out, for the next pass to add."""
    width_pad, height_pad, time_pad = conv._padding[0], conv._padding[2], conv._padding[4]
    parts = [x]
    if cache_x is not None and time_pad > 0:
        parts.insert(0, cache_x.to(x.device))
        time_pad = max(time_pad - cache_x.shape[2], 0)
    if len(parts) == 1 and _last_tap_only(conv, x, time_pad):
        return F.conv2d(_channels_last(x)[:, :, 0], conv.weight[:, :, -1], conv.bias if bias else None,
                        conv.stride[1:], (height_pad, width_pad), conv.dilation[1:], conv.groups).unsqueeze(2)  # fmt: skip
    x = _join_frames(parts, time_pad) if len(parts) > 1 or time_pad > 0 else _channels_last(x)
    return F.conv3d(x, conv.weight, conv.bias if bias else None, conv.stride, (0, height_pad, width_pad),
                    conv.dilation, conv.groups)  # fmt: skip


def _last_tap_only(conv: Any, x: torch.Tensor, zeros: int) -> bool:
    """Whether ``conv`` over ``zeros`` frames of zeros then the one frame of ``x`` gives one frame, reading
    ``x`` with its kernel's last time tap alone (its other taps read the zeros, so add nothing)."""
    return x.shape[2] == 1 and zeros == conv.kernel_size[0] - 1 and conv.stride[0] == 1 and conv.dilation[0] == 1


def _causal_conv_forward(conv: Any) -> Callable[..., torch.Tensor]:
    original = type(conv).forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if _grad_or_training(conv) or x.dim() != 5 or not _plain_conv(conv):
            return original(conv, x, cache_x)
        return _causal_conv(conv, x, cache_x)

    return forward


def _cached_conv(
    conv: Any, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int], family: _Family, bias: bool = True
) -> torch.Tensor:
    """A causal convolution as diffusers' blocks call it: with the cache entry at ``feat_idx[0]``, which it
    replaces by what the next chunk needs (no cache: plain). ``bias=False``: without its bias."""
    if feat_cache is None:
        return _causal_conv(conv, x, None, bias)
    idx = feat_idx[0]
    cache_x = _last_frames(x, feat_cache[idx], family)
    x = _causal_conv(conv, x, feat_cache[idx], bias)
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def _residual_forward(block: Any, family: _Family) -> Callable[..., torch.Tensor]:
    original = type(block).forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]) -> torch.Tensor:  # noqa: B006 - diffusers' signature
        convs = (block.conv1, block.conv2, block.conv_shortcut)
        plain = all(_plain_conv(c) for c in convs if isinstance(c, family.conv))
        if _grad_or_training(block) or not plain:
            return original(block, x, feat_cache, feat_idx)
        # The convolutions' biases go into the next pass: conv1's into norm2, conv2's and the shortcut's into
        # the residual sum (each eagerly a pass of its own over the activation).
        bias = block.conv2.bias
        if isinstance(block.conv_shortcut, family.conv):
            h = _causal_conv(block.conv_shortcut, x, None, bias=False)
            if block.conv_shortcut.bias is not None:  # summed per call: the weights may change in place
                bias = block.conv_shortcut.bias if bias is None else bias + block.conv_shortcut.bias
        else:  # diffusers' Identity where the widths match
            h = _channels_last(block.conv_shortcut(x))
        x = _cached_conv(block.conv1, _norm(block.norm1, x, silu=True), feat_cache, feat_idx, family, bias=False)
        x = _norm(block.norm2, x, silu=True, pre_bias=block.conv1.bias)
        x = _cached_conv(block.conv2, x, feat_cache, feat_idx, family, bias=False)
        return residual_sum(x, h, bias)

    return forward


def _interleave_time(x: torch.Tensor) -> torch.Tensor:
    """``[B, 2C, T, H, W]`` to ``[B, C, 2T, H, W]`` with frame ``2t + j`` from channels ``j*C ...`` of frame
    ``t`` (diffusers' reshape and ``torch.stack``), in one channels-last copy."""
    batch, channels, frames, height, width = x.shape
    rows = x.permute(0, 2, 3, 4, 1).reshape(batch, frames, height, width, 2, channels // 2)
    rows = rows.permute(0, 1, 4, 2, 3, 5).reshape(batch, 2 * frames, height, width, channels // 2)
    return rows.permute(0, 4, 1, 2, 3)


def _resample_forward(block: Any, family: _Family) -> Callable[..., torch.Tensor]:
    original = type(block).forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]) -> torch.Tensor:  # noqa: B006 - diffusers' signature
        if _grad_or_training(block) or not _plain_resample(block, family):
            return original(block, x, feat_cache, feat_idx)
        batch, channels, _, height, width = x.shape
        if block.mode == "upsample3d" and feat_cache is not None:
            idx = feat_idx[0]
            cached = feat_cache[idx]
            if cached is None:
                feat_cache[idx] = "Rep"  # the first chunk: no time upsampling (diffusers' marker)
                feat_idx[0] += 1
            else:
                cache_x = _last_frames(x, cached, family)
                x = block.time_conv(x, None if isinstance(cached, str) else cached)
                feat_cache[idx] = cache_x
                feat_idx[0] += 1
                x = _interleave_time(x)
        frames = x.shape[2]
        images = x.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, height, width)
        images = block.resample[1](upsample_nearest2x(images.contiguous(memory_format=torch.channels_last)))
        return images.view(batch, frames, *images.shape[1:]).permute(0, 2, 1, 3, 4)

    return forward


def _norm_forward(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    original = type(norm).forward

    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if _grad_or_training(norm):
            return original(norm, x)
        return _norm(norm, x, silu=False)

    return forward


def _decoder_forward(decoder: Any, family: _Family) -> Callable[..., torch.Tensor]:
    original = type(decoder).forward

    @functools.wraps(original)
    def forward(
        x: torch.Tensor,
        feat_cache: list | None = None,
        feat_idx: list[int] = [0],  # noqa: B006 - diffusers' signature
        first_chunk: bool = False,  # Wan's only: Qwen-Image's decoder takes none, and its callers pass none
    ) -> torch.Tensor:
        if _grad_or_training(decoder):
            chunk = (first_chunk,) if family.first_chunk else ()
            return original(decoder, x, feat_cache, feat_idx, *chunk)
        x = _cached_conv(decoder.conv_in, _channels_last(x), feat_cache, feat_idx, family)
        x = decoder.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
        chunk = {"first_chunk": first_chunk} if family.first_chunk else {}
        for up_block in decoder.up_blocks:
            x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, **chunk)
        x = _cached_conv(decoder.conv_out, _norm(decoder.norm_out, x, silu=True), feat_cache, feat_idx, family)
        return x.contiguous()

    return forward


def _patch_parts(coder: Any, family: _Family, patches: MethodPatches, resamplers: bool) -> dict[str, int]:
    """Patch the residual blocks, causal convolutions, the norms outside the residual blocks but the head's (its
    coder's forward fuses it with its SiLU) and, with ``resamplers``, the upsamplers of ``coder``; count them."""
    counts = {"resnets": 0, **({"upsamplers": 0} if resamplers else {}), "norms": 0, "convs": 0}
    in_blocks = {id(coder.norm_out)}
    for module in coder.modules():
        if isinstance(module, family.residual):
            patches.replace(module, "forward", _residual_forward(module, family))
            in_blocks.update((id(module.norm1), id(module.norm2)))
            counts["resnets"] += 1
        elif resamplers and isinstance(module, family.resample):
            patches.replace(module, "forward", _resample_forward(module, family))
            counts["upsamplers"] += 1
        elif isinstance(module, family.conv):
            patches.replace(module, "forward", _causal_conv_forward(module))
            counts["convs"] += 1
    for module in coder.modules():
        if isinstance(module, family.norm) and id(module) not in in_blocks:
            patches.replace(module, "forward", _norm_forward(module))
            counts["norms"] += 1
    return counts


def fuse_decoder(decoder: torch.nn.Module, patches: MethodPatches) -> dict[str, int]:
    """Patch the forwards of ``decoder``'s parts as the module docstring says (each recorded in
    ``patches``); returns how many of each were patched (``resnets``, ``upsamplers``, ``norms``,
    ``convs``). Needs :func:`fusable` or :func:`qwenimage_fusable` ``(decoder)``; raises ValueError otherwise.

    >>> fuse_decoder(pipe.vae.decoder, patches)  # Wan 2.1's VAE  # doctest: +SKIP
    {'resnets': 14, 'upsamplers': 3, 'norms': 1, 'convs': 33}
    """
    return _fuse(decoder, patches, encoder=False)


def _encoder_forward(encoder: Any, family: _Family) -> Callable[..., torch.Tensor]:
    original = type(encoder).forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]) -> torch.Tensor:  # noqa: B006 - diffusers' signature
        if _grad_or_training(encoder):
            return original(encoder, x, feat_cache, feat_idx)
        x = _cached_conv(encoder.conv_in, _channels_last(x), feat_cache, feat_idx, family)
        for layer in encoder.down_blocks:  # as diffusers calls them: the cache only where there is one
            x = layer(x) if feat_cache is None else layer(x, feat_cache=feat_cache, feat_idx=feat_idx)
        x = encoder.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
        x = _cached_conv(encoder.conv_out, _norm(encoder.norm_out, x, silu=True), feat_cache, feat_idx, family)
        return x.contiguous()

    return forward


def fuse_encoder(encoder: torch.nn.Module, patches: MethodPatches) -> dict[str, int]:
    """Patch the forwards of ``encoder``'s parts as the module docstring says (each recorded in ``patches``);
    returns how many of each were patched (``resnets``, ``norms``, ``convs``). Needs :func:`encoder_fusable`
    or :func:`qwenimage_encoder_fusable` ``(encoder)``; raises ValueError otherwise.

    >>> fuse_encoder(pipe.vae.encoder, patches)  # Qwen-Image's VAE  # doctest: +SKIP
    {'resnets': 10, 'norms': 1, 'convs': 26}
    """
    return _fuse(encoder, patches, encoder=True)


def _fuse(coder: torch.nn.Module, patches: MethodPatches, encoder: bool) -> dict[str, int]:
    """:func:`fuse_decoder` or :func:`fuse_encoder`: the parts (:func:`_patch_parts`), then the coder's own forward."""
    family = _encoder_family_of(coder) if encoder else _family_of(coder)
    if family is None or not _fits(coder, family, encoder):
        kinds = "WanEncoder3d or QwenImageEncoder3d" if encoder else "WanDecoder3d or QwenImageDecoder3d"
        raise ValueError(f"not diffusers' {kinds} with its own forwards: {type(coder).__name__}")
    counts = _patch_parts(coder, family, patches, resamplers=not encoder)
    forward = _encoder_forward if encoder else _decoder_forward
    patches.replace(coder, "forward", forward(coder, family))
    return counts
