"""Attention's prologue in one pass: the query and key RMS norms, RoPE, and the joint text-and-image layout.

Before attention, Qwen-Image's processor RMS-norms the query and key of its two streams over the head
size, rotates them (RoPE), and concatenates text and image (text first) into the joint query, key and
value; Z-Image's norms and rotates its query and key. Compiled, inductor spends several kernels on it
(0.21 ms per Qwen-Image block at 1024² with CFG for the query and key, 0.13–0.15 ms for the value's
joint tensor and the output's slicing, H200), against a data floor of about 0.06 ms for the query and
key: read each once, write each once. This kernel does exactly that, in one launch per attention call
(80.7 µs at Qwen-Image 1024² with CFG, 3.9 TB/s, H200 run 87):

* :func:`joint_qkv` (Qwen-Image): from the six projections ``[B, S, H, D]`` (any strides with ``D``
  contiguous, as the linear outputs are viewed) to the joint query, key and value. The batch may hold
  up to :data:`MAX_GROUPS` equal groups of rows, each with its own number of valid text tokens (fast
  mode's CFG batch: cond rows, then uncond); each group's joint tensor is a slice of one buffer
  ``[B, S_text + S_image, H, D]``, its valid text placed right before the image
  (:func:`group_slices`), so no copy is left between this kernel and attention.
* :func:`joint_qkv_fp8` (Qwen-Image, for cuDNN's FP8 attention): the same, with the query and key written
  in float8 e4m3 at scales given beforehand (their RMS norms' bounds need no reduction) and the value's
  largest magnitude per group reduced on the way, so that no pass over the query and key is left
  between this kernel and attention, and none to scale the value but its cast.
* :func:`norm_rope` (Z-Image, FLUX's single-stream attention): query and key normed and rotated, one
  ``[B, S, H, D]`` each; :func:`norm_rope_fp8` the same written in float8 at given scales, the value's
  largest magnitude reduced in the same pass.

FLUX (:mod:`bcg_diffusion.patches.flux_attention`) takes the same kernels with its own two conventions
(``norm="torch"``, frequencies as a ``(cos, sin)`` pair): ``torch.nn.RMSNorm``'s rounding, and diffusers'
``apply_rotary_emb(use_real=True)``. Its double-stream attention is :func:`joint_qkv` with one group.

Arithmetic, per row of ``D``: diffusers' ``RMSNorm`` as it rounds (mean of squares and normalization in
float32, cast to the weight's dtype, times the weight, rounded), or with ``norm="torch"``
``torch.nn.RMSNorm``'s (normalized and weighted in float32, rounded once); then the pairwise rotation of
:func:`bcg_diffusion.patches.rope.rotate_pairs` in float32 on the real view ``[..., S, D/2, 2]`` of the
complex frequencies, or with ``(cos, sin)`` ``[S, D]`` frequencies diffusers' real form
(:func:`rotate_real`), rounded to the inputs' dtype. The plain-PyTorch reference (:func:`reference_joint_qkv`,
:func:`reference_norm_rope`) computes the same with PyTorch's operators; it runs where the kernel cannot
(CPU, no Triton), and the tests hold the kernel to it (Triton's interpreter on a CPU, the GPU).

Both are PyTorch custom operators (``bcg_diffusion::joint_qkv``, ``bcg_diffusion::norm_rope``), so a
compiled block calls them without a graph break. The launch configuration is fixed (no autotuning: a
timing-based choice could change bytes between processes). Needs Triton and a CUDA GPU
(:func:`unavailable`); :func:`unsupported_joint` and :func:`unsupported_norm_rope` say which tensors the
kernel refuses (only tensor properties, decided when a compiled block is traced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import triton_unavailable
from .cudnn_fp8_attention import quantize

__all__ = [
    "MAX_GROUPS",
    "NORMS",
    "Fp8Joint",
    "Freqs",
    "group_slices",
    "joint_qkv",
    "joint_qkv_fp8",
    "norm_rope",
    "norm_rope_fp8",
    "reference_joint_qkv",
    "reference_joint_qkv_fp8",
    "reference_norm_rope",
    "reference_norm_rope_fp8",
    "rms_norm",
    "rotate_real",
    "unavailable",
    "unsupported_joint",
    "unsupported_joint_fp8",
    "unsupported_norm_rope",
    "unsupported_norm_rope_fp8",
]

MAX_GROUPS = 4  # groups of rows with their own text length, as the kernel takes them (scalars)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# How the RMS norms round: as diffusers' ``RMSNorm`` does (Qwen-Image, Z-Image), or ``torch.nn.RMSNorm`` (FLUX).
NORMS = ("diffusers", "torch")
# One stream's RoPE frequencies: the float32 real view ``[..., S, D/2, 2]`` of complex ones (Qwen-Image,
# Z-Image), a pair ``(cos, sin)`` of float32 ``[S, D]`` as diffusers' ``apply_rotary_emb(use_real=True)`` takes
# them (FLUX), or None (no RoPE).
Freqs = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
# (rows of D per program, warps). On an H200 (run 87, bench.probes.probe_attention_kernels --sections prologue)
# the six settings tried were within 4% of each other at Qwen-Image's 1024² CFG shapes, except 64 and 128 rows
# (slower by 25%); (16, 2) was 1% faster than (32, 4) at both shapes, within the noise. Built for sm_90,
# (32, 4) spills registers (255 used, 184-420 bytes of spill stores; 64 rows: up to 768), (16, 2) does not
# (about 195 registers, tests/test_kernels_sm90.py), with the FP8 outputs too.
_CONFIG = (16, 2)
# With (cos, sin) frequencies (FLUX's) a row holds twice D floats of them, and the pointers to read them: at
# (16, 2) the bf16 kernel spilled 32 bytes a thread (254 registers), at (8, 2) it uses 136 and none spills
# (sm_90, tests/test_kernels_sm90.py). On an H100 at a FLUX.1 single block's 4,608 tokens, every setting tried took
# 42-48 us in bf16 and 61-70 us in FP8; (8, 2) 43.9 and 61.3 us (run 180, bench.probes.probe_flux_prologue).
_CONFIG_REAL = (8, 2)


unavailable = triton_unavailable  # why the Triton kernel cannot run on a device (None: it can)


def _rows_unsupported(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> str | None:
    for t in tensors:
        if t.dim() != 4:
            return "the tensors are not [batch, tokens, heads, dim]"
        if t.dtype != like.dtype or t.device != like.device:
            return "the tensors differ in dtype or device"
        if t.shape[0] != like.shape[0] or t.shape[2:] != like.shape[2:]:
            return "the tensors differ in batch, heads or head size"
        if t.stride(-1) != 1:
            return "the last dimension is not contiguous"
    if like.dtype not in _DTYPES:
        return f"dtype {like.dtype} (needs one of {_DTYPES})"
    head_dim = like.shape[-1]
    if head_dim < 2 or head_dim & (head_dim - 1):
        return f"head size {head_dim} (needs a power of two)"
    return None


def _weights_unsupported(weights: Sequence[torch.Tensor | None], like: torch.Tensor) -> str | None:
    if all(w is None for w in weights):
        return None
    if any(w is None for w in weights):
        return "some of the query and key norms are missing, not all"
    for w in weights:
        if w.shape != like.shape[-1:] or w.dtype != like.dtype or w.device != like.device:
            return "a norm's weight is not [head size] in the tensors' dtype and device"
    return None


def _freqs_unsupported(freqs: Freqs, like: torch.Tensor, tokens: int, dims: tuple[int, ...]) -> str | None:
    if freqs is None:
        return None
    if isinstance(freqs, tuple):
        return _real_freqs_unsupported(freqs, like, tokens)
    if freqs.dtype != torch.float32 or freqs.device != like.device or freqs.dim() not in dims:
        return "the RoPE frequencies are not the float32 real view of complex64 frequencies on the tensors' device"
    if freqs.shape[-2:] != (like.shape[-1] // 2, 2):
        return "the RoPE frequencies do not fit the head size"
    if freqs.stride(-1) != 1 or (freqs.shape[-2] > 1 and freqs.stride(-2) != 2):
        return "a token's RoPE frequencies are not contiguous"
    # Token counts are compared eagerly only: compiled, they are symbolic (fast mode reuses its blocks
    # across prompt lengths) and a comparison would guard on them.
    if not torch.compiler.is_compiling() and freqs.shape[-3] < tokens:
        return "fewer RoPE frequencies than tokens"
    if freqs.dim() == 4 and freqs.shape[0] not in (1, like.shape[0]):
        return "the RoPE frequencies' batch is neither 1 nor the tensors'"
    return None


def _real_freqs_unsupported(freqs: tuple[torch.Tensor, ...], like: torch.Tensor, tokens: int) -> str | None:
    if len(freqs) != 2 or not all(isinstance(f, torch.Tensor) for f in freqs):
        return "RoPE frequencies as a tuple must be (cos, sin)"
    cos, sin = freqs
    if any(f.dtype != torch.float32 or f.device != like.device or f.dim() != 2 for f in freqs):
        return "the RoPE cosines and sines are not float32 [tokens, head size] on the tensors' device"
    if cos.shape != sin.shape or cos.shape[-1] != like.shape[-1]:
        return "the RoPE cosines and sines do not fit the head size"
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return "the RoPE cosines and sines are not laid out alike, each token's contiguous"
    if not torch.compiler.is_compiling() and cos.shape[0] < tokens:  # eagerly only, as for complex ones
        return "fewer RoPE frequencies than tokens"
    return None


def _norm_unsupported(norm: str) -> str | None:
    return None if norm in NORMS else f"norm {norm!r} (expected one of {NORMS})"


def unsupported_joint(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    norm: str = "diffusers",
) -> str | None:
    """Why :func:`joint_qkv` refuses these arguments (None: it takes them). Only tensor properties and
    the number of groups, so that a compiled block decides it when it is traced (token counts are
    compared only outside compiled code)."""
    reason = _norm_unsupported(norm) or _rows_unsupported((*image, *text), image[0])
    reason = reason or _weights_unsupported(weights, image[0])
    reason = reason or _freqs_unsupported(freqs[0], image[0], image[0].shape[1], (3,))
    reason = reason or _freqs_unsupported(freqs[1], image[0], text[0].shape[1], (3,))
    if reason is None and (freqs[0] is None) != (freqs[1] is None):
        reason = "RoPE frequencies for one stream only"
    if reason is None and isinstance(freqs[0], tuple) != isinstance(freqs[1], tuple):
        reason = "RoPE frequencies of two forms, complex and (cos, sin)"
    if reason is None and not 0 < len(text_lengths) <= MAX_GROUPS:
        reason = f"{len(text_lengths)} groups of rows (the kernel takes 1 to {MAX_GROUPS})"
    if reason is None and image[0].shape[0] % len(text_lengths):
        reason = f"{len(text_lengths)} groups cannot split a batch of {image[0].shape[0]} rows"
    return reason


def unsupported_joint_fp8(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    descales: tuple[torch.Tensor, torch.Tensor],
    norm: str = "diffusers",
) -> str | None:
    """Why :func:`joint_qkv_fp8` refuses these arguments (None: it takes them): what
    :func:`unsupported_joint` names, or descales that are not one float32 number each on the tensors'
    device."""
    reason = unsupported_joint(image, text, weights, freqs, text_lengths, norm)
    return reason or _descales_unsupported(descales, image[0])


def _descales_unsupported(descales: Sequence[torch.Tensor], like: torch.Tensor) -> str | None:
    if any(d.dtype != torch.float32 or d.numel() != 1 or d.device != like.device for d in descales):
        return "the query's and key's descales are not one float32 number each on the tensors' device"
    return None


def unsupported_norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    freqs: Freqs,
    norm: str = "diffusers",
) -> str | None:
    """Why :func:`norm_rope` refuses these arguments (None: it takes them). Only tensor properties."""
    reason = _norm_unsupported(norm) or _rows_unsupported((query, key), query)
    if reason is None and query.shape[1] != key.shape[1]:
        reason = "query and key differ in tokens"
    reason = reason or _weights_unsupported(weights, query)
    return reason or _freqs_unsupported(freqs, query, query.shape[1], (3, 4))


def unsupported_norm_rope_fp8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    freqs: Freqs,
    descales: tuple[torch.Tensor, torch.Tensor],
    norm: str = "diffusers",
) -> str | None:
    """Why :func:`norm_rope_fp8` refuses these arguments (None: it takes them): what
    :func:`unsupported_norm_rope` names, a value unlike the query (shape, dtype, device, a contiguous last
    dimension), or descales that are not one float32 number each on the tensors' device."""
    reason = unsupported_norm_rope(query, key, weights, freqs, norm) or _rows_unsupported((value,), query)
    if reason is None and value.shape != query.shape:
        reason = "the value's shape is not the query's"
    return reason or _descales_unsupported(descales, query)


