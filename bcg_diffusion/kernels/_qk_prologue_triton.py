"""The Triton kernel behind :mod:`bcg_diffusion.kernels.qk_prologue` (imported on its first call: importing
Triton costs about a second and needs a CUDA build of PyTorch, or ``TRITON_INTERPRET=1`` on a CPU).

One program takes ``BLOCK_R`` rows of ``HEAD_DIM`` (a row: one token of one head, rows ordered token-major
as ``[S, H]`` is in memory) of one batch row of one stream, and for those rows: the query and the key
RMS-normed and rotated, the value copied, each stored at its place in the joint tensors (with ``FP8``,
the query and key quantized to float8 by given scales and the value's largest magnitude reduced per group
of batch rows, by atomic max, as it is read: Z-Image's value is only read, not copied). Programs
``[0, txt_tiles)`` of the first grid axis take the text stream, the rest the image stream; the second
axis is the batch row. Everything is memory-bound: a row is read once and written once, the norm's
reduction stays in registers, the rotation's cosines and sines (one per token) are loaded once per tile
and serve the query and the key.

Requires the real view of complex frequencies to be contiguous over its last two dimensions (``D/2`` pairs
of floats; :func:`torch.view_as_real` of a complex tensor contiguous in its last dimension is), and cosines
and sines (diffusers' real form, FLUX's) each contiguous over a token's ``D`` and laid out alike.
"""

import triton
import triton.language as tl

from ._activation_fp8_triton import _max_keeping_nan


