"""A feed-forward's tanh GELU and the next product's FP8 input in one pass.

Under ``quantize="fp8"`` (torchao's row-wise dynamic FP8) a feed-forward computes ``gelu(up(x))`` in
bf16, then its down projection quantizes that activation: each row's largest magnitude gives its scale,
and the row divided by it is cast to float8. Compiled, inductor makes that one kernel that loops over
each 12,288-element row of Qwen-Image twice: 0.371 ms of a 3.1 ms block at 1024² with CFG, about
0.8 TB/s (H200, run 93). This kernel reads the up projection's output, computes the GELU, and writes
the float8 rows and their scales: what the down projection's ``_scaled_mm`` takes.

Arithmetic, per row (the same steps as diffusers' ``GELU`` then torchao's ``Float8Tensor.from_hp``
with per-row granularity, torch kernels): the tanh GELU in float32 rounded to the input's dtype; the
scale is the row's largest magnitude divided by the format's largest value, in the input's dtype, then
float32; the data is the GELU in float32 divided by the scale, clamped to the format's range, cast.
:func:`reference_gelu_fp8` computes it with those same PyTorch operators; it runs where the kernel
cannot (CPU, no Triton) and the tests hold the kernel to it. A row of zeros has a scale of zero and
NaN data, as torchao's has.

A PyTorch custom operator (``bcg_diffusion::gelu_fp8``), so compiled code calls it without a graph
break; the launch configuration is fixed (no autotuning, whose timing-based choice could change bytes
between processes). Needs Triton and a CUDA GPU (:func:`unavailable`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import triton_unavailable

__all__ = ["gelu_fp8", "reference_gelu_fp8", "unavailable", "unsupported"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn,)  # torchao's default, what quantize="fp8" uses
# (elements per chunk of a row, warps, approximate tanh and reciprocal): fixed, so that the bytes never depend
# on a timing; bench.probes.probe_attention_kernels --sections fp8-gelu times it in a block and alone, with
# other settings
_CONFIG = (16384, 8, True)

unavailable = triton_unavailable  # why the Triton kernel cannot run on a device (None: it can)


def unsupported(hidden: torch.Tensor, fp8_dtype: torch.dtype) -> str | None:
    """Why :func:`gelu_fp8` refuses these arguments (None: it takes them). Only tensor properties."""
    if hidden.dim() < 2:
        return "the activation has fewer than two dimensions"
    if hidden.dtype not in _DTYPES:
        return f"dtype {hidden.dtype} (needs one of {_DTYPES})"
    if fp8_dtype not in _FP8:
        return f"float8 dtype {fp8_dtype} (needs one of {_FP8})"
    if hidden.stride(-1) != 1:
        return "the last dimension is not contiguous"
    return None


def gelu_fp8(hidden: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """The tanh GELU of ``hidden`` ``[..., K]``, quantized per row: ``(data, scale)``, ``data`` in
    ``fp8_dtype`` shaped like ``hidden``, ``scale`` float32 ``[..., 1]``, so that ``data * scale`` is the
    GELU up to float8 rounding. Raises ValueError on what :func:`unsupported` names.

    >>> data, scale = gelu_fp8(torch.randn(4, 64, dtype=torch.bfloat16))
    >>> data.dtype, scale.shape
    (torch.float8_e4m3fn, torch.Size([4, 1]))
    """
    reason = unsupported(hidden, fp8_dtype)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's GELU-to-FP8 kernel cannot take this tensor: {reason}")
    return tuple(torch.ops.bcg_diffusion.gelu_fp8(hidden, fp8_dtype))


def reference_gelu_fp8(
    hidden: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gelu_fp8` in plain PyTorch: diffusers' GELU, then torchao's per-row scale and cast."""
    gelu = F.gelu(hidden, approximate="tanh")
    fp8_max = torch.finfo(fp8_dtype).max
    scale = (gelu.abs().amax(dim=-1, keepdim=True) / fp8_max).to(torch.float32)
    data = (gelu.to(torch.float32) / scale).clamp(min=-fp8_max, max=fp8_max).to(fp8_dtype)
    return data, scale


def _launch(
    hidden: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, config: tuple[int, int, bool] | None = None
) -> None:
    """Run the kernel over the rows of ``hidden`` (``[..., K]``, last dimension contiguous) into
    ``data`` (contiguous, like ``hidden``) and ``scale`` (contiguous ``[..., 1]``). On CPU tensors it
    runs only in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    import triton.language as tl

    from . import _gelu_fp8_triton as kernels

    block, warps, approximate = config or _CONFIG
    columns = hidden.shape[-1]
    block = min(block, 1 << (columns - 1).bit_length())  # a row shorter than a chunk: one chunk of its size
    rows = hidden.reshape(-1, columns)  # a view wherever the rows have one stride (a copy otherwise)
    tl_types = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                torch.float8_e4m3fn: tl.float8e4nv}  # fmt: skip
    device = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        kernels.gelu_fp8_rows[(rows.shape[0],)](
            rows, data, scale, rows.stride(0), columns, float(torch.finfo(data.dtype).max),
            COLUMNS=columns, BLOCK=block, HP_TY=tl_types[hidden.dtype], FP8_TY=tl_types[data.dtype],
            APPROXIMATE=approximate, num_warps=warps,
        )  # fmt: skip


def _empty(hidden: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.empty(hidden.shape, dtype=fp8_dtype, device=hidden.device)
    scale = torch.empty((*hidden.shape[:-1], 1), dtype=torch.float32, device=hidden.device)
    return data, scale


@torch.library.custom_op("bcg_diffusion::gelu_fp8", mutates_args=())
def _gelu_fp8_op(hidden: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if unavailable(hidden.device) is not None:
        return reference_gelu_fp8(hidden, fp8_dtype)
    data, scale = _empty(hidden, fp8_dtype)
    if hidden.numel():
        _launch(hidden, data, scale)
    return data, scale


@_gelu_fp8_op.register_fake
def _(hidden, fp8_dtype):  # noqa: ANN001, ANN202
    return _empty(hidden, fp8_dtype)
