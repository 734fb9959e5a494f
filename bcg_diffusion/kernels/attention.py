"""Attention forward in Triton, in bf16/fp16 and in FP8, on diffusers' ``[batch, tokens, heads, dim]`` layout.

Diffusion transformers attend without a mask over one joint sequence (text and image tokens), so this is
the plain, non-causal forward only: one program per block of queries and (batch, head), an online softmax
over blocks of keys (the FlashAttention recurrence), the output written straight into ``[B, S, H, D]`` so
that the projection after it reads it with no copy.

Two entry points:

* :func:`attention` (bf16/fp16): what PyTorch's SDPA computes, rounded differently;
* :func:`fp8_attention`: query, key and value quantized to float8 e4m3 (see
  :func:`quantize_for_fp8_attention`), the probabilities scaled by 256 and quantized to e4m3 before they
  meet the values: probabilities are in [0, 1], and e4m3's smallest subnormal is 2**-9, so unscaled, the
  weights under 0.002 (over thousands of keys, much of the softmax's mass) would vanish. Both products
  run at FP8 rate. Its error against bf16 attention is measured in ``docs/quantization.md``; it is an
  opt-in of fast mode, never a default.

Both are PyTorch custom operators (``bcg_diffusion::attention``, ``bcg_diffusion::fp8_attention``): inductor
compiles the quantization around them into the kernels that produce the query, key and value, and calls
the kernel as it is. The launch configuration is fixed per dtype (measured on an H200, run 84), not
autotuned at run time: a choice made by timing could differ between two processes or two warm-ups and
change the output's bytes, which fast mode promises to keep (with and without graphs).

Needs Triton and a CUDA GPU of compute capability 8.9 or newer (9.0 measured): :func:`unavailable`
says why not; :func:`unsupported` says which tensors the kernels refuse.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_MAX",
    "attention",
    "fp8_attention",
    "layout_unsupported",
    "quantize_for_fp8_attention",
    "shapes_unsupported",
    "unavailable",
    "unsupported",
]

FP8_MAX = 448.0  # largest float8 e4m3 value
_HEAD_DIMS = (64, 128)
_LOG2E = 1.4426950408889634

# (tile reader, BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, the fastest of 12 measured on an H200
# at Qwen-Image's and Z-Image's 1024² shapes (run 84, `probe-attention-sweep-run84.log`): FP8 690 and 709
# TFLOP/s (cuDNN's bf16 kernel: 612 and 577), bf16 492 and 457 (so bf16 attention stays cuDNN's).
_CONFIGS = {"bf16": ("pointers", 128, 128, 8, 3), "fp8": ("tma", 64, 64, 4, 4)}


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (None: they can): they need Triton and a CUDA GPU of
    compute capability 8.9 or newer (FP8 tensor cores; measured on 9.0). Checked once, when fast mode
    sets a model up, never inside a compiled region."""
    from . import triton_unavailable

    reason = triton_unavailable(device)
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "the kernels need compute capability 8.9 or newer (FP8 tensor cores)"
    return None


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why these ``[B, S, H, D]`` tensors cannot go to the kernels (None: they can): they need CUDA,
    half precision, one head count, head size 64 or 128 and the last dimension contiguous. Only tensor
    properties, so that a compiled block decides it when it is traced."""
    if not (query.is_cuda and key.is_cuda and value.is_cuda):
        return "the tensors are not on a CUDA GPU"
    reason = layout_unsupported(query, key, value, _HEAD_DIMS)
    if reason is None and min(t.stride(-1) for t in (query, key, value)) != 1:
        return "the last dimension is not contiguous"
    return reason


def layout_unsupported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_dims: tuple[int, ...]
) -> str | None:
    """Why these tensors are not the ``[B, S, H, D]`` query, key and value that FP8 attention kernels
    take (None: they are): half precision, and what :func:`shapes_unsupported` asks."""
    if query.dtype not in (torch.bfloat16, torch.float16) or not (query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} (needs bfloat16 or float16, the same for query, key and value)"
    return shapes_unsupported(query, key, value, head_dims)


def shapes_unsupported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_dims: tuple[int, ...]
) -> str | None:
    """Why these tensors' shapes are not a ``[B, S, H, D]`` query, key and value (None: they are): one
    batch and head count, the key's and value's tokens alike, a head size in ``head_dims``."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "the tensors are not [batch, tokens, heads, dim]"
    if query.shape[0] != key.shape[0] or key.shape[:3] != value.shape[:3] or query.shape[2] != key.shape[2]:
        return "query, key and value disagree in batch, tokens or heads (grouped heads are not supported)"
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or query.shape[-1] not in head_dims:
        return f"head size {query.shape[-1]} (needs one of {head_dims}, the same for all three)"
    return None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Softmax attention without a mask, ``[B, S, H, D]`` in (any strides with ``D`` contiguous), a new
    contiguous ``[B, S, H, D]`` out, in the inputs' dtype. ``scale`` defaults to ``1 / sqrt(D)``.

    Refuses (ValueError) what :func:`unsupported` names.
    """
    reason = unsupported(query, key, value)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's Triton attention cannot run here: {reason}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return torch.ops.bcg_diffusion.attention(query, key, value, scale)


def quantize_for_fp8_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The FP8 kernel's inputs: ``(query, query scales, key, key scales, value, value scales)``.

    Query ``[B, S, H, D]`` becomes e4m3 with one float32 scale per token and head (``[B, S, H]``: the
    row's largest magnitude over 448), key with one per head (``[B, H]``; keys come out of a norm, so
    their magnitudes vary little across tokens), value e4m3 laid out ``[B, H, D, S']`` (``S`` padded to
    a multiple of 16 bytes: the layout in which Hopper's FP8 tensor cores read their second operand)
    with one scale per channel and head (``[B, H, D]``). Plain PyTorch operations, so that inside a
    compiled block inductor fuses them into the kernels that produce the tensors.
    """
    query_scales = query.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    query8 = (query.float() / query_scales).to(torch.float8_e4m3fn)
    key_scales = key.abs().amax(dim=(1, 3)).float().clamp(min=1e-12) / FP8_MAX  # [B, H]
    key8 = (key.float() / key_scales[:, None, :, None]).to(torch.float8_e4m3fn)
    value_scales = value.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX  # [B, H, D]
    value8 = (value.float() / value_scales[:, None]).permute(0, 2, 3, 1)  # [B, H, D, S]
    value8 = F.pad(value8, (0, -value.shape[1] % 16)).to(torch.float8_e4m3fn).contiguous()
    return query8, query_scales.squeeze(-1), key8, key_scales, value8, value_scales


