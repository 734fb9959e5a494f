"""Two passes of a VAE decoder's resnet blocks and upsamplers, each one kernel in the channels-last layout.

* :func:`residual_sum`: a resnet block's output, ``(shortcut + conv2(h)) / output_scale_factor``, with the
  convolutions' biases folded in. Eagerly that is four passes over the activation (the bias of
  ``conv2``, that of the shortcut convolution where there is one, the sum, the division); here one,
  in float32, rounded once (a rounding change, which is why only fast mode uses it).
* :func:`upsample_nearest2x`: nearest-neighbour upsampling by two. PyTorch's channels-last kernel for
  it is several times slower than its contiguous one; this is a plain copy, so its bytes equal
  ``F.interpolate(x, scale_factor=2.0, mode="nearest")``'s.

Both run the Triton kernels on a CUDA tensor they take and PyTorch's operators elsewhere
(:func:`reference_residual_sum`, ``F.interpolate``); fixed launch configurations, no atomics. Plain
functions, not custom operators: fast mode calls them in its eager-captured VAE decoder.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import triton_unavailable
from .group_norm import _DTYPES, _dense

__all__ = ["reference_residual_sum", "residual_sum", "upsample_nearest2x"]

_RESIDUAL_CONFIG = (4096, 4)  # (elements per program, warps)
_UPSAMPLE_TILE = 4096  # elements per program (pixels × channels, the channels rounded up to a power of two)


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
