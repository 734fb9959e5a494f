"""The Triton kernel behind :mod:`bcg_diffusion.kernels.activation_fp8` (imported on its first call: importing
Triton costs about a second and needs a CUDA build of PyTorch, or ``TRITON_INTERPRET=1`` on a CPU).

One program takes one row of the feature dimension. When ``BLOCK`` covers the row, it is read once and
its activation stays in registers until the row's scale is known. Otherwise the row is taken in chunks
of ``BLOCK`` elements, twice: the first pass computes the activation and keeps the row's largest
magnitude, the second computes it again and stores it divided by the row's scale (its second read
mostly comes from L2). Either way the float8 row is written once, the scale once. The row length is a
compile-time constant: a model has one or two feed-forward widths.

The activation is the tanh GELU of ``X`` or, with ``SWIGLU``, ``silu(X) * G``. With ``HEAD_COLUMNS``, the row
quantized is ``[H | activation]``: ``H``'s row (no activation) comes first in the output and shares the
scale, as FLUX's single blocks join their attention output and their MLP's GELU before one product. ``H``'s
row is read in one block of ``HEAD_BLOCK`` elements, twice (its second read from L2). ``APPROXIMATE`` trades the
last float32 bits for speed: the GPU's fast exp2 and division instead of libdevice's tanh or exp and a
rounded division, and a product with the row scale's reciprocal instead of a rounded division, each a
few float32 ulps from exact (a bf16 step is 2^16 of them). At Qwen-Image's width the exact kernel spends
its time in those instructions, not in memory (H200, run 95).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr object


@triton.jit
def _gelu(x, APPROXIMATE: tl.constexpr):
    """PyTorch's tanh GELU, ``0.5 x (1 + tanh(u))`` with ``u = β (x + κ x³)``, in float32."""
    beta: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
    kappa: tl.constexpr = 0.044715
    if APPROXIMATE:
        # The same function as x / (1 + e^(-2u)) = x / (1 + 2^(-2 u log2(e))): one exp2 and one fast
        # division, a few float32 ulps from exact everywhere. (The one-instruction tanh.approx is not
        # used: its error is absolute, which the GELU's negative tail, 1 + tanh(u) near 0, magnifies.)
        minus_two_log2e_beta: tl.constexpr = -2.0 * LOG2E * 0.7978845608028654
        return x / (1.0 + tl.exp2(minus_two_log2e_beta * x * (1.0 + kappa * x * x)))
    else:
        return 0.5 * x * (1.0 + libdevice.tanh(beta * (x + kappa * x * x * x)))  # PyTorch's CUDA kernel's steps


@triton.jit
def _silu(x, APPROXIMATE: tl.constexpr):
    """PyTorch's SiLU, ``x / (1 + e^(-x))``, in float32."""
    if APPROXIMATE:
        return x / (1.0 + tl.exp2(-LOG2E * x))
    else:
        return tl.math.div_rn(x, 1.0 + libdevice.exp(-x))


@triton.jit
def _activation(x_row, g_row, offsets, mask,
                HP_TY: tl.constexpr, SWIGLU: tl.constexpr, APPROXIMATE: tl.constexpr):  # fmt: skip
    """The activation at ``offsets`` of the row, rounded to the input's dtype at each step as PyTorch's
    operators round their outputs, back in float32."""
    x = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        gate = _silu(x, APPROXIMATE).to(HP_TY).to(tl.float32)
        up = tl.load(g_row + offsets, mask=mask, other=0.0).to(tl.float32)
        return (gate * up).to(HP_TY).to(tl.float32)
    else:
        return _gelu(x, APPROXIMATE).to(HP_TY).to(tl.float32)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # as torch's amax: a NaN anywhere gives NaN


@triton.jit
def _store_scaled(out_row, offsets, mask, value, scale, inverse, fp8_max,
                  FP8_TY: tl.constexpr, APPROXIMATE: tl.constexpr):  # fmt: skip
    scaled = value * inverse if APPROXIMATE else tl.math.div_rn(value, scale)
    scaled = tl.clamp(scaled, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_row + offsets, scaled.to(FP8_TY), mask=mask)


@triton.jit
def _head_largest(h_row, HEAD_COLUMNS: tl.constexpr, HEAD_BLOCK: tl.constexpr):
    """The largest magnitude of the head's row (0 without a head)."""
    if HEAD_COLUMNS > 0:
        offsets = tl.arange(0, HEAD_BLOCK)
        head = tl.load(h_row + offsets, mask=offsets < HEAD_COLUMNS, other=0.0).to(tl.float32)
        return tl.reduce(tl.abs(head), 0, _max_keeping_nan)
    else:
        return 0.0


@triton.jit
def activation_fp8_rows(X, G, H, OUT, SCALE, stride_x, stride_g, stride_h, stride_out, fp8_max,
                        COLUMNS: tl.constexpr, BLOCK: tl.constexpr, HEAD_COLUMNS: tl.constexpr,
                        HEAD_BLOCK: tl.constexpr, HP_TY: tl.constexpr, FP8_TY: tl.constexpr,
                        SWIGLU: tl.constexpr, APPROXIMATE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, g_row, h_row = X + row * stride_x, G + row * stride_g, H + row * stride_h
    head_out, out_row = OUT + row * stride_out, OUT + row * stride_out + HEAD_COLUMNS
    if BLOCK >= COLUMNS:
        offsets = tl.arange(0, BLOCK)
        mask = offsets < COLUMNS
        value = _activation(x_row, g_row, offsets, mask, HP_TY, SWIGLU, APPROXIMATE)
        largest = tl.reduce(tl.abs(value), 0, _max_keeping_nan)
    else:
        partial = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, COLUMNS, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            value = _activation(x_row, g_row, offsets, offsets < COLUMNS, HP_TY, SWIGLU, APPROXIMATE)
            partial = tl.maximum(partial, tl.abs(value), propagate_nan=tl.PropagateNan.ALL)
        largest = tl.reduce(partial, 0, _max_keeping_nan)
    if HEAD_COLUMNS > 0:
        largest = _max_keeping_nan(largest, _head_largest(h_row, HEAD_COLUMNS, HEAD_BLOCK))
    # torchao's row scale: the largest magnitude over the format's largest value, rounded to the
    # activation's dtype (its division runs in that dtype), then float32
    scale = tl.math.div_rn(largest, fp8_max).to(HP_TY).to(tl.float32)
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(SCALE + row, scale)
    if HEAD_COLUMNS > 0:
        head_offsets = tl.arange(0, HEAD_BLOCK)
        head_mask = head_offsets < HEAD_COLUMNS
        head = tl.load(h_row + head_offsets, mask=head_mask, other=0.0).to(tl.float32)
        _store_scaled(head_out, head_offsets, head_mask, head, scale, inverse, fp8_max, FP8_TY, APPROXIMATE)
    if BLOCK >= COLUMNS:
        _store_scaled(out_row, offsets, mask, value, scale, inverse, fp8_max, FP8_TY, APPROXIMATE)
    else:
        for start in range(0, COLUMNS, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < COLUMNS
            value = _activation(x_row, g_row, offsets, mask, HP_TY, SWIGLU, APPROXIMATE)
            _store_scaled(out_row, offsets, mask, value, scale, inverse, fp8_max, FP8_TY, APPROXIMATE)
