"""Fast mode's 2-D VAE decoder and encoder in the channels-last layout, their elementwise work fused into a
few kernels.

diffusers' 2-D ``Decoder`` (FLUX.1's, SD's, Z-Image's VAE) is convolutions with elementwise work
between them, which eagerly costs more than the convolutions: cuDNN's convolutions run channels-last
and, on contiguous tensors, transpose in and out of that layout around each call; PyTorch adds each
convolution's bias in a pass of its own; a group norm is two more passes (moments, then the affine
map), its SiLU another, a resnet block's residual two more (sum, then ``/ output_scale_factor``), and
PyTorch's channels-last nearest upsampling is slow. :func:`fuse_decoder` keeps the decoder's modules
and weights, and changes the forwards of its parts:

* ``conv_in`` takes its input channels-last, so every activation after it is channels-last and no
  convolution transposes its input and output; the decoder's output is made contiguous again for what
  follows it. The weights are left as they are (PyTorch gives each convolution a channels-last copy of
  its weight, a small copy per call): changing their layout in place would change them for every
  module sharing them, an eager pipeline's included, and a copy made once would miss later in-place
  changes (a LoRA fused into the VAE);
* each resnet block (``ResnetBlock2D`` in its plain form: no time embedding, no up or down sampling,
  SiLU) runs ``norm1 + SiLU``, ``conv1`` without its bias, ``norm2 + SiLU`` with ``conv1``'s bias
  folded in, ``conv2`` and the shortcut without their biases, and one pass for the biases, the
  residual and the scale (:mod:`bcg_diffusion.kernels.group_norm`, :mod:`bcg_diffusion.kernels.vae_glue`);
* each ``Upsample2D`` in its plain form (nearest ×2, then a convolution) copies with the channels-last
  kernel, the same bytes as ``F.interpolate``;
* ``conv_norm_out`` and ``conv_act`` become one group norm with SiLU, and every other ``GroupNorm``
  (the mid block's attention's) the kernel's group norm.

diffusers' 2-D ``Encoder`` (the same VAEs', which image-to-image, inpainting and FLUX.1 Kontext run on their
input image every call) is built of the same parts under the same names: :func:`fuse_encoder` patches its
resnet blocks, norms, ``conv_in`` and ``conv_out`` alike, its downsamplers left to diffusers.

Each patched forward checks its module's form when called and runs the original forward otherwise (a
time embedding passed, training mode, autograd on, a module replaced since): the kernels have no
backward. The arithmetic changes rounding only:
float32 inside each fused pass, rounded once where eager rounds after every operator; tested against
diffusers' own forwards in ``tests/test_vae_fused.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core.hooks import MethodPatches
from ..kernels.group_norm import group_norm
from ..kernels.vae_glue import residual_sum, upsample_nearest2x

__all__ = ["VAE_ENCODER_FUSED_PATCH", "VAE_FUSED_PATCH", "encoder_fusable", "fusable", "fuse_decoder", "fuse_encoder"]

VAE_FUSED_PATCH = "vae decoder fused (channels-last)"  # its name in stats()["patches"]
VAE_ENCODER_FUSED_PATCH = "vae encoder fused (channels-last)"


def fusable(decoder: Any) -> bool:
    """Whether ``decoder`` is diffusers' 2-D VAE ``Decoder`` with its own forward."""
    from diffusers.models.autoencoders.vae import Decoder

    return type(decoder) is Decoder and "forward" not in decoder.__dict__


def encoder_fusable(encoder: Any) -> bool:
    """Whether ``encoder`` is diffusers' 2-D VAE ``Encoder`` with its own forward."""
    from diffusers.models.autoencoders.vae import Encoder

    return type(encoder) is Encoder and "forward" not in encoder.__dict__


def _plain_conv(conv: Any) -> bool:
    return type(conv) is torch.nn.Conv2d and conv.padding_mode == "zeros"


def _plain_norm(norm: Any) -> bool:
    return type(norm) is torch.nn.GroupNorm and "forward" not in norm.__dict__


def _plain_resnet(block: Any) -> bool:
    from diffusers.models.resnet import ResnetBlock2D

    return (
        type(block) is ResnetBlock2D
        and block.time_emb_proj is None
        and block.upsample is None
        and block.downsample is None
        and type(block.nonlinearity) is torch.nn.SiLU
        and _plain_norm(block.norm1)
        and _plain_norm(block.norm2)
        and _plain_conv(block.conv1)
        and _plain_conv(block.conv2)
        and (block.conv_shortcut is None or _plain_conv(block.conv_shortcut))
    )


def _plain_upsampler(block: Any) -> bool:
    from diffusers.models.upsampling import Upsample2D

    if type(block) is not Upsample2D or block.norm is not None or block.use_conv_transpose or not block.interpolate:
        return False
    return not block.use_conv or type(_upsampler_conv(block)) is torch.nn.Conv2d


def _upsampler_conv(block: Any) -> Any:
    """The convolution an ``Upsample2D`` applies after upsampling (diffusers names it after ``block.name``)."""
    return block.conv if block.name == "conv" else block.Conv2d_0