@triton.jit
def _norm_rope(x, w, eps, cos, sin, OUT_TY: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
               NORM: tl.constexpr, ROPE: tl.constexpr):  # fmt: skip
    """Rows ``x`` (float32 ``[BLOCK_R, HEAD_DIM]``) RMS-normed, then rotated. ``NORM`` 1: as diffusers'
    ``RMSNorm`` rounds (normalized in float32, cast to the weight's dtype, times the weight); 2: as
    ``torch.nn.RMSNorm`` does (normalized and weighted in float32, rounded once). ``ROPE`` 1: pairwise by
    ``(cos, sin)`` ``[BLOCK_R, HEAD_DIM / 2]`` (what ``patches.rope.rotate_pairs`` computes); 2: as diffusers'
    ``apply_rotary_emb(use_real=True)`` does, ``x * cos + rotated * sin`` with ``cos``, ``sin``
    ``[BLOCK_R, HEAD_DIM]`` and ``rotated`` each pair ``(a, b)`` made ``(-b, a)``. Returns float32 rows holding
    values of ``OUT_TY``."""
    if NORM == 1:
        mean_square = tl.sum(x * x, axis=1) / HEAD_DIM
        x = (x * tl.rsqrt(mean_square + eps)[:, None]).to(OUT_TY).to(tl.float32)
        x = (x * w[None, :]).to(OUT_TY).to(tl.float32)
    elif NORM == 2:
        mean_square = tl.sum(x * x, axis=1) / HEAD_DIM
        x = (x * tl.rsqrt(mean_square + eps)[:, None] * w[None, :]).to(OUT_TY).to(tl.float32)
    if ROPE == 1:
        real, imag = tl.split(tl.reshape(x, [BLOCK_R, HEAD_DIM // 2, 2]))
        x = tl.reshape(tl.join(real * cos - imag * sin, real * sin + imag * cos), [BLOCK_R, HEAD_DIM])
    elif ROPE == 2:
        real, imag = tl.split(tl.reshape(x, [BLOCK_R, HEAD_DIM // 2, 2]))
        rotated = tl.reshape(tl.join(-imag, real), [BLOCK_R, HEAD_DIM])
        x = x * cos + rotated * sin
    return x


@triton.jit
def _store(OUT, rows, d, x, mask, HP_TY: tl.constexpr, DESCALE, FP8: tl.constexpr):
    """Store rows ``x`` (float32) rounded to ``HP_TY``; with ``FP8``, then multiplied by the reciprocal of
    the scalar at ``DESCALE``, saturated to e4m3's range and rounded to ``OUT``'s float8 dtype (PyTorch's
    ``(x.float() * descale.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)``, the reciprocal
    correctly rounded: one division per program, not one per element)."""
    x = x.to(HP_TY)
    if FP8:
        scaled = x.to(tl.float32) * tl.math.div_rn(1.0, tl.load(DESCALE))
        x = tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(OUT + rows[:, None] + d[None, :], x.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _tile(Q, K, V, WQ, WK, F, F2, OQ, OK, OV, DQ, DK, VMAX,
          sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sf_b, sf_s, so_b, so_s, so_h,
          eps_q, eps_k, batch, group, tile, heads, tokens, valid_tokens, shift,
          HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, HAS_V: tl.constexpr, STORE_V: tl.constexpr,
          NORM: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """One tile of one stream: rows of tokens ``< valid_tokens``, token ``t`` stored at ``shift + t``; the
    frequencies at ``F`` (``ROPE`` 1: the real view of complex ones; 2: cosines, with the sines at ``F2``);
    with ``FP8``, the query and key stored in float8 (descales at ``DQ`` and ``DK``) and the largest
    magnitude of the tile's value rows (read with ``HAS_V``, copied with ``STORE_V``) folded into
    ``VMAX[group]``."""
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    token = r // heads
    head = r % heads
    valid = (r < tokens * heads) & (token < valid_tokens)
    d = tl.arange(0, HEAD_DIM)
    mask = valid[:, None]
    b = batch.to(tl.int64)
    token64 = token.to(tl.int64)
    out_rows = b * so_b + (shift + token64) * so_s + head * so_h
    hp_ty = Q.dtype.element_ty  # the model's dtype, in which every step rounds
    cos = 0.0
    sin = 0.0
    w_q = 0.0
    w_k = 0.0
    f_rows = (b * sf_b + token64 * sf_s)[:, None] + d[None, :]
    if ROPE == 1:  # a token's frequencies: D/2 (cosine, sine) pairs, read as D contiguous floats
        cos, sin = tl.split(tl.reshape(tl.load(F + f_rows, mask=mask, other=0.0), [BLOCK_R, HEAD_DIM // 2, 2]))
    elif ROPE == 2:  # D cosines and D sines, laid out alike
        cos = tl.load(F + f_rows, mask=mask, other=0.0)
        sin = tl.load(F2 + f_rows, mask=mask, other=0.0)
    if NORM != 0:
        w_q = tl.load(WQ + d).to(tl.float32)
        w_k = tl.load(WK + d).to(tl.float32)
    q = tl.load(Q + (b * sq_b + token64 * sq_s + head * sq_h)[:, None] + d[None, :], mask=mask, other=0.0)
    q = _norm_rope(q.to(tl.float32), w_q, eps_q, cos, sin, hp_ty, BLOCK_R, HEAD_DIM, NORM, ROPE)
    _store(OQ, out_rows, d, q, mask, hp_ty, DQ, FP8)
    k = tl.load(K + (b * sk_b + token64 * sk_s + head * sk_h)[:, None] + d[None, :], mask=mask, other=0.0)
    k = _norm_rope(k.to(tl.float32), w_k, eps_k, cos, sin, hp_ty, BLOCK_R, HEAD_DIM, NORM, ROPE)
    _store(OK, out_rows, d, k, mask, hp_ty, DK, FP8)
    if HAS_V:
        v = tl.load(V + (b * sv_b + token64 * sv_s + head * sv_h)[:, None] + d[None, :], mask=mask, other=0.0)
        if STORE_V:
            tl.store(OV + out_rows[:, None] + d[None, :], v, mask=mask)
        if FP8:  # masked rows load zeros, which no magnitude is below
            largest = tl.reduce(tl.reduce(tl.abs(v.to(tl.float32)), 1, _max_keeping_nan), 0, _max_keeping_nan)
            # A magnitude's bits, read as an int32, order as the magnitude does, NaN above infinity: an
            # integer atomic max keeps NaN whatever Triton's float atomics do with it.
            bits = VMAX.to(tl.pointer_type(tl.int32))
            tl.atomic_max(bits + group, largest.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["len0", "len1", "len2", "len3", "txt_tiles", "rows_per_group"])
def qk_prologue(
    QI, KI, VI, WQI, WKI, FI, FI2,
    sqi_b, sqi_s, sqi_h, ski_b, ski_s, ski_h, svi_b, svi_s, svi_h, sfi_b, sfi_s, eps_qi, eps_ki,
    QT, KT, VT, WQT, WKT, FT, FT2,
    sqt_b, sqt_s, sqt_h, skt_b, skt_s, skt_h, svt_b, svt_s, svt_h, sft_b, sft_s, eps_qt, eps_kt,
    OQ, OK, OV, so_b, so_s, so_h, DQ, DK, VMAX,
    heads, seq_img, seq_txt, txt_tiles, rows_per_group, len0, len1, len2, len3,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, HAS_V: tl.constexpr, STORE_V: tl.constexpr,
    NORM: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Grid ``(txt_tiles + cdiv(seq_img * heads, BLOCK_R), batch)``. Batch row ``b`` belongs to group
    ``b // rows_per_group`` (at most four), whose valid text is ``len<group>`` tokens: its text token ``t``
    lands at ``seq_txt - len + t``, image token ``i`` at ``seq_txt + i``. With ``FP8``: ``DQ``, ``DK`` the
    query's and key's descales (float32 scalars), ``VMAX`` one float32 per group, zero before the launch,
    which ends as the largest magnitude of the group's value rows (valid text and image). ``NORM`` (0: none)
    and ``ROPE`` (0: none) as :func:`_norm_rope` takes them; ``FI2``, ``FT2`` the sines where ``ROPE`` is 2."""
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    group = batch // rows_per_group
    if pid < txt_tiles:  # without a text stream, txt_tiles is 0
        length = len3
        if group == 0:
            length = len0
        elif group == 1:
            length = len1
        elif group == 2:
            length = len2
        _tile(QT, KT, VT, WQT, WKT, FT, FT2, OQ, OK, OV, DQ, DK, VMAX,
              sqt_b, sqt_s, sqt_h, skt_b, skt_s, skt_h, svt_b, svt_s, svt_h, sft_b, sft_s, so_b, so_s, so_h,
              eps_qt, eps_kt, batch, group, pid, heads, seq_txt, length, seq_txt - length,
              HEAD_DIM, BLOCK_R, HAS_V, STORE_V, NORM, ROPE, FP8)  # fmt: skip
    else:
        _tile(QI, KI, VI, WQI, WKI, FI, FI2, OQ, OK, OV, DQ, DK, VMAX,
              sqi_b, sqi_s, sqi_h, ski_b, ski_s, ski_h, svi_b, svi_s, svi_h, sfi_b, sfi_s, so_b, so_s, so_h,
              eps_qi, eps_ki, batch, group, pid - txt_tiles, heads, seq_img, seq_img, seq_txt,
              HEAD_DIM, BLOCK_R, HAS_V, STORE_V, NORM, ROPE, FP8)  # fmt: skip