def joint_qkv(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The joint query, key and value of a two-stream attention, in one pass.

    ``image`` and ``text``: ``(query, key, value)`` each ``[B, S, H, D]`` (the same ``B``, ``H``, ``D``,
    dtype and device; any strides with ``D`` contiguous). ``weights``: the RMS norms' weights ``[D]`` of
    the image query, image key, text query and text key (all four None: no norm), ``eps`` theirs.
    ``freqs``: (image, text) real views ``[S, D/2, 2]`` (float32) of the complex RoPE frequencies, or
    (image, text) ``(cos, sin)`` pairs ``[S, D]`` (float32; diffusers' real form, :func:`rotate_real`), or
    ``(None, None)``: no RoPE. ``norm``: how the norms round, one of :data:`NORMS` (``"torch"``:
    ``torch.nn.RMSNorm``'s). ``text_lengths``: valid text tokens of each of the equal groups of
    consecutive rows (``[0, length)``; one group: ``(S_text,)``).

    Returns query, key and value ``[B, S_text + S_image, H, D]``, contiguous, in the inputs' dtype: the
    query and key normed and rotated, the value as it was; row ``b`` of group ``g`` holds its valid text
    at ``[S_text - text_lengths[g], S_text)``, its image at ``[S_text, S_text + S_image)`` and is not
    written before (see :func:`group_slices`). Raises ValueError on what :func:`unsupported_joint` names.
    """
    reason = unsupported_joint(image, text, weights, freqs, text_lengths, norm)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's attention prologue cannot take these tensors: {reason}")
    normed = [w for w in weights if w is not None]
    (image_freqs, image_sin), (text_freqs, text_sin) = _op_freqs(freqs[0]), _op_freqs(freqs[1])
    args = (*image, *text, normed, [float(e) for e in eps], image_freqs, text_freqs, list(text_lengths))
    return tuple(torch.ops.bcg_diffusion.joint_qkv(*args, image_sin, text_sin, norm == "torch"))


def _op_freqs(freqs: Freqs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One stream's frequencies as the operators take them: the complex ones' real view, or the cosines,
    then the sines (None but for the ``(cos, sin)`` form)."""
    return freqs if isinstance(freqs, tuple) else (freqs, None)


def _from_op_freqs(freqs: torch.Tensor | None, sin: torch.Tensor | None) -> Freqs:
    return freqs if sin is None else (freqs, sin)


class Fp8Joint(NamedTuple):
    """:func:`joint_qkv_fp8`'s outputs: the joint tensors ``[B, S_text + S_image, H, D]`` (the query and
    key in float8 e4m3, the value in the inputs' dtype), the descales the query and key were quantized
    at, and ``value_largest`` ``[groups]`` (float32), the largest magnitude of each group's value rows."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_descale: torch.Tensor
    key_descale: torch.Tensor
    value_largest: torch.Tensor


def joint_qkv_fp8(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    *,
    norm: str = "diffusers",
) -> Fp8Joint:
    """:func:`joint_qkv` with the query and key quantized on the way for FP8 attention (cuDNN's, through
    :func:`bcg_diffusion.kernels.cudnn_fp8_attention.attention_quantized`).

    Takes :func:`joint_qkv`'s arguments and the query's and key's descales: float32 scalars, each a
    bound no element of its tensor exceeds, over 448 (``cudnn_fp8_attention.descale``). The query and key
    are stored as ``cudnn_fp8_attention.quantize(x, descale)`` of their bf16 values (an element past the
    bound saturates). Those are :func:`joint_qkv`'s but for a few elements per million: the two builds of
    the kernel round a rare norm differently, as each does against PyTorch, which moves an element by at
    most two bf16 steps of its head's largest. Returns :class:`Fp8Joint`, laid out as :func:`joint_qkv`'s
    outputs (:func:`group_slices` applies), with each group's largest value magnitude over its valid text
    and its image (NaN where the group's value holds one). Raises ValueError on what
    :func:`unsupported_joint_fp8` names.

    >>> joint = joint_qkv_fp8(image, text, weights, eps, freqs, (77,), descale_q, descale_k)  # doctest: +SKIP
    >>> joint.query.dtype, joint.value_largest.shape  # doctest: +SKIP
    (torch.float8_e4m3fn, torch.Size([1]))
    """
    descales = (query_descale, key_descale)
    reason = unsupported_joint_fp8(image, text, weights, freqs, text_lengths, descales, norm)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's attention prologue cannot take these tensors: {reason}")
    normed = [w for w in weights if w is not None]
    descales = tuple(d.reshape(()) for d in descales)
    (image_freqs, image_sin), (text_freqs, text_sin) = _op_freqs(freqs[0]), _op_freqs(freqs[1])
    args = (*image, *text, normed, [float(e) for e in eps], image_freqs, text_freqs, list(text_lengths), *descales)
    outputs = torch.ops.bcg_diffusion.joint_qkv_fp8(*args, image_sin, text_sin, norm == "torch")
    return Fp8Joint(*outputs[:3], *descales, outputs[3])


def group_slices(joint: torch.Tensor, text_lengths: Sequence[int], text_tokens: int) -> list[torch.Tensor]:
    """Each group's joint tensor ``[B / groups, text_lengths[g] + S_image, H, D]`` in one of
    :func:`joint_qkv`'s outputs (views: no copy). ``text_tokens``: ``S_text``."""
    rows = joint.shape[0] // len(text_lengths)
    return [joint[g * rows : (g + 1) * rows, text_tokens - length :] for g, length in enumerate(text_lengths)]


def norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: Freqs,
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key ``[B, S, H, D]`` RMS-normed (``weights``: query's and key's, both None: no norm;
    ``norm``: how they round, one of :data:`NORMS`) and rotated by ``freqs``: the real view
    ``[B or 1, S, D/2, 2]`` or ``[S, D/2, 2]`` (float32) of the complex frequencies, or a ``(cos, sin)`` pair
    ``[S, D]`` (float32; :func:`rotate_real`), or None (no RoPE). Returns two new contiguous ``[B, S, H, D]``
    in the inputs' dtype. Raises ValueError on what :func:`unsupported_norm_rope` names.

    >>> q, k = norm_rope(q, k, [attn.norm_q.weight, attn.norm_k.weight], [1e-6, 1e-6], (cos, sin), norm="torch")  # doctest: +SKIP
    """
    reason = unsupported_norm_rope(query, key, weights, freqs, norm)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's attention prologue cannot take these tensors: {reason}")
    normed = [w for w in weights if w is not None]
    freqs, sin = _op_freqs(freqs)
    eps = [float(e) for e in eps]
    return tuple(torch.ops.bcg_diffusion.norm_rope(query, key, normed, eps, freqs, sin, norm == "torch"))


def norm_rope_fp8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: Freqs,
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_rope` with the query and key written in float8 e4m3 for FP8 attention, and the value
    (``[B, S, H, D]`` like the query; read, not copied) reduced to its largest magnitude in the same pass.

    ``query_descale``, ``key_descale``: as :func:`joint_qkv_fp8` takes them; each of the query and key is
    stored as ``cudnn_fp8_attention.quantize(x, descale)`` of its bf16 values, :func:`norm_rope`'s but
    for a rare element, as for :func:`joint_qkv_fp8`. Returns two new contiguous ``[B, S, H, D]`` float8
    tensors and the value's largest magnitude (a float32 scalar; NaN where the value holds one). Raises
    ValueError on what :func:`unsupported_norm_rope_fp8` names."""
    descales = (query_descale, key_descale)
    reason = unsupported_norm_rope_fp8(query, key, value, weights, freqs, descales, norm)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's attention prologue cannot take these tensors: {reason}")
    normed = [w for w in weights if w is not None]
    descales = tuple(d.reshape(()) for d in descales)
    eps = [float(e) for e in eps]
    freqs, sin = _op_freqs(freqs)
    return tuple(
        torch.ops.bcg_diffusion.norm_rope_fp8(query, key, value, normed, eps, freqs, *descales, sin, norm == "torch")
    )


# -- the plain-PyTorch reference ------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Diffusers' ``RMSNorm.forward`` (not on NPUs, no bias) over the last dimension, its dtypes as it
    rounds them: the normalization in float32, cast to the weight's dtype when that is half precision,
    times the weight; without a weight, back to ``x``'s dtype."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden = x * torch.rsqrt(variance + eps)
    if weight is None:
        return hidden.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        hidden = hidden.to(weight.dtype)
    return hidden * weight


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` rotated pairwise by ``freqs`` (``[S, D/2, 2]`` or ``[B or 1, S, D/2, 2]``:
    cosine, sine), in float32, back in ``x``'s dtype: :func:`bcg_diffusion.patches.rope.rotate_pairs`'s
    arithmetic, operation for operation."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    freqs = freqs.unsqueeze(-3)  # [..., S, 1, D/2, 2], broadcast over heads
    cos, sin = freqs[..., 0], freqs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


def rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` rotated as diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` does
    it (``use_real=True``, pairs interleaved: FLUX's), operation for operation: ``cos``, ``sin`` ``[S, D]``
    (float32); each pair ``(a, b)`` of ``x`` rotated to ``(-b, a)``; ``x * cos + rotated * sin`` in float32,
    back in ``x``'s dtype."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, normed: bool, freqs: Freqs, norm: str
) -> torch.Tensor:
    if normed:  # torch.nn.RMSNorm's rounding (FLUX's), or diffusers' RMSNorm's
        x = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps) if norm == "torch" else rms_norm(x, weight, eps)
    if freqs is None:
        return x
    if isinstance(freqs, tuple):
        return rotate_real(x, *(f[: x.shape[1]] for f in freqs))
    return rotate(x, freqs[..., : x.shape[1], :, :])


def reference_joint_qkv(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`joint_qkv` in plain PyTorch (the same contract; rows before a group's valid text are
    zeros here)."""
    normed = any(w is not None for w in weights)
    batch, text_tokens = image[0].shape[0], text[0].shape[1]
    rows = batch // len(text_lengths)
    outputs = []
    for index in range(3):
        image_part, text_part = image[index], text[index][:, : max(text_lengths)]
        if index < 2:
            image_part = _norm_rope_reference(image_part, weights[index], eps[index], normed, freqs[0], norm)
            text_part = _norm_rope_reference(text_part, weights[2 + index], eps[2 + index], normed, freqs[1], norm)
        shape = (batch, text_tokens + image_part.shape[1], *image_part.shape[2:])
        joint = image_part.new_zeros(shape)
        joint[:, text_tokens:] = image_part
        for g, length in enumerate(text_lengths):
            joint[g * rows : (g + 1) * rows, text_tokens - length : text_tokens] = text_part[
                g * rows : (g + 1) * rows, :length
            ]
        outputs.append(joint)
    return outputs[0], outputs[1], outputs[2]


def reference_joint_qkv_fp8(
    image: Sequence[torch.Tensor],
    text: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`joint_qkv_fp8` in plain PyTorch: query, key, value and ``value_largest`` (the same
    contract; rows before a group's valid text are zeros here)."""
    query, key, value = reference_joint_qkv(image, text, weights, eps, freqs, text_lengths, norm=norm)
    groups = group_slices(value, text_lengths, text[0].shape[1])
    largest = torch.stack([group.abs().amax().float() for group in groups])
    return quantize(query, query_descale), quantize(key, key_descale), value, largest


def reference_norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: Freqs,
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_rope` in plain PyTorch."""
    normed = any(w is not None for w in weights)
    outputs = []
    for index, x in enumerate((query, key)):
        out = _norm_rope_reference(x, weights[index], eps[index], normed, freqs, norm)
        outputs.append(out.contiguous() if out is not x else x.clone(memory_format=torch.contiguous_format))
    return outputs[0], outputs[1]


def reference_norm_rope_fp8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    eps: Sequence[float],
    freqs: Freqs,
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    *,
    norm: str = "diffusers",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_rope_fp8` in plain PyTorch."""
    query, key = reference_norm_rope(query, key, weights, eps, freqs, norm=norm)
    return quantize(query, query_descale), quantize(key, key_descale), value.abs().amax().float()


# -- the kernel's launch and the operators ----------------------------------------------------------------


def _freq_strides(freqs: Freqs, batch: int) -> tuple[int, int]:
    """(batch stride, token stride) of frequencies ``[S, D/2, 2]``, ``[B or 1, S, D/2, 2]`` or ``(cos, sin)``
    ``[S, D]``."""
    if freqs is None:
        return 0, 0
    if isinstance(freqs, tuple):
        return 0, freqs[0].stride(0)
    if freqs.dim() == 3:
        return 0, freqs.stride(0)
    return (freqs.stride(0) if freqs.shape[0] == batch and batch > 1 else 0), freqs.stride(1)


def _launch(
    image: Sequence[torch.Tensor | None],
    text: Sequence[torch.Tensor] | None,
    weights: Sequence[torch.Tensor],
    eps: Sequence[float],
    freqs: tuple[Freqs, Freqs],
    text_lengths: Sequence[int],
    outputs: Sequence[torch.Tensor | None],
    config: tuple[int, int] | None = None,
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    norm: str = "diffusers",
) -> None:
    """Run the kernel: ``image`` (query, key, value or None), ``text`` likewise or None (no text stream);
    ``weights`` four (image q, k, text q, k) or two (no text) or none; ``outputs`` (query, key, value or
    None: the value is read, not copied) ``[B, S_text + S_image, H, D]`` with equal strides. ``fp8``:
    (query's descale, key's descale, the value's largest magnitude per group, zeros) for float8 query and
    key outputs (see :func:`joint_qkv_fp8`). ``norm``: one of :data:`NORMS`. On CPU tensors it runs only in
    Triton's interpreter (``TRITON_INTERPRET=1``)."""
    import triton

    from . import _qk_prologue_triton as kernels

    q_img, k_img, v_img = image
    batch, seq_img, heads, head_dim = q_img.shape
    has_v = v_img is not None
    v_img = v_img if has_v else q_img
    store_v = has_v and outputs[2] is not None
    if text is None:
        q_txt, k_txt, v_txt = q_img, k_img, v_img
        seq_txt, text_lengths = 0, [0]
        weights = list(weights) * 2
        eps = list(eps) * 2
    else:
        q_txt, k_txt, v_txt = text
        seq_txt = q_txt.shape[1]
    normed = len(weights) > 0
    norm_kind = (2 if norm == "torch" else 1) if normed else 0  # as the kernel names them
    w = list(weights) if normed else [q_img] * 4  # unread without a norm: any pointer
    e = [float(x) for x in eps] if normed else [0.0] * 4
    rope = 0 if freqs[0] is None else 2 if isinstance(freqs[0], tuple) else 1  # as the kernel names them
    block_r, warps = config or (_CONFIG_REAL if rope == 2 else _CONFIG)
    # each stream's frequencies and sines (without a text stream, the image's); an unread pointer: any tensor
    f_img, s_img = _op_freqs(freqs[0]) if rope else (q_img, None)
    f_txt, s_txt = _op_freqs(freqs[1]) if freqs[1] is not None else (f_img, s_img)
    s_img, s_txt = (s if s is not None else f for s, f in ((s_img, f_img), (s_txt, f_txt)))
    lengths = [*text_lengths, *[0] * (MAX_GROUPS - len(text_lengths))]
    rows_per_group = batch // len(text_lengths)
    out_q, out_k, out_v = outputs
    out_v = out_v if store_v else out_q
    descale_q, descale_k, value_largest = fp8 if fp8 is not None else (q_img, q_img, q_img)  # unread: any pointer

    def strides(t: torch.Tensor) -> tuple[int, int, int]:
        return t.stride(0), t.stride(1), t.stride(2)

    txt_tiles = triton.cdiv(seq_txt * heads, block_r)
    grid = (txt_tiles + triton.cdiv(seq_img * heads, block_r), batch)
    device = torch.cuda.device(q_img.device) if q_img.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        kernels.qk_prologue[grid](
            q_img, k_img, v_img, w[0], w[1], f_img, s_img,
            *strides(q_img), *strides(k_img), *strides(v_img), *_freq_strides(freqs[0], batch), e[0], e[1],
            q_txt, k_txt, v_txt, w[2], w[3], f_txt, s_txt,
            *strides(q_txt), *strides(k_txt), *strides(v_txt), *_freq_strides(freqs[1], batch), e[2], e[3],
            out_q, out_k, out_v, *strides(out_q), descale_q, descale_k, value_largest,
            heads, seq_img, seq_txt, txt_tiles, rows_per_group, *lengths,
            HEAD_DIM=head_dim, BLOCK_R=block_r, HAS_V=has_v, STORE_V=store_v, NORM=norm_kind, ROPE=rope,
            FP8=fp8 is not None, num_warps=warps,
        )  # fmt: skip


def _use_triton(t: torch.Tensor) -> bool:
    return unavailable(t.device) is None


@torch.library.custom_op("bcg_diffusion::joint_qkv", mutates_args=())
def _joint_qkv_op(
    q_img: torch.Tensor,
    k_img: torch.Tensor,
    v_img: torch.Tensor,
    q_txt: torch.Tensor,
    k_txt: torch.Tensor,
    v_txt: torch.Tensor,
    weights: list[torch.Tensor],
    eps: list[float],
    image_freqs: torch.Tensor | None,
    text_freqs: torch.Tensor | None,
    text_lengths: list[int],
    image_sin: torch.Tensor | None = None,
    text_sin: torch.Tensor | None = None,
    torch_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    image, text = (q_img, k_img, v_img), (q_txt, k_txt, v_txt)
    freqs = (_from_op_freqs(image_freqs, image_sin), _from_op_freqs(text_freqs, text_sin))
    norm = NORMS[torch_norm]
    if not _use_triton(q_img):
        four = list(weights) if weights else [None] * 4
        return reference_joint_qkv(image, text, four, eps or [0.0] * 4, freqs, text_lengths, norm=norm)
    outputs = _joint_empty(q_img, q_txt.shape[1])
    _launch(image, text, weights, eps, freqs, text_lengths, outputs, norm=norm)
    return outputs


def _joint_shape(q_img: torch.Tensor, text_tokens: int) -> tuple[int, int, int, int]:
    """``[B, S_text + S_image, H, D]``: the shape of each joint tensor for image projections like ``q_img``."""
    batch, seq_img, heads, head_dim = q_img.shape
    return batch, text_tokens + seq_img, heads, head_dim


def _joint_empty(q_img: torch.Tensor, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(q_img.new_empty(_joint_shape(q_img, text_tokens)) for _ in range(3))


@_joint_qkv_op.register_fake
def _(q_img, k_img, v_img, q_txt, k_txt, v_txt, weights, eps, image_freqs, text_freqs, text_lengths,
      image_sin=None, text_sin=None, torch_norm=False):  # noqa: ANN001, ANN202  # fmt: skip
    return _joint_empty(q_img, q_txt.shape[1])


@torch.library.custom_op("bcg_diffusion::joint_qkv_fp8", mutates_args=())
def _joint_qkv_fp8_op(
    q_img: torch.Tensor,
    k_img: torch.Tensor,
    v_img: torch.Tensor,
    q_txt: torch.Tensor,
    k_txt: torch.Tensor,
    v_txt: torch.Tensor,
    weights: list[torch.Tensor],
    eps: list[float],
    image_freqs: torch.Tensor | None,
    text_freqs: torch.Tensor | None,
    text_lengths: list[int],
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    image_sin: torch.Tensor | None = None,
    text_sin: torch.Tensor | None = None,
    torch_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    image, text = (q_img, k_img, v_img), (q_txt, k_txt, v_txt)
    freqs = (_from_op_freqs(image_freqs, image_sin), _from_op_freqs(text_freqs, text_sin))
    norm = NORMS[torch_norm]
    if not _use_triton(q_img):
        four = list(weights) if weights else [None] * 4
        return reference_joint_qkv_fp8(
            image, text, four, eps or [0.0] * 4, freqs, text_lengths, query_descale, key_descale, norm=norm
        )
    query, key, value, largest = _joint_fp8_empty(q_img, q_txt.shape[1], len(text_lengths))
    largest.zero_()  # the kernel folds each tile's largest magnitude in by atomic max
    fp8 = (query_descale.contiguous(), key_descale.contiguous(), largest)
    _launch(image, text, weights, eps, freqs, text_lengths, (query, key, value), fp8=fp8, norm=norm)
    return query, key, value, largest


def _joint_fp8_empty(
    q_img: torch.Tensor, text_tokens: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = _joint_shape(q_img, text_tokens)
    query, key = (q_img.new_empty(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
    return query, key, q_img.new_empty(shape), q_img.new_empty(groups, dtype=torch.float32)


@_joint_qkv_fp8_op.register_fake
def _(q_img, k_img, v_img, q_txt, k_txt, v_txt, weights, eps, image_freqs, text_freqs, text_lengths, qd, kd,
      image_sin=None, text_sin=None, torch_norm=False):  # noqa: ANN001, ANN202  # fmt: skip
    return _joint_fp8_empty(q_img, q_txt.shape[1], len(text_lengths))


@torch.library.custom_op("bcg_diffusion::norm_rope", mutates_args=())
def _norm_rope_op(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: list[torch.Tensor],
    eps: list[float],
    freqs: torch.Tensor | None,
    sin: torch.Tensor | None = None,
    torch_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs, norm = _from_op_freqs(freqs, sin), NORMS[torch_norm]
    if not _use_triton(query):
        two = list(weights) if weights else [None, None]
        return reference_norm_rope(query, key, two, eps or [0.0, 0.0], freqs, norm=norm)
    out_q, out_k = (query.new_empty(query.shape) for _ in range(2))
    _launch((query, key, None), None, weights, eps, (freqs, None), [0], (out_q, out_k, None), norm=norm)
    return out_q, out_k


@_norm_rope_op.register_fake
def _(query, key, weights, eps, freqs, sin=None, torch_norm=False):  # noqa: ANN001, ANN202
    return tuple(query.new_empty(query.shape) for _ in range(2))


@torch.library.custom_op("bcg_diffusion::norm_rope_fp8", mutates_args=())
def _norm_rope_fp8_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: list[torch.Tensor],
    eps: list[float],
    freqs: torch.Tensor | None,
    query_descale: torch.Tensor,
    key_descale: torch.Tensor,
    sin: torch.Tensor | None = None,
    torch_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    freqs, norm = _from_op_freqs(freqs, sin), NORMS[torch_norm]
    if not _use_triton(query):
        two = list(weights) if weights else [None, None]
        return reference_norm_rope_fp8(
            query, key, value, two, eps or [0.0, 0.0], freqs, query_descale, key_descale, norm=norm
        )
    out_q, out_k, largest = _norm_rope_fp8_empty(query)
    largest.zero_()  # the kernel folds each tile's largest value magnitude in by atomic max
    fp8 = (query_descale.contiguous(), key_descale.contiguous(), largest)
    _launch((query, key, value), None, weights, eps, (freqs, None), [0], (out_q, out_k, None), fp8=fp8, norm=norm)
    return out_q, out_k, largest


def _norm_rope_fp8_empty(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_q, out_k = (query.new_empty(query.shape, dtype=torch.float8_e4m3fn) for _ in range(2))
    return out_q, out_k, query.new_empty((), dtype=torch.float32)


@_norm_rope_fp8_op.register_fake
def _(query, key, value, weights, eps, freqs, query_descale, key_descale, sin=None, torch_norm=False):  # noqa: ANN001, ANN202
    return _norm_rope_fp8_empty(query)