def _conv(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` without its bias (the caller folds it into the next pass)."""
    return F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)


def _norm(norm: torch.nn.GroupNorm, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, **kwargs)


def _resnet_forward(block: Any) -> Callable[..., torch.Tensor]:
    original = type(block).forward

    @functools.wraps(original)
    def forward(
        input_tensor: torch.Tensor, temb: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if temb is not None or args or kwargs or block.training or torch.is_grad_enabled() or not _plain_resnet(block):
            return original(block, input_tensor, temb, *args, **kwargs)
        hidden = _norm(block.norm1, input_tensor, silu=True)
        hidden = _norm(block.norm2, _conv(block.conv1, hidden), pre_bias=block.conv1.bias, silu=True)
        hidden = _conv(block.conv2, hidden)
        bias = block.conv2.bias
        residual = input_tensor
        if block.conv_shortcut is not None:
            residual = _conv(block.conv_shortcut, input_tensor)
            shortcut_bias = block.conv_shortcut.bias
            if shortcut_bias is not None:  # summed per call, not once: the weights may change in place
                bias = shortcut_bias if bias is None else bias + shortcut_bias
        return residual_sum(hidden, residual, bias, block.output_scale_factor)

    return forward


def _upsampler_forward(block: Any) -> Callable[..., torch.Tensor]:
    original = type(block).forward

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, output_size: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = output_size is None and not args and not kwargs and hidden_states.dim() == 4
        if not plain or torch.is_grad_enabled() or not _plain_upsampler(block):  # the kernel has no backward
            return original(block, hidden_states, output_size, *args, **kwargs)
        hidden_states = upsample_nearest2x(hidden_states)
        if block.use_conv:
            hidden_states = _upsampler_conv(block)(hidden_states)
        return hidden_states

    return forward


def _norm_forward(norm: torch.nn.GroupNorm, silu: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    @functools.wraps(type(norm).forward)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            y = type(norm).forward(norm, x)
            return F.silu(y) if silu else y
        return _norm(norm, x, silu=silu)

    return forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _channels_last_input(conv: torch.nn.Conv2d) -> Callable[[torch.Tensor], torch.Tensor]:
    @functools.wraps(type(conv).forward)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return type(conv).forward(conv, x)

    return forward


def _contiguous_output(conv: torch.nn.Conv2d) -> Callable[[torch.Tensor], torch.Tensor]:
    @functools.wraps(type(conv).forward)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return type(conv).forward(conv, x).contiguous()

    return forward


def fuse_decoder(decoder: torch.nn.Module, patches: MethodPatches) -> dict[str, int]:
    """Patch the forwards of ``decoder``'s parts as the module docstring says (each recorded in
    ``patches``); returns how many of each were patched (``resnets``, ``upsamplers``, ``norms``). Needs
    :func:`fusable` ``(decoder)``; raises ValueError otherwise."""
    if not fusable(decoder):
        raise ValueError(f"not diffusers' 2-D VAE Decoder with its own forward: {type(decoder).__name__}")
    return _fuse(decoder, patches)


def fuse_encoder(encoder: torch.nn.Module, patches: MethodPatches) -> dict[str, int]:
    """:func:`fuse_decoder` for diffusers' 2-D ``Encoder`` (:func:`encoder_fusable`; ValueError otherwise): its
    resnet blocks, norms, ``conv_in`` and ``conv_out`` (it has no upsamplers: ``upsamplers`` is 0)."""
    if not encoder_fusable(encoder):
        raise ValueError(f"not diffusers' 2-D VAE Encoder with its own forward: {type(encoder).__name__}")
    return _fuse(encoder, patches)


def _fuse(coder: torch.nn.Module, patches: MethodPatches) -> dict[str, int]:
    """Patch the parts of a ``Decoder`` or ``Encoder``: both name them alike (``conv_in``, ``conv_norm_out``,
    ``conv_act``, ``conv_out``) and run them in the same order."""
    counts = {"resnets": 0, "upsamplers": 0, "norms": 0}
    in_resnets: set[int] = set()
    for module in coder.modules():
        if "forward" in module.__dict__:
            continue
        if _plain_resnet(module):
            patches.replace(module, "forward", _resnet_forward(module))
            in_resnets.update((id(module.norm1), id(module.norm2)))
            counts["resnets"] += 1
        elif _plain_upsampler(module):
            patches.replace(module, "forward", _upsampler_forward(module))
            counts["upsamplers"] += 1
    out_norm, out_act = coder.conv_norm_out, coder.conv_act
    if _plain_norm(out_norm) and type(out_act) is torch.nn.SiLU:
        patches.replace(out_norm, "forward", _norm_forward(out_norm, silu=True))
        patches.replace(out_act, "forward", _identity)
        counts["norms"] += 1
    for module in coder.modules():
        if _plain_norm(module) and id(module) not in in_resnets:
            patches.replace(module, "forward", _norm_forward(module))
            counts["norms"] += 1
    if _plain_conv(coder.conv_in) and "forward" not in coder.conv_in.__dict__:
        patches.replace(coder.conv_in, "forward", _channels_last_input(coder.conv_in))
    if _plain_conv(coder.conv_out) and "forward" not in coder.conv_out.__dict__:
        patches.replace(coder.conv_out, "forward", _contiguous_output(coder.conv_out))
    return counts
