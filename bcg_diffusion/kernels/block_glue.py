"""The glue of a Z-Image or Qwen-Image block in three passes: norms, ``1 + scale`` modulation, gated
residuals and the next product's row-wise FP8 input.

A Z-Image block (``ZImageTransformerBlock`` with modulation) runs, around its two products::

    h = attention_norm1(x) * (1 + scale_msa)                    # then quantized by the QKV product
    x = x + tanh(gate_msa) * attention_norm2(attention(h))
    h = ffn_norm1(x) * (1 + scale_mlp)                          # then quantized by w1 and w3
    x = x + tanh(gate_mlp) * ffn_norm2(feed_forward(h))

its norms diffusers' ``RMSNorm`` with a weight. A Qwen-Image block (``QwenImageTransformerBlock``) runs the
same steps on each of its two streams (image and text) with LayerNorms without a weight, a shift, no norm
on the branch and a plain gate::

    h = norm1(x) * (1 + scale1) + shift1                        # then quantized by q, k and v
    x = x + gate1 * attention(h)
    h = norm2(x) * (1 + scale2) + shift2                        # then quantized by the up projection
    x = x + gate2 * feed_forward(h)

Under ``quantize="fp8"`` each product's input is quantized per row (torchao's dynamic FP8). Compiled,
inductor makes three kernels of this glue, at 1.2–2.3 TB/s on an H200 (Z-Image 512²: 10, 24 and 11 µs of a
535 µs FP8 block, run 113). Here each is one pass over the rows that reads each input once and writes
each output once:

* :func:`modulated_norm_fp8` (Z-Image), :func:`modulated_layer_norm_fp8` (Qwen-Image): ``x`` to the FP8
  input of the next product (the block's first line);
* :func:`gated_residual_fp8`, :func:`gated_add_layer_norm_fp8`: the branch's output into the stream, and the
  stream to the next FP8 input (the second and third lines);
* :func:`gated_residual`, :func:`gated_add`: the branch's output into the stream (the last line).

Arithmetic, per row: diffusers' ``RMSNorm`` as it rounds (normalized in float32, rounded to the weight's
dtype, times the weight, rounded) or PyTorch's ``LayerNorm`` (mean and variance in float32, rounded once),
every product and sum rounded to the model's dtype where PyTorch's operators round, ``tanh`` and
``1 + scale`` as PyTorch computes them; then torchao's row scale (the row's largest magnitude over the
format's largest value, in the model's dtype) and the row divided by it, clamped and cast. The GPU kernel
multiplies by the scale's reciprocal instead of dividing (a few float32 ulps, about one float8 value in a
hundred moves by one step, as in :mod:`bcg_diffusion.kernels.activation_fp8`) and sums each row in its own
order. The ``reference_*`` functions compute the same with PyTorch's operators; they run where the kernel
cannot (CPU, no Triton) and the tests hold the kernel to them.

Shapes: ``x`` and ``branch`` ``[B, S, C]`` (last dimension contiguous), norm weights ``[C]``, the
modulation ``gate``, ``scale`` and ``shift`` ``[B, C]`` (rows of the block's modulation product, last
dimension contiguous). Qwen-Image's functions also take per-token modulation, as Qwen-Image-Edit-2511's
blocks (``zero_cond_t``) use it: an ``index`` ``[B, S]`` (int32) and the modulation ``[2B, C]``, token ``s``
of row ``b`` modulated by row ``b`` where ``index[b, s]`` is 0, by row ``B + b`` elsewhere (diffusers'
``QwenImageTransformerBlock._modulate``). PyTorch custom operators (``bcg_diffusion::modulated_norm_fp8`` and the others of
the same names), so a compiled block calls them without a graph break; a fixed launch configuration (no
autotuning, whose timing-based choice could change bytes between processes). Needs Triton and a CUDA GPU
(:func:`unavailable`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import triton_unavailable
from .activation_fp8 import _row_wise
from .qk_prologue import rms_norm

__all__ = [
    "gated_add",
    "gated_add_layer_norm_fp8",
    "gated_residual",
    "gated_residual_fp8",
    "per_token",
    "modulated_layer_norm_fp8",
    "modulated_norm_fp8",
    "reference_gated_add",
    "reference_gated_add_layer_norm_fp8",
    "reference_gated_residual",
    "reference_gated_residual_fp8",
    "reference_modulated_layer_norm_fp8",
    "reference_modulated_norm_fp8",
    "unavailable",
    "unsupported",
]

_DTYPES = (torch.float16, torch.bfloat16)  # the model's dtype: the kernel rounds to it
_FP8 = (torch.float8_e4m3fn,)  # torchao's default, what quantize="fp8" uses
_MAX_WIDTH = 8192  # a row is held whole in registers
_PASSES = {(False, True): "norm", (True, True): "residual+norm", (True, False): "residual"}  # (residual, quantize)


class _Block(NamedTuple):
    """What a model's block glue computes beyond the common steps (the kernel's switches), and its launch
    settings: (rows per program, warps, approximate arithmetic) per pass (the first norm alone, the residual
    then the norm, the residual alone). Fixed, so that the bytes never depend on a timing."""

    layer_norm: bool  # the norm before a product: LayerNorm without a weight (else RMSNorm with one)
    shift: bool  # the modulation adds a shift after ``1 + scale``
    branch_norm: bool  # the branch's output is RMS-normed before its gate
    tanh_gate: bool  # the gate is ``tanh(gate)``
    configs: dict[str, tuple[int, int, bool]]


# The fastest of the settings timed by bench.probes.probe_attention_kernels (H200; 1, 2 or 4 rows per program with
# 4, 8 or 16 warps tried), alone: section block-glue at Z-Image 512² and 1024² (run 136: 6.9 / 18.5, 16.8 / 49.5
# and 10.9 / 32.4 µs), section qwen-block-glue on Qwen-Image's 2 x 4,096 image rows at 1024² (run 145: 32.5,
# 48.4 and 37.9-39.2 µs, every setting of the residual alone within 4%).
_ZIMAGE = _Block(
    layer_norm=False,
    shift=False,
    branch_norm=True,
    tanh_gate=True,
    configs={"norm": (1, 4, True), "residual+norm": (1, 8, True), "residual": (1, 8, True)},
)
_QWEN = _Block(
    layer_norm=True,
    shift=True,
    branch_norm=False,
    tanh_gate=False,
    configs={"norm": (1, 4, True), "residual+norm": (1, 4, True), "residual": (1, 8, True)},
)

unavailable = triton_unavailable  # why the Triton kernel cannot run on a device (None: it can)


def unsupported(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    modulation: tuple[torch.Tensor, ...],
    branch: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> str | None:
    """Why the kernels refuse these tensors (None: they take them): ``x`` (and ``branch``) ``[B, S, C]``
    in half precision, last dimension contiguous; norm ``weights`` ``[C]`` contiguous, in ``x``'s dtype;
    ``modulation`` ``[B, C]`` in ``x``'s dtype, last dimension contiguous (with a per-token ``index``, int32
    ``[B, S]`` with contiguous rows: ``[2B, C]``); every tensor on ``x``'s device. Only tensor properties,
    decided when a compiled block is traced."""
    if x.dim() != 3:
        return f"the stream is {x.dim()}-D, not [batch, tokens, width]"
    batch, tokens, width = x.shape
    if index is not None:
        if index.dtype != torch.int32 or index.shape != (batch, tokens) or index.stride(-1) != 1:
            return f"a per-token index {tuple(index.shape)} {index.dtype} is not an int32 [{batch}, {tokens}]"
        if index.device != x.device:
            return "the tensors are on different devices"
    rows = batch if index is None else 2 * batch
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (needs one of {_DTYPES})"
    if width > _MAX_WIDTH:
        return f"width {width} is over {_MAX_WIDTH}"
    if branch is not None and (branch.shape != x.shape or branch.dtype != x.dtype):
        return f"the branch {tuple(branch.shape)} {branch.dtype} is not shaped like the stream {tuple(x.shape)}"
    if any(t.stride(-1) != 1 for t in (x, *((branch,) if branch is not None else ()))):
        return "the last dimension is not contiguous"
    for weight in weights:
        if weight.shape != (width,) or weight.dtype != x.dtype or not weight.is_contiguous():
            return f"a norm weight {tuple(weight.shape)} {weight.dtype} is not a contiguous [{width}] in {x.dtype}"
    for part in modulation:
        if part.shape != (rows, width) or part.stride(-1) != 1:
            return f"a modulation {tuple(part.shape)} is not [{rows}, {width}] with contiguous rows"
        if part.dtype != x.dtype:
            return f"a modulation in {part.dtype}, not the stream's {x.dtype}"
    tensors = (x, *weights, *modulation, *((branch,) if branch is not None else ()))
    if any(t.device != x.device for t in tensors):
        return "the tensors are on different devices"
    return None


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"bcg_diffusion's block-glue kernel cannot take these tensors: {reason}")


def _fp8(fp8_dtype: torch.dtype) -> str | None:
    return None if fp8_dtype in _FP8 else f"float8 dtype {fp8_dtype} (needs one of {_FP8})"


# ------------------------------------------------------------------------------------- Z-Image


def modulated_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x) * (1 + scale)`` quantized per row: ``(data, row scales)``, ``data`` in ``fp8_dtype``
    shaped like ``x``, the scales float32 ``[B, S, 1]``. Raises ValueError on what :func:`unsupported`
    names.

    >>> x, scale = torch.randn(1, 4, 64, dtype=torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    >>> data, scales = modulated_norm_fp8(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, scale)
    >>> data.dtype, scales.shape
    (torch.float8_e4m3fn, torch.Size([1, 4, 1]))
    """
    _check(unsupported(x, (weight,), (scale,)) or _fp8(fp8_dtype))
    return tuple(torch.ops.bcg_diffusion.modulated_norm_fp8(x, weight, eps, scale, fp8_dtype))


