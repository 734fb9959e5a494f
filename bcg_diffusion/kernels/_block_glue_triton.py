"""The Triton kernel behind :mod:`bcg_diffusion.kernels.block_glue` (imported on its first call: importing
Triton costs about a second and needs a CUDA build of PyTorch, or ``TRITON_INTERPRET=1`` on a CPU).

One program takes ``ROWS`` rows (tokens) of the model's width, each held whole in registers (``BLOCK``
covers the width), and for each: with ``RESIDUAL``, the gate times the branch's output added to the
residual stream, which is stored (Z-Image's block: the branch RMS-normed first, ``BRANCH_NORM``, and the
gate's tanh taken, ``TANH_GATE``); with ``QUANTIZE``, the stream normalized (RMS-normed with a weight, or
with ``LAYER_NORM`` a LayerNorm without one), times ``1 + scale`` (plus ``shift`` with ``SHIFT``), and
quantized row-wise to float8 (data and scale stored). Every step rounds to the model's dtype where
PyTorch's operators would. A token's modulation (gate, scale, shift) is that of its batch row ``b``; with
``PER_TOKEN`` (Qwen-Image-Edit-2511's ``zero_cond_t``), row ``b`` where the token's index is 0, else row
``b + batches`` (the modulation then has ``2 * batches`` rows).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._activation_fp8_triton import _max_keeping_nan


@triton.jit
def _rms_norm(v, W, offsets, mask, eps, COLUMNS: tl.constexpr, HP_TY: tl.constexpr):
    """diffusers' ``RMSNorm`` of rows ``v`` (float32 ``[ROWS, BLOCK]`` holding values of ``HP_TY``, zero
    past ``COLUMNS``): normalized in float32, rounded to the weight's dtype, times the weight, rounded."""
    variance = tl.sum(v * v, axis=1) / COLUMNS
    normed = (v * libdevice.rsqrt(variance + eps)[:, None]).to(HP_TY).to(tl.float32)
    weight = tl.load(W + offsets, mask=mask, other=0.0).to(tl.float32)
    return (normed * weight[None, :]).to(HP_TY).to(tl.float32)


@triton.jit
def _layer_norm(v, mask, eps, COLUMNS: tl.constexpr, HP_TY: tl.constexpr):
    """PyTorch's ``LayerNorm`` without weight or bias of rows ``v`` (as :func:`_rms_norm` takes them): the
    mean and variance in float32, ``(v - mean) * rsqrt(variance + eps)`` rounded once."""
    mean = tl.sum(v, axis=1) / COLUMNS
    centered = tl.where(mask[None, :], v - mean[:, None], 0.0)
    variance = tl.sum(centered * centered, axis=1) / COLUMNS
    return (centered * libdevice.rsqrt(variance + eps)[:, None]).to(HP_TY).to(tl.float32)


@triton.jit
def block_glue_rows(X, BRANCH, BRANCH_W, GATE, X_OUT, NORM_W, SCALE, SHIFT, OUT, OUT_SCALE, INDEX,
                    n_rows, rows_per_batch, batches, stride_x, stride_branch, stride_x_out, stride_out, stride_gate,
                    stride_scale, stride_shift, stride_index, branch_eps, eps, fp8_max,
                    COLUMNS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HP_TY: tl.constexpr,
                    FP8_TY: tl.constexpr, RESIDUAL: tl.constexpr, BRANCH_NORM: tl.constexpr,
                    TANH_GATE: tl.constexpr, QUANTIZE: tl.constexpr, LAYER_NORM: tl.constexpr,
                    SHIFT_ADD: tl.constexpr, APPROXIMATE: tl.constexpr, PER_TOKEN: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    batch = row // rows_per_batch
    if PER_TOKEN:  # the token's index picks the batch row's first or second modulation
        token = row - batch * rows_per_batch
        index = tl.load(INDEX + batch * stride_index + token, mask=row < n_rows, other=0)
        batch = tl.where(index == 0, batch, batch + batches)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < COLUMNS
    rows_mask = (row < n_rows)[:, None] & mask[None, :]
    x = tl.load(X + row[:, None] * stride_x + offsets[None, :], mask=rows_mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        branch = tl.load(BRANCH + row[:, None] * stride_branch + offsets[None, :], mask=rows_mask, other=0.0)
        branch = branch.to(tl.float32)
        if BRANCH_NORM:
            branch = _rms_norm(branch, BRANCH_W, offsets, mask, branch_eps, COLUMNS, HP_TY)
        gate = tl.load(GATE + batch[:, None] * stride_gate + offsets[None, :], mask=rows_mask, other=0.0)
        gate = gate.to(tl.float32)
        if TANH_GATE:
            gate = libdevice.tanh(gate).to(HP_TY).to(tl.float32)
        x = (x + (gate * branch).to(HP_TY).to(tl.float32)).to(HP_TY).to(tl.float32)
        tl.store(X_OUT + row[:, None] * stride_x_out + offsets[None, :], x.to(HP_TY), mask=rows_mask)
    if QUANTIZE:
        if LAYER_NORM:
            hidden = _layer_norm(x, mask, eps, COLUMNS, HP_TY)
        else:
            hidden = _rms_norm(x, NORM_W, offsets, mask, eps, COLUMNS, HP_TY)
        scale = tl.load(SCALE + batch[:, None] * stride_scale + offsets[None, :], mask=rows_mask, other=0.0)
        hidden = (hidden * (1.0 + scale.to(tl.float32)).to(HP_TY).to(tl.float32)).to(HP_TY).to(tl.float32)
        if SHIFT_ADD:
            shift = tl.load(SHIFT + batch[:, None] * stride_shift + offsets[None, :], mask=rows_mask, other=0.0)
            hidden = (hidden + shift.to(tl.float32)).to(HP_TY).to(tl.float32)
        largest = tl.reduce(tl.abs(hidden), 1, _max_keeping_nan)
        # torchao's row scale: the largest magnitude over the format's largest value, in the model's dtype
        row_scale = tl.math.div_rn(largest, fp8_max).to(HP_TY).to(tl.float32)
        tl.store(OUT_SCALE + row, row_scale, mask=row < n_rows)
        if APPROXIMATE:
            scaled = hidden * tl.math.div_rn(1.0, row_scale)[:, None]
        else:
            scaled = tl.math.div_rn(hidden, row_scale[:, None])
        scaled = tl.clamp(scaled, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        tl.store(OUT + row[:, None] * stride_out + offsets[None, :], scaled.to(FP8_TY), mask=rows_mask)
