"""A feed-forward's activation and the next product's FP8 input in one pass.

Under ``quantize="fp8"`` (torchao's row-wise dynamic FP8) a feed-forward computes its activation in bf16
(``gelu(up(x))`` for Qwen-Image, ``silu(w1(x)) * w3(x)`` for Z-Image), then its down projection quantizes
that activation: each row's largest magnitude gives its scale, and the row divided by it is cast to
float8. Compiled, inductor makes that one kernel, which spends its time in float32 arithmetic
(libdevice's tanh, a rounded division per element): Qwen-Image's took 0.31 ms of a 3.0 ms block at 1024²
with CFG, about 1 TB/s (H200, run 95). These kernels read the projections' outputs, compute the
activation, and write the float8 rows and their scales, what the down projection's ``_scaled_mm``
takes: Qwen-Image's in 0.11 ms, 2.9 TB/s (run 96).

Arithmetic, per row (the same steps as the model's activation then torchao's ``Float8Tensor.from_hp``
with per-row granularity, torch kernels): the activation in float32, rounded to the input's dtype after
each operator as PyTorch's are; the scale is the row's largest magnitude divided by the format's largest
value, in the input's dtype, then float32; the data is the activation divided by the scale, clamped to
the format's range, cast. The GPU kernel takes the fast exp2 and division and multiplies by the scale's
reciprocal, each a few float32 ulps from PyTorch's: about one float8 value in a hundred moves by one
step. :func:`reference_gelu_fp8` and :func:`reference_swiglu_fp8` compute the same with PyTorch's
operators; they run where the kernel cannot (CPU, no Triton) and the tests hold the kernel to them. A
row of zeros has a scale of zero and NaN data, as torchao's has.

PyTorch custom operators (``bcg_diffusion::gelu_fp8``, ``bcg_diffusion::swiglu_fp8``), so compiled code
calls them without a graph break; the launch configuration is fixed (no autotuning, whose timing-based
choice could change bytes between processes). Needs Triton and a CUDA GPU (:func:`unavailable`).

``gelu_fp8(hidden, head=attention)`` quantizes the row ``[head | gelu(hidden)]`` with one scale: FLUX's
single blocks join their attention output and their MLP's GELU before one product
(:mod:`bcg_diffusion.patches.flux_block`), so the join costs no tensor of its own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import triton_unavailable

__all__ = ["gelu_fp8", "reference_gelu_fp8", "reference_swiglu_fp8", "swiglu_fp8", "unavailable", "unsupported"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn,)  # torchao's default, what quantize="fp8" uses
# (elements per chunk of a row, warps, approximate arithmetic): fixed, so that the bytes never depend on a
# timing; bench.probes.probe_attention_kernels --sections fp8-ff times it in a block and alone, with other
# settings (run 96: one pass of 16,384 elements with 8 warps, 107.5 µs; the exact arithmetic, 310.6 µs)
_CONFIG = (16384, 8, True)
_MAX_HEAD = 16384  # a head's row is read in one block: FLUX.1's is 3,072 wide

unavailable = triton_unavailable  # why the Triton kernel cannot run on a device (None: it can)


def unsupported(
    hidden: torch.Tensor, fp8_dtype: torch.dtype, up: torch.Tensor | None = None, head: torch.Tensor | None = None
) -> str | None:
    """Why :func:`gelu_fp8` (with ``head``, or :func:`swiglu_fp8` with ``up``) refuses these arguments (None:
    it takes them). Only tensor properties."""
    if hidden.dim() < 2:
        return "the activation has fewer than two dimensions"
    if hidden.dtype not in _DTYPES:
        return f"dtype {hidden.dtype} (needs one of {_DTYPES})"
    if fp8_dtype not in _FP8:
        return f"float8 dtype {fp8_dtype} (needs one of {_FP8})"
    if hidden.stride(-1) != 1 or (up is not None and up.stride(-1) != 1):
        return "the last dimension is not contiguous"
    if up is not None and (up.shape != hidden.shape or up.dtype != hidden.dtype or up.device != hidden.device):
        return (
            f"the gate {tuple(hidden.shape)} and the up projection {tuple(up.shape)} differ in shape, dtype or device"
        )
    if head is not None:
        if head.shape[:-1] != hidden.shape[:-1] or head.dtype != hidden.dtype or head.device != hidden.device:
            return f"the head {tuple(head.shape)} and the activation {tuple(hidden.shape)} differ in rows, dtype or device"
        if head.stride(-1) != 1:
            return "the head's last dimension is not contiguous"
        if not 0 < head.shape[-1] <= _MAX_HEAD:
            return f"a head {head.shape[-1]} wide (needs 1 to {_MAX_HEAD})"
    return None


def gelu_fp8(
    hidden: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, head: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tanh GELU of ``hidden`` ``[..., K]``, quantized per row: ``(data, scale)``, ``data`` in
    ``fp8_dtype`` shaped like ``hidden``, ``scale`` float32 ``[..., 1]``, so that ``data * scale`` is the
    GELU up to float8 rounding. With ``head`` ``[..., J]`` (the same rows), the row quantized is
    ``torch.cat([head, gelu(hidden)], -1)`` and ``data`` is ``[..., J + K]``. Raises ValueError on what
    :func:`unsupported` names.

    >>> data, scale = gelu_fp8(torch.randn(4, 64, dtype=torch.bfloat16))
    >>> data.dtype, scale.shape
    (torch.float8_e4m3fn, torch.Size([4, 1]))
    >>> gelu_fp8(torch.randn(4, 64, dtype=torch.bfloat16), head=torch.randn(4, 16, dtype=torch.bfloat16))[0].shape
    torch.Size([4, 80])
    """
    _check(unsupported(hidden, fp8_dtype, head=head))
    return tuple(torch.ops.bcg_diffusion.gelu_fp8(hidden, fp8_dtype, head))