def gated_residual_fp8(
    x: torch.Tensor,
    branch: torch.Tensor,
    branch_weight: torch.Tensor,
    branch_eps: float,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x + tanh(gate) * RMSNorm(branch)`` (the new stream), and the new stream's
    ``RMSNorm * (1 + scale)`` quantized per row: ``(stream, data, row scales)``. Raises ValueError on what
    :func:`unsupported` names."""
    _check(unsupported(x, (branch_weight, weight), (gate, scale), branch) or _fp8(fp8_dtype))
    return tuple(
        torch.ops.bcg_diffusion.gated_residual_fp8(
            x, branch, branch_weight, branch_eps, gate, weight, eps, scale, fp8_dtype
        )
    )


def gated_residual(
    x: torch.Tensor, branch: torch.Tensor, branch_weight: torch.Tensor, branch_eps: float, gate: torch.Tensor
) -> torch.Tensor:
    """``x + tanh(gate) * RMSNorm(branch)``, a new tensor. Raises ValueError on what :func:`unsupported`
    names."""
    _check(unsupported(x, (branch_weight,), (gate,), branch))
    return torch.ops.bcg_diffusion.gated_residual(x, branch, branch_weight, branch_eps, gate)


# ----------------------------------------------------------------------------------- Qwen-Image


def modulated_layer_norm_fp8(
    x: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``LayerNorm(x) * (1 + scale) + shift`` (the LayerNorm without weight or bias) quantized per row:
    ``(data, row scales)`` as :func:`modulated_norm_fp8` returns them; with ``index``, per-token modulation
    (the module docstring). Raises ValueError on what :func:`unsupported` names.

    >>> x, scale = torch.randn(1, 4, 64, dtype=torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    >>> data, scales = modulated_layer_norm_fp8(x, 1e-6, scale, torch.zeros_like(scale))
    >>> data.dtype, scales.shape
    (torch.float8_e4m3fn, torch.Size([1, 4, 1]))
    """
    _check(unsupported(x, (), (scale, shift), index=index) or _fp8(fp8_dtype))
    return tuple(torch.ops.bcg_diffusion.modulated_layer_norm_fp8(x, eps, scale, shift, fp8_dtype, index))


def gated_add_layer_norm_fp8(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x + gate * branch`` (the new stream), and the new stream's ``LayerNorm * (1 + scale) + shift``
    quantized per row: ``(stream, data, row scales)``; with ``index``, per-token modulation (the module
    docstring). Raises ValueError on what :func:`unsupported` names."""
    _check(unsupported(x, (), (gate, scale, shift), branch, index) or _fp8(fp8_dtype))
    return tuple(
        torch.ops.bcg_diffusion.gated_add_layer_norm_fp8(x, branch, gate, eps, scale, shift, fp8_dtype, index)
    )


def gated_add(
    x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """``x + gate * branch``, a new tensor; with ``index``, a per-token gate (the module docstring). Raises
    ValueError on what :func:`unsupported` names."""
    _check(unsupported(x, (), (gate,), branch, index))
    return torch.ops.bcg_diffusion.gated_add(x, branch, gate, index)


# ------------------------------------------------------------------------------------- references


def reference_modulated_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulated_norm_fp8` with PyTorch's operators: Z-Image's steps, then torchao's."""
    return _row_wise(rms_norm(x, weight, eps) * (1.0 + scale.unsqueeze(1)), fp8_dtype)


def reference_gated_residual(
    x: torch.Tensor, branch: torch.Tensor, branch_weight: torch.Tensor, branch_eps: float, gate: torch.Tensor
) -> torch.Tensor:
    """:func:`gated_residual` with PyTorch's operators, as Z-Image's block computes it."""
    return x + gate.unsqueeze(1).tanh() * rms_norm(branch, branch_weight, branch_eps)


def reference_gated_residual_fp8(
    x: torch.Tensor,
    branch: torch.Tensor,
    branch_weight: torch.Tensor,
    branch_eps: float,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_residual_fp8` with PyTorch's operators."""
    stream = reference_gated_residual(x, branch, branch_weight, branch_eps, gate)
    return (stream, *reference_modulated_norm_fp8(stream, weight, eps, scale, fp8_dtype))


def per_token(modulation: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """One part of the modulation as each token takes it: ``[B, 1, C]`` from ``[B, C]``; with ``index``
    (``[B, S]``), ``[B, S, C]`` from ``[2B, C]``, as diffusers' ``QwenImageTransformerBlock._modulate``
    selects it (``torch.where(index == 0, first, second)``)."""
    if index is None:
        return modulation.unsqueeze(1)
    batch = modulation.shape[0] // 2
    return torch.where(index.unsqueeze(-1) == 0, modulation[:batch].unsqueeze(1), modulation[batch:].unsqueeze(1))


def reference_modulated_layer_norm_fp8(
    x: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulated_layer_norm_fp8` with PyTorch's operators: Qwen-Image's steps, then torchao's."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return _row_wise(normed * (1 + per_token(scale, index)) + per_token(shift, index), fp8_dtype)


def reference_gated_add(
    x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`gated_add` with PyTorch's operators, as Qwen-Image's block computes it."""
    return x + per_token(gate, index) * branch


def reference_gated_add_layer_norm_fp8(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_add_layer_norm_fp8` with PyTorch's operators."""
    stream = reference_gated_add(x, branch, gate, index)
    return (stream, *reference_modulated_layer_norm_fp8(stream, eps, scale, shift, fp8_dtype, index))


# ------------------------------------------------------------------------------------------ launch


def _launch(
    x: torch.Tensor,
    block: _Block,
    *,
    branch: torch.Tensor | None = None,
    branch_weight: torch.Tensor | None = None,
    branch_eps: float = 0.0,
    gate: torch.Tensor | None = None,
    stream: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    data: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    config: tuple[int, int, bool] | None = None,
) -> None:
    """Run the kernel over the rows of ``x`` with ``block``'s steps: with ``branch`` the gated residual into
    ``stream``; with ``data`` the quantized norm into ``data`` and ``scales`` (contiguous); with ``index``
    per-token modulation. On CPU tensors it runs only in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    import triton.language as tl

    from . import _block_glue_triton as kernels

    residual, quantize = branch is not None, data is not None
    rows_per_program, warps, approximate = config or block.configs[_PASSES[residual, quantize]]
    batch, tokens, width = x.shape
    n_rows = batch * tokens
    rows = x.reshape(n_rows, width)  # a view wherever the rows have one stride (a copy otherwise)
    branch_rows = branch.reshape(n_rows, width) if residual else rows
    stream_rows = stream.view(n_rows, width) if residual else rows
    out_rows = data.view(n_rows, width) if quantize else rows
    # a pass's unused pointers (the kernel reads none of them) take tensors of the call's own
    gate = gate if residual else (scale if quantize else rows)
    scale = scale if quantize else gate
    shift = shift if shift is not None else scale
    index_rows = index if index is not None else rows  # unread without per-token modulation: any pointer
    tl_types = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float8_e4m3fn: tl.float8e4nv}
    fp8_max = float(torch.finfo(data.dtype).max) if quantize else 0.0
    grid = (-(-n_rows // rows_per_program),)
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        kernels.block_glue_rows[grid](
            rows, branch_rows, branch_weight if branch_weight is not None else rows, gate, stream_rows,
            weight if weight is not None else rows, scale, shift, out_rows, scales if quantize else rows, index_rows,
            n_rows, tokens, batch, rows.stride(0), branch_rows.stride(0), stream_rows.stride(0), out_rows.stride(0),
            gate.stride(0), scale.stride(0), shift.stride(0), index_rows.stride(0), branch_eps, eps, fp8_max,
            COLUMNS=width, BLOCK=1 << (width - 1).bit_length(), ROWS=rows_per_program,
            HP_TY=tl_types[x.dtype], FP8_TY=tl_types[data.dtype] if quantize else tl_types[x.dtype],
            RESIDUAL=residual, BRANCH_NORM=block.branch_norm, TANH_GATE=block.tanh_gate, QUANTIZE=quantize,
            LAYER_NORM=block.layer_norm, SHIFT_ADD=block.shift, APPROXIMATE=approximate,
            PER_TOKEN=index is not None, num_warps=warps,
            # Triton would fold a product and the sum after it into one bf16 FMA (one rounding, not PyTorch's two)
            enable_fp_fusion=False,
        )  # fmt: skip


def _fp8_empty(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    return data, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


def _stream_fp8_empty(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), *_fp8_empty(x, fp8_dtype))


# ------------------------------------------------------------------------------- Z-Image's operators


@torch.library.custom_op("bcg_diffusion::modulated_norm_fp8", mutates_args=())
def _modulated_norm_fp8_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    if unavailable(x.device) is not None:
        return reference_modulated_norm_fp8(x, weight, eps, scale, fp8_dtype)
    data, scales = _fp8_empty(x, fp8_dtype)
    if x.numel():
        _launch(x, _ZIMAGE, weight=weight, eps=eps, scale=scale, data=data, scales=scales)
    return data, scales


@_modulated_norm_fp8_op.register_fake
def _(x, weight, eps, scale, fp8_dtype):  # noqa: ANN001, ANN202
    return _fp8_empty(x, fp8_dtype)


@torch.library.custom_op("bcg_diffusion::gated_residual_fp8", mutates_args=())
def _gated_residual_fp8_op(
    x: torch.Tensor,
    branch: torch.Tensor,
    branch_weight: torch.Tensor,
    branch_eps: float,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if unavailable(x.device) is not None:
        return reference_gated_residual_fp8(x, branch, branch_weight, branch_eps, gate, weight, eps, scale, fp8_dtype)
    stream, data, scales = _stream_fp8_empty(x, fp8_dtype)
    if x.numel():
        _launch(
            x, _ZIMAGE, branch=branch, branch_weight=branch_weight, branch_eps=branch_eps, gate=gate,
            stream=stream, weight=weight, eps=eps, scale=scale, data=data, scales=scales,
        )  # fmt: skip
    return stream, data, scales


@_gated_residual_fp8_op.register_fake
def _(x, branch, branch_weight, branch_eps, gate, weight, eps, scale, fp8_dtype):  # noqa: ANN001, ANN202
    return _stream_fp8_empty(x, fp8_dtype)


@torch.library.custom_op("bcg_diffusion::gated_residual", mutates_args=())
def _gated_residual_op(
    x: torch.Tensor, branch: torch.Tensor, branch_weight: torch.Tensor, branch_eps: float, gate: torch.Tensor
) -> torch.Tensor:
    if unavailable(x.device) is not None:
        return reference_gated_residual(x, branch, branch_weight, branch_eps, gate)
    stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _launch(
            x, _ZIMAGE, branch=branch, branch_weight=branch_weight, branch_eps=branch_eps, gate=gate, stream=stream
        )
    return stream


@_gated_residual_op.register_fake
def _(x, branch, branch_weight, branch_eps, gate):  # noqa: ANN001, ANN202
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ---------------------------------------------------------------------------- Qwen-Image's operators


@torch.library.custom_op("bcg_diffusion::modulated_layer_norm_fp8", mutates_args=())
def _modulated_layer_norm_fp8_op(
    x: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if unavailable(x.device) is not None:
        return reference_modulated_layer_norm_fp8(x, eps, scale, shift, fp8_dtype, index)
    data, scales = _fp8_empty(x, fp8_dtype)
    if x.numel():
        _launch(x, _QWEN, eps=eps, scale=scale, shift=shift, data=data, scales=scales, index=index)
    return data, scales


@_modulated_layer_norm_fp8_op.register_fake
def _(x, eps, scale, shift, fp8_dtype, index=None):  # noqa: ANN001, ANN202
    return _fp8_empty(x, fp8_dtype)


@torch.library.custom_op("bcg_diffusion::gated_add_layer_norm_fp8", mutates_args=())
def _gated_add_layer_norm_fp8_op(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    fp8_dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if unavailable(x.device) is not None:
        return reference_gated_add_layer_norm_fp8(x, branch, gate, eps, scale, shift, fp8_dtype, index)
    stream, data, scales = _stream_fp8_empty(x, fp8_dtype)
    if x.numel():
        _launch(
            x, _QWEN, branch=branch, gate=gate, stream=stream, eps=eps, scale=scale, shift=shift,
            data=data, scales=scales, index=index,
        )  # fmt: skip
    return stream, data, scales


@_gated_add_layer_norm_fp8_op.register_fake
def _(x, branch, gate, eps, scale, shift, fp8_dtype, index=None):  # noqa: ANN001, ANN202
    return _stream_fp8_empty(x, fp8_dtype)


@torch.library.custom_op("bcg_diffusion::gated_add", mutates_args=())
def _gated_add_op(
    x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    if unavailable(x.device) is not None:
        return reference_gated_add(x, branch, gate, index)
    stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _launch(x, _QWEN, branch=branch, gate=gate, stream=stream, index=index)
    return stream


@_gated_add_op.register_fake
def _(x, branch, gate, index=None):  # noqa: ANN001, ANN202
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