def fp8_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """:func:`attention` with both products in FP8 (see the module's docstring): ``[B, S, H, D]`` in, a
    new contiguous ``[B, S, H, D]`` out in the inputs' dtype. Refuses (ValueError) what
    :func:`unsupported` names."""
    reason = unsupported(query, key, value)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's FP8 attention cannot take these tensors: {reason}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return torch.ops.bcg_diffusion.fp8_attention(*quantize_for_fp8_attention(query, key, value), scale, query.dtype)


def _tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether Hopper's bulk copies can read these tensors: 16-byte aligned addresses and strides."""
    return all(
        t.is_cuda and t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in tensors
    )


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    value_view: torch.Tensor,
    out: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    fp8: bool,
) -> None:
    """Run the kernel. ``value`` as stored (``[B, S, H, D]``, or ``[B, H, D, S']`` in FP8);
    ``value_view`` the same memory as ``[B, S, H, D]`` for the pointer kernel."""
    import triton

    from . import _attention_triton as kernels

    batch, seq_q, heads, head_dim = query.shape
    seq_k = key.shape[1]
    reader, block_m, block_n, warps, stages = _CONFIGS["fp8" if fp8 else "bf16"]
    query_scales, key_scales, value_scales = scales
    grid = (triton.cdiv(seq_q, block_m), batch * heads)
    common = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, FP8=fp8, num_warps=warps, num_stages=stages)
    scale_strides = (query_scales.stride(0), query_scales.stride(1), key_scales.stride(0))
    scale_strides += (value_scales.stride(0), value_scales.stride(1))
    sizes = (heads, seq_q, seq_k, seq_k // block_n * block_n, scale * _LOG2E)
    device = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        if reader == "tma" and _tma_fits(query, key, value, out):
            from triton.tools.tensor_descriptor import TensorDescriptor

            def rows(t: torch.Tensor, block: int) -> TensorDescriptor:
                return TensorDescriptor.from_tensor(t, [1, block, 1, head_dim])

            values = TensorDescriptor.from_tensor(value, [1, 1, head_dim, block_n]) if fp8 else rows(value, block_n)
            kernels.attention_forward_tma[grid](
                rows(query, block_m), rows(key, block_n), values, rows(out, block_m),
                query_scales, key_scales, value_scales, *scale_strides, *sizes, **common,
            )  # fmt: skip
        else:
            kernels.attention_forward[grid](
                query, key, value_view, out, query_scales, key_scales, value_scales,
                query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
                value_view.stride(0), value_view.stride(1), value_view.stride(2), value_view.stride(3),
                out.stride(0), out.stride(1), out.stride(2), *scale_strides, *sizes, **common,
            )  # fmt: skip


@torch.library.custom_op("bcg_diffusion::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty(query.shape[:3] + (value.shape[-1],), dtype=query.dtype, device=query.device)
    # bf16 reads no scales: the query stands in for their pointers (no allocation per call).
    _launch(query, key, value, value, out, (query, query, query), scale, fp8=False)
    return out


@_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[:3] + (value.shape[-1],))


@torch.library.custom_op("bcg_diffusion::fp8_attention", mutates_args=())
def _fp8_attention_op(
    query: torch.Tensor,
    query_scales: torch.Tensor,
    key: torch.Tensor,
    key_scales: torch.Tensor,
    value: torch.Tensor,
    value_scales: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(query.shape[:3] + (value.shape[2],), dtype=dtype, device=query.device)
    value_view = value[..., : key.shape[1]].permute(0, 3, 1, 2)  # [B, H, D, S'] -> [B, S, H, D], no copy
    _launch(query, key, value, value_view, out, (query_scales, key_scales, value_scales), scale, fp8=True)
    return out


@_fp8_attention_op.register_fake
def _(query, query_scales, key, key_scales, value, value_scales, scale, dtype):  # noqa: ANN001, ANN202
    return torch.empty(query.shape[:3] + (value.shape[2],), dtype=dtype, device=query.device)
