"""The Triton kernels behind :mod:`bcg_diffusion.kernels.vae_glue` (imported on their first call)."""

import triton
import triton.language as tl


@triton.jit
def residual_sum(hidden_ptr, residual_ptr, bias_ptr, out_ptr, numel, channel_stride, channels, scale,
                 BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """``out = (residual + hidden + bias[c]) / scale`` over ``BLOCK`` elements of dense memory that the
    three tensors lay out alike; an element at offset ``i`` is in channel ``(i // channel_stride) % channels``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < numel
    y = tl.load(hidden_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    y += tl.load(residual_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + (offsets // channel_stride) % channels, mask=valid, other=0.0).to(tl.float32)
    if SCALED:
        y = y / scale
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def upsample_nearest2x(x_ptr, out_ptr, height, width, channels,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Channels-last ``[N, H, W, C]`` memory to ``[N, 2H, 2W, C]``, each pixel copied to its 2×2 block:
    ``BLOCK_P`` output pixels of sample ``program_id(1)`` per program, ``BLOCK_C`` covering the channels."""
    n = tl.program_id(1).to(tl.int64)
    pixel = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    out_height, out_width = height * 2, width * 2
    valid = pixel < out_height * out_width
    row, column = pixel // out_width, pixel % out_width
    source = (n * height * width + (row // 2) * width + column // 2).to(tl.int64) * channels
    target = (n * out_height * out_width + pixel).to(tl.int64) * channels
    c = tl.arange(0, BLOCK_C)
    mask = valid[:, None] & (c[None, :] < channels)
    values = tl.load(x_ptr + source[:, None] + c[None, :], mask=mask)
    tl.store(out_ptr + target[:, None] + c[None, :], values, mask=mask)


@triton.jit
def channel_rms_norm(x_ptr, pre_bias_ptr, weight_ptr, bias_ptr, out_ptr, rows, channels, scale, eps,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_PRE_BIAS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """Rows of ``channels`` contiguous values (a channels-last activation, one row per pixel):
    ``x (+ pre_bias[c])``, then ``y = x / max(||x||, eps) * scale * weight[c] (+ bias[c])``, then SiLU if
    ``SILU``, in float32; ``BLOCK_R`` rows per program, ``BLOCK_C`` covering the channels."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (row < rows)[:, None] & (c < channels)[None, :]
    offsets = row[:, None] * channels + c[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE_BIAS:  # zero in the masked channels, so the norm stays theirs
        x += tl.load(pre_bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)[None, :]
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    weight = tl.load(weight_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
    y = x / norm[:, None] * (weight * scale)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