def swiglu_fp8(
    gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` (both ``[..., K]``), quantized per row like :func:`gelu_fp8`. Raises ValueError
    on what :func:`unsupported` names.

    >>> data, scale = swiglu_fp8(*torch.randn(2, 4, 64, dtype=torch.bfloat16))
    >>> data.shape, scale.shape
    (torch.Size([4, 64]), torch.Size([4, 1]))
    """
    _check(unsupported(gate, fp8_dtype, up))
    return tuple(torch.ops.bcg_diffusion.swiglu_fp8(gate, up, fp8_dtype))


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"bcg_diffusion's activation-to-FP8 kernel cannot take these tensors: {reason}")


def _row_wise(activation: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row dynamic FP8 of ``activation``, step for step with PyTorch's operators."""
    fp8_max = torch.finfo(fp8_dtype).max
    scale = (activation.abs().amax(dim=-1, keepdim=True) / fp8_max).to(torch.float32)
    data = (activation.to(torch.float32) / scale).clamp(min=-fp8_max, max=fp8_max).to(fp8_dtype)
    return data, scale


def reference_gelu_fp8(
    hidden: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, head: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gelu_fp8` in plain PyTorch: diffusers' GELU (joined after ``head``), then torchao's per-row
    scale and cast."""
    activation = F.gelu(hidden, approximate="tanh")
    return _row_wise(activation if head is None else torch.cat([head, activation], dim=-1), fp8_dtype)


def reference_swiglu_fp8(
    gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu_fp8` in plain PyTorch: Z-Image's ``F.silu(gate) * up``, then torchao's per-row scale
    and cast."""
    return _row_wise(F.silu(gate) * up, fp8_dtype)


def _launch(
    hidden: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    config: tuple[int, int, bool] | None = None,
    up: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
) -> None:
    """Run the kernel over the rows of ``hidden`` (``[..., K]``, last dimension contiguous; with ``up``
    shaped alike, SwiGLU; with ``head`` ``[..., J]``, that row first) into ``data`` (contiguous ``[..., J + K]``)
    and ``scale`` (contiguous ``[..., 1]``). On CPU tensors it runs only in Triton's interpreter
    (``TRITON_INTERPRET=1``)."""
    import triton.language as tl

    from . import _activation_fp8_triton as kernels

    block, warps, approximate = config or _CONFIG
    columns = hidden.shape[-1]
    block = min(block, 1 << (columns - 1).bit_length())  # a row shorter than a chunk: one chunk of its size
    rows = hidden.reshape(-1, columns)  # a view wherever the rows have one stride (a copy otherwise)
    ups = rows if up is None else up.reshape(-1, columns)
    head_columns = 0 if head is None else head.shape[-1]
    heads = rows if head is None else head.reshape(-1, head_columns)
    tl_types = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                torch.float8_e4m3fn: tl.float8e4nv}  # fmt: skip
    device = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        kernels.activation_fp8_rows[(rows.shape[0],)](
            rows, ups, heads, data, scale, rows.stride(0), ups.stride(0), heads.stride(0), head_columns + columns,
            float(torch.finfo(data.dtype).max), COLUMNS=columns, BLOCK=block, HEAD_COLUMNS=head_columns,
            HEAD_BLOCK=1 << max(head_columns - 1, 0).bit_length(), HP_TY=tl_types[hidden.dtype],
            FP8_TY=tl_types[data.dtype], SWIGLU=up is not None, APPROXIMATE=approximate, num_warps=warps,
        )  # fmt: skip


def _empty(
    hidden: torch.Tensor, fp8_dtype: torch.dtype, head: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    columns = hidden.shape[-1] + (0 if head is None else head.shape[-1])
    data = torch.empty((*hidden.shape[:-1], columns), dtype=fp8_dtype, device=hidden.device)
    scale = torch.empty((*hidden.shape[:-1], 1), dtype=torch.float32, device=hidden.device)
    return data, scale


@torch.library.custom_op("bcg_diffusion::gelu_fp8", mutates_args=())
def _gelu_fp8_op(
    hidden: torch.Tensor, fp8_dtype: torch.dtype, head: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if unavailable(hidden.device) is not None:
        return reference_gelu_fp8(hidden, fp8_dtype, head)
    data, scale = _empty(hidden, fp8_dtype, head)
    if hidden.numel():
        _launch(hidden, data, scale, head=head)
    return data, scale


@_gelu_fp8_op.register_fake
def _(hidden, fp8_dtype, head):  # noqa: ANN001, ANN202
    return _empty(hidden, fp8_dtype, head)


@torch.library.custom_op("bcg_diffusion::swiglu_fp8", mutates_args=())
def _swiglu_fp8_op(gate: torch.Tensor, up: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if unavailable(gate.device) is not None:
        return reference_swiglu_fp8(gate, up, fp8_dtype)
    data, scale = _empty(gate, fp8_dtype)
    if gate.numel():
        _launch(gate, data, scale, up=up)
    return data, scale


@_swiglu_fp8_op.register_fake
def _(gate, up, fp8_dtype):  # noqa: ANN001, ANN202
    return _empty(gate, fp8_dtype)
