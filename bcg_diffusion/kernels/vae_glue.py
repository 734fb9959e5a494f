"""Passes of a VAE decoder's resnet blocks and upsamplers, each one kernel in the channels-last layout.

* :func:`residual_sum`: a resnet block's output, ``(shortcut + conv2(h)) / output_scale_factor``, with the
  convolutions' biases folded in. Eagerly that is four passes over the activation (the bias of
  ``conv2``, that of the shortcut convolution where there is one, the sum, the division); here one,
  in float32, rounded once (a rounding change, which is why only fast mode uses it).
* :func:`upsample_nearest2x`: nearest-neighbour upsampling by two. PyTorch's channels-last kernel for
  it is several times slower than its contiguous one; this is a plain copy, so its bytes equal
  ``F.interpolate(x, scale_factor=2.0, mode="nearest")``'s.
* :func:`channel_rms_norm`: Wan's causal 3-D VAE normalises each pixel over its channels
  (``WanRMS_norm``: ``F.normalize(x.float(), dim=1)``, rounded, then ``* scale * gamma + bias``), and
  its resnet blocks apply SiLU after it. Eagerly that is about eight passes, half of them in float32;
  here one, on a channels-last activation whose pixels are rows of contiguous channels, in float32,
  rounded once.

Each runs its Triton kernel on a CUDA tensor it takes and PyTorch's operators elsewhere
(:func:`reference_residual_sum`, ``F.interpolate``); fixed launch configurations, no atomics. Plain
functions, not custom operators: fast mode calls them in its eager-captured VAE decoder.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import triton_unavailable
from .group_norm import _DTYPES, _dense

__all__ = [
    "channel_rms_norm",
    "reference_channel_rms_norm",
    "reference_residual_sum",
    "residual_sum",
    "upsample_nearest2x",
]

_RESIDUAL_CONFIG = (4096, 4)  # (elements per program, warps)
_UPSAMPLE_TILE = 4096  # elements per program (pixels × channels, the channels rounded up to a power of two)
_RMS_TILE = 4096  # elements per program of the channel norm (rows × channels rounded up to a power of two)
_RMS_MAX_CHANNELS = 4096  # one program holds a row's channels


def residual_sum(
    hidden: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """``(residual + hidden + bias[c]) / scale`` for ``[N, C, *]`` tensors of one shape, in ``hidden``'s
    dtype and layout, computed in float32 and rounded once. Runs the kernel where the two share one
    dense layout and dtype on a CUDA device, :func:`reference_residual_sum` elsewhere. Raises
    ValueError for tensors of different shapes, and under autograd (a tensor that requires grad): it
    has no backward.

    >>> h, r = torch.randn(2, 1, 4, 3, 3)
    >>> torch.allclose(residual_sum(h, r, torch.ones(4), 2.0), (r + h + 1) / 2)
    True
    """
    if hidden.shape != residual.shape or hidden.dim() < 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and residual {tuple(residual.shape)} must be one [N, C, *] shape"
        )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, residual, bias)):
        raise ValueError("bcg_diffusion's residual sum has no backward: call it without autograd")
    channels = hidden.shape[1]
    takes = (
        triton_unavailable(hidden.device) is None
        and hidden.dtype in _DTYPES
        and residual.dtype == hidden.dtype
        and residual.device == hidden.device
        and residual.stride() == hidden.stride()
        and _dense(hidden)
        and (bias is None or (bias.shape == (channels,) and bias.is_contiguous() and bias.device == hidden.device))
    )
    if not takes:
        return reference_residual_sum(hidden, residual, bias, scale)
    out = torch.empty_like(hidden)
    if hidden.numel():
        _launch_residual(hidden, residual, bias, scale, out)
    return out


def reference_residual_sum(
    hidden: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """:func:`residual_sum` with PyTorch's operators (float32, rounded once)."""
    y = residual.float() + hidden.float()
    if bias is not None:
        y = y + bias.float().view((1, -1) + (1,) * (hidden.dim() - 2))
    if scale != 1.0:
        y = y / scale
    out = torch.empty_like(hidden)
    out.copy_(y)
    return out


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=2.0, mode="nearest")`` for ``[N, C, H, W]``, the same bytes: the
    kernel for a channels-last CUDA tensor, PyTorch's operator for anything else (a tensor autograd
    records included: the kernel has no backward)."""
    channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    recorded = torch.is_grad_enabled() and x.requires_grad
    if not channels_last or recorded or triton_unavailable(x.device) is not None or x.dtype not in _DTYPES:
        return F.interpolate(x, scale_factor=2.0, mode="nearest")
    batch, channels, height, width = x.shape
    out = torch.empty(
        batch, channels, 2 * height, 2 * width, dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    if out.numel():
        _launch_upsample(x, out)
    return out


def channel_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    eps: float = 1e-12,
    silu: bool = False,
    pre_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x / max(||x||₂ over channels, eps) * scale * weight[c] + bias[c]``, then SiLU if ``silu``, for an
    ``[N, C, *]`` tensor, with ``pre_bias[c]`` added to ``x`` first (the bias of the convolution before
    it): Wan's ``WanRMS_norm`` (and the SiLU after it) in one pass, float32 inside, rounded once to
    ``x``'s dtype. The kernel where ``x`` is a channels-last CUDA tensor (each pixel's
    channels contiguous), :func:`reference_channel_rms_norm` elsewhere; the output has ``x``'s layout.
    Raises ValueError for a ``weight``, ``bias`` or ``pre_bias`` of another size than ``C``, and under
    autograd: it has no backward.

    >>> x = torch.randn(1, 4, 2, 3, 3)
    >>> y = channel_rms_norm(x, torch.ones(4), scale=2.0)
    >>> torch.allclose(y, F.normalize(x, dim=1) * 2.0, atol=1e-6)
    True
    """
    channels = x.shape[1] if x.dim() >= 2 else -1
    for name, tensor in (("weight", weight), ("bias", bias), ("pre_bias", pre_bias)):
        if tensor is not None and tensor.numel() != channels:
            raise ValueError(f"{name} of {tensor.numel()} values for an input of {channels} channels")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, pre_bias)):
        raise ValueError("bcg_diffusion's channel RMS norm has no backward: call it without autograd")
    takes = (
        triton_unavailable(x.device) is None
        and x.dtype in _DTYPES
        and channels <= _RMS_MAX_CHANNELS
        and x.stride(1) == 1
        and _dense(x)
        and all(t is None or t.device == x.device for t in (weight, bias, pre_bias))
    )
    if not takes:
        return reference_channel_rms_norm(x, weight, bias, scale, eps, silu, pre_bias)
    out = torch.empty_like(x)
    if x.numel():
        vectors = [None if t is None else t.reshape(-1).contiguous() for t in (weight, bias, pre_bias)]
        _launch_rms(x, *vectors, scale, eps, silu, out)
    return out


