"""The Triton kernels behind :mod:`bcg_diffusion.kernels.group_norm` (imported on their first call).

The input is seen as ``[N, C, S]`` with any channel and spatial strides (``S`` the flattened spatial
size): one of the two is 1 in the layouts a VAE decoder uses (contiguous, channels-last). A tile is
``[BLOCK_S, GPP * CG]``: ``BLOCK_S`` spatial positions of ``GPP`` whole groups of ``CG`` channels.

1. ``group_partials``: each program reduces up to ``iters`` tiles of one sample and one block of groups
   to each group's mean and sum of squared deviations from it (sums of values shifted by a sample of
   each channel, so a mean far from zero costs no precision);
2. ``group_moments``: one program per (sample, group) merges its partials with Chan's formula, in a
   fixed order, into the mean and ``1 / sqrt(var + eps)``;
3. ``group_apply``: each program normalises one tile, applies the affine weights and optionally SiLU,
   and writes it in the input's dtype, rounded once.

Everything is computed in float32 and no atomics are used, so a launch's bytes depend only on its
inputs and its fixed configuration.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _per_channel(per_group, GPP: tl.constexpr, CG: tl.constexpr):
    """``[GPP]`` values spread to the ``GPP * CG`` channels of their groups."""
    return tl.reshape(tl.broadcast_to(per_group[:, None], [GPP, CG]), [GPP * CG])


@triton.jit
def _load_tile(x_ptr, pre_bias_ptr, s, channels, stride_c, stride_s, S,
               HAS_PRE_BIAS: tl.constexpr):  # fmt: skip
    rows = s < S
    x = tl.load(
        x_ptr + s[:, None].to(tl.int64) * stride_s + channels[None, :] * stride_c, mask=rows[:, None], other=0.0
    )
    x = x.to(tl.float32)
    if HAS_PRE_BIAS:
        x = x + tl.load(pre_bias_ptr + channels).to(tl.float32)[None, :]
    return x, rows


@triton.jit
def group_partials(x_ptr, pre_bias_ptr, mean_ptr, m2_ptr, S, stride_n, stride_c, stride_s, iters, chunks, groups,
                   CG: tl.constexpr, GPP: tl.constexpr, BLOCK_S: tl.constexpr,
                   HAS_PRE_BIAS: tl.constexpr):  # fmt: skip
    """Partials ``[N, G, chunks]`` (mean, M2) of chunk ``program_id(0)`` (up to ``iters`` tiles) of sample
    ``program_id(1)``, groups ``program_id(2) * GPP ...``.

    Each element accumulates its deviation from a per-channel shift (the chunk's first row) and its
    square, with no reduction inside the loop, so the loads of successive tiles overlap; the sums of
    shifted values keep the variance where the mean is far from zero (a plain sum of squares would not).
    """
    chunk = tl.program_id(0)
    n = tl.program_id(1)
    first_group = tl.program_id(2) * GPP
    channels = first_group * CG + tl.arange(0, GPP * CG)
    x_ptr += n.to(tl.int64) * stride_n
    first = chunk * iters * BLOCK_S
    steps = tl.minimum(iters, tl.cdiv(S - first, BLOCK_S))
    shift = tl.load(x_ptr + first.to(tl.int64) * stride_s + channels * stride_c).to(tl.float32)
    total = tl.zeros([BLOCK_S, GPP * CG], dtype=tl.float32)
    squares = tl.zeros([BLOCK_S, GPP * CG], dtype=tl.float32)
    for i in range(steps):
        s = first + i * BLOCK_S + tl.arange(0, BLOCK_S)
        x, rows = _load_tile(x_ptr, pre_bias_ptr, s, channels, stride_c, stride_s, S, False)
        deviation = tl.where(rows[:, None], x - shift[None, :], 0.0)
        total += deviation
        squares += deviation * deviation
    count = tl.minimum(S - first, iters * BLOCK_S).to(tl.float32)  # rows of each channel in this chunk
    channel_mean = tl.sum(total, axis=0) / count  # from the shift
    channel_m2 = tl.maximum(tl.sum(squares, axis=0) - tl.sum(total, axis=0) * channel_mean, 0.0)
    channel_mean += shift
    if HAS_PRE_BIAS:
        channel_mean += tl.load(pre_bias_ptr + channels).to(tl.float32)
    mean = tl.sum(tl.reshape(channel_mean, [GPP, CG]), axis=1) / CG
    spread = channel_mean - _per_channel(mean, GPP, CG)
    m2 = tl.sum(tl.reshape(channel_m2 + count * spread * spread, [GPP, CG]), axis=1)
    out = (n * groups + first_group + tl.arange(0, GPP)) * chunks + chunk
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)


@triton.jit
def group_moments(mean_ptr, m2_ptr, stats_ptr, S, chunk_size, chunks, per_group, eps,
                  BLOCK_R: tl.constexpr):  # fmt: skip
    """Row ``program_id(0)`` (one sample's group) of the partials to ``stats[row] = (mean, rstd)``. Its
    sizes are all run-time values: one build serves every layer."""
    row = tl.program_id(0).to(tl.int64)
    count = (S * per_group).to(tl.float32)
    weighted = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, chunks, BLOCK_R):
        c = start + tl.arange(0, BLOCK_R)
        valid = c < chunks
        n_c = (tl.minimum(S - c * chunk_size, chunk_size) * per_group).to(tl.float32)
        weighted += tl.where(valid, n_c * tl.load(mean_ptr + row * chunks + c, mask=valid, other=0.0), 0.0)
    mean = tl.sum(weighted, axis=0) / count
    m2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, chunks, BLOCK_R):
        c = start + tl.arange(0, BLOCK_R)
        valid = c < chunks
        n_c = (tl.minimum(S - c * chunk_size, chunk_size) * per_group).to(tl.float32)
        delta = tl.load(mean_ptr + row * chunks + c, mask=valid, other=0.0) - mean
        m2 += tl.where(valid, tl.load(m2_ptr + row * chunks + c, mask=valid, other=0.0) + n_c * delta * delta, 0.0)
    var = tl.sum(m2, axis=0) / count
    tl.store(stats_ptr + row * 2, mean)
    tl.store(stats_ptr + row * 2 + 1, 1.0 / tl.sqrt_rn(var + eps))


@triton.jit
def group_apply(x_ptr, out_ptr, stats_ptr, weight_ptr, bias_ptr, pre_bias_ptr, S, stride_n, stride_c, stride_s,
                groups, CG: tl.constexpr, GPP: tl.constexpr, BLOCK_S: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_PRE_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """``out = silu?((x + pre_bias - mean) * rstd * weight + bias)`` for tile ``program_id(0)`` of sample
    ``program_id(1)``, groups ``program_id(2) * GPP ...``; ``out`` strided as ``x``."""
    n = tl.program_id(1)
    first_group = tl.program_id(2) * GPP
    channels = first_group * CG + tl.arange(0, GPP * CG)
    stat = (n * groups + first_group + tl.arange(0, GPP)) * 2
    mean = _per_channel(tl.load(stats_ptr + stat), GPP, CG)
    scale = _per_channel(tl.load(stats_ptr + stat + 1), GPP, CG)
    if HAS_WEIGHT:
        scale = scale * tl.load(weight_ptr + channels).to(tl.float32)
    shift = -mean * scale
    if HAS_BIAS:
        shift = shift + tl.load(bias_ptr + channels).to(tl.float32)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offset = n.to(tl.int64) * stride_n
    x, rows = _load_tile(x_ptr + offset, pre_bias_ptr, s, channels, stride_c, stride_s, S, HAS_PRE_BIAS)
    y = x * scale[None, :] + shift[None, :]
    if SILU:
        y = y / (1.0 + tl.exp2(-LOG2E * y))
    where = offset + s[:, None].to(tl.int64) * stride_s + channels[None, :] * stride_c
    tl.store(out_ptr + where, y.to(out_ptr.dtype.element_ty), mask=rows[:, None])
