"""The Triton kernels behind :mod:`bcg_diffusion.kernels.attention` (imported on their first call: importing
Triton costs about a second and needs a CUDA build of PyTorch).

Two ways to read the tiles, same arithmetic: :func:`attention_forward` loads through pointers (any
strides), :func:`attention_forward_tma` through Hopper's tensor memory accelerator (descriptors built on
the host; strides must be multiples of 16 bytes). In FP8, ``qk_scale`` arrives folded into the query's
per-token scales times the key's per-head scale, and the probabilities are computed as ``2**(s - m + 8)``
(256 times the softmax numerator, so that e4m3 keeps small weights); the row sums carry the same factor,
which cancels in the final division.
"""

# ruff: noqa: SIM108  (branches on constexpr flags read better as statements in kernel code)

import triton
import triton.language as tl


@triton.jit
def _update(acc, m_i, l_i, s, v, valid, FP8: tl.constexpr, MASKED: tl.constexpr):
    """One block of keys of the online softmax: ``s`` the scaled logits in base 2, ``v`` the values."""
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    if FP8:
        p = tl.math.exp2(s - m_new[:, None] + 8.0)
    else:
        p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        acc = tl.dot(p.to(tl.float8e4nv), v, acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _row_scales(QS, KS, batch, head, offs_m, rows, stride_qsb, stride_qss, stride_ksb, qk_scale,
                BLOCK_M: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """What each row of logits is multiplied by: ``qk_scale`` (the softmax scale in base 2), times the
    query row's and the key head's quantization scales in FP8."""
    if FP8:
        scales = tl.load(QS + batch * stride_qsb + offs_m * stride_qss + head, mask=rows, other=0.0)
        return scales * tl.load(KS + batch * stride_ksb + head) * qk_scale
    return tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale


@triton.jit
def _finish(acc, l_i, VS, batch, head, offs_d, stride_vsb, stride_vsh, FP8: tl.constexpr):
    """The output rows: the accumulator over the row sums, times the value's channel scales in FP8."""
    if FP8:
        acc = acc * tl.load(VS + batch * stride_vsb + head * stride_vsh + offs_d)[None, :]
    return acc / l_i[:, None]


@triton.jit
def attention_forward(
    Q, K, V, Out, QS, KS, VS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_ob, stride_os, stride_oh,
    stride_qsb, stride_qss, stride_ksb, stride_vsb, stride_vsh,
    heads, seq_q, seq_k, full, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < seq_q
    q = tl.load(Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=rows[:, None], other=0.0)  # fmt: skip
    row_scale = _row_scales(QS, KS, batch, head, offs_m, rows, stride_qsb, stride_qss, stride_ksb, qk_scale,
                            BLOCK_M, FP8)  # fmt: skip
    k_ptrs = K + batch * stride_kb + head * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = V + batch * stride_vb + head * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for _ in tl.range(0, full, BLOCK_N):
        s = tl.dot(q, tl.load(k_ptrs)) * row_scale[:, None]
        acc, m_i, l_i = _update(acc, m_i, l_i, s, tl.load(v_ptrs), offs_n, FP8, False)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    if full < seq_k:
        valid = full + offs_n < seq_k
        s = tl.dot(q, tl.load(k_ptrs, mask=valid[None, :], other=0.0)) * row_scale[:, None]
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _update(acc, m_i, l_i, s, v, valid, FP8, True)
    out = _finish(acc, l_i, VS, batch, head, offs_d, stride_vsb, stride_vsh, FP8)
    tl.store(Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=rows[:, None])  # fmt: skip


@triton.jit
def _values(v_desc, batch, head, start_n, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """A block of values ``[BLOCK_N, HEAD_DIM]``; in FP8 read from ``[B, H, D, S]`` (keys contiguous: the
    layout in which Hopper's FP8 tensor cores take their second operand)."""
    if FP8:
        v = v_desc.load([batch, head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N).T
    else:
        v = v_desc.load([batch, start_n, head, 0]).reshape(BLOCK_N, HEAD_DIM)
    return v


@triton.jit
def attention_forward_tma(
    q_desc, k_desc, v_desc, o_desc, QS, KS, VS,
    stride_qsb, stride_qss, stride_ksb, stride_vsb, stride_vsh,
    heads, seq_q, seq_k, full, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = q_desc.load([batch, start_m * BLOCK_M, head, 0]).reshape(BLOCK_M, HEAD_DIM)
    row_scale = _row_scales(QS, KS, batch, head, offs_m, offs_m < seq_q, stride_qsb, stride_qss, stride_ksb,
                            qk_scale, BLOCK_M, FP8)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, full, BLOCK_N):
        s = tl.dot(q, k_desc.load([batch, start_n, head, 0]).reshape(BLOCK_N, HEAD_DIM).T) * row_scale[:, None]
        acc, m_i, l_i = _update(acc, m_i, l_i, s, _values(v_desc, batch, head, start_n, HEAD_DIM, BLOCK_N, FP8),
                                offs_n, FP8, False)  # fmt: skip
    if full < seq_k:
        # Keys past the end read as zeros (the descriptor's bounds) and are masked.
        s = tl.dot(q, k_desc.load([batch, full, head, 0]).reshape(BLOCK_N, HEAD_DIM).T) * row_scale[:, None]
        acc, m_i, l_i = _update(acc, m_i, l_i, s, _values(v_desc, batch, head, full, HEAD_DIM, BLOCK_N, FP8),
                                full + offs_n < seq_k, FP8, True)  # fmt: skip
    out = _finish(acc, l_i, VS, batch, head, offs_d, stride_vsb, stride_vsh, FP8)
    o_desc.store([batch, start_m * BLOCK_M, head, 0], out.to(o_desc.dtype).reshape(1, BLOCK_M, 1, HEAD_DIM))