def reference_channel_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    eps: float = 1e-12,
    silu: bool = False,
    pre_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`channel_rms_norm` with PyTorch's operators (float32, rounded once)."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = x.float() if pre_bias is None else x.float() + pre_bias.float().reshape(shape)
    y = F.normalize(y, dim=1, eps=eps) * (weight.float().reshape(shape) * scale)
    if bias is not None:
        y = y + bias.float().reshape(shape)
    if silu:
        y = F.silu(y)
    out = torch.empty_like(x)
    out.copy_(y)
    return out


def _device(x: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()  # CPU: Triton's interpreter


def _launch_residual(
    hidden: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None, scale: float, out: torch.Tensor
) -> None:
    from . import _vae_glue_triton as kernels

    block, warps = _RESIDUAL_CONFIG
    numel = hidden.numel()
    with _device(hidden):
        kernels.residual_sum[(-(-numel // block),)](
            hidden, residual, bias if bias is not None else hidden, out, numel, hidden.stride(1), hidden.shape[1],
            float(scale), BLOCK=block, HAS_BIAS=bias is not None, SCALED=scale != 1.0, num_warps=warps,
        )  # fmt: skip


def _launch_upsample(x: torch.Tensor, out: torch.Tensor) -> None:
    from . import _vae_glue_triton as kernels

    batch, channels, height, width = x.shape
    block_c = 1 << (channels - 1).bit_length()
    block_p = max(1, _UPSAMPLE_TILE // block_c)
    with _device(x):
        kernels.upsample_nearest2x[(-(-4 * height * width // block_p), batch)](
            x, out, height, width, channels, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4
        )


def _launch_rms(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pre_bias: torch.Tensor | None,
    scale: float,
    eps: float,
    silu: bool,
    out: torch.Tensor,
) -> None:
    from . import _vae_glue_triton as kernels

    channels = x.shape[1]
    rows = x.numel() // channels
    block_c = 1 << (channels - 1).bit_length()
    block_r = max(1, _RMS_TILE // block_c)
    with _device(x):
        kernels.channel_rms_norm[(-(-rows // block_r),)](
            x, pre_bias if pre_bias is not None else weight, weight, bias if bias is not None else weight, out,
            rows, channels, float(scale), float(eps), BLOCK_R=block_r, BLOCK_C=block_c,
            HAS_PRE_BIAS=pre_bias is not None, HAS_BIAS=bias is not None, SILU=silu, num_warps=4,
        )  # fmt: skip
