"""The Triton kernel behind :mod:`bcg_diffusion.kernels.gelu_fp8` (imported on its first call: importing
Triton costs about a second and needs a CUDA build of PyTorch, or ``TRITON_INTERPRET=1`` on a CPU).

One program takes one row of the feature dimension in chunks of ``BLOCK`` elements, twice: the first pass
computes the tanh GELU, rounds it to the input's dtype and keeps the row's largest magnitude; the second
computes it again and stores it divided by the row's scale, as float8. The row is read twice and its
second read mostly comes from L2; the float8 row is written once, the scale once. The row length is a
compile-time constant: a model has one or two feed-forward widths.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _gelu_tanh(x):
    """PyTorch's tanh GELU as its CUDA kernel computes it, in float32: ``0.5 x (1 + tanh(β (x + κ x³)))``."""
    beta: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
    kappa: tl.constexpr = 0.044715
    cube = x * x * x
    return 0.5 * x * (1.0 + libdevice.tanh(beta * (x + kappa * cube)))


@triton.jit
def gelu_fp8_rows(X, OUT, SCALE, stride_x, stride_out, fp8_max,
                  COLUMNS: tl.constexpr, BLOCK: tl.constexpr, HP_TY: tl.constexpr, FP8_TY: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = X + row * stride_x, OUT + row * stride_out
    largest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, COLUMNS, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offsets, mask=offsets < COLUMNS, other=0.0).to(tl.float32)
        gelu = _gelu_tanh(x).to(HP_TY).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(gelu), propagate_nan=tl.PropagateNan.ALL)
    # torchao's row scale: the largest magnitude over the format's largest value, rounded to the
    # activation's dtype (its division runs in that dtype), then float32
    scale = tl.math.div_rn(tl.max(largest, axis=0), fp8_max).to(HP_TY).to(tl.float32)
    tl.store(SCALE + row, scale)
    for start in range(0, COLUMNS, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < COLUMNS
        x = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        gelu = _gelu_tanh(x).to(HP_TY).to(tl.float32)
        scaled = tl.clamp(tl.math.div_rn(gelu, scale), -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_row + offsets, scaled.to(FP8_TY), mask=mask)
