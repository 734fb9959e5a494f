"""bf16 attention through FlashAttention-4's forward kernel, on diffusers' ``[batch, tokens, heads, dim]`` layout.

FlashAttention-4 (the ``flash-attn-4`` package, ``flash_attn.cute``: kernels written in NVIDIA's CuTe DSL and
compiled when first called) has a forward kernel for Hopper and one for Blackwell. On an H100 it beats the
cuDNN kernel PyTorch's SDPA picks, at every attention shape of the pipelines we serve, with the same error
against float32 attention (run 198, ``bench.probes.probe_fa4_attention``, TFLOP/s):

========================================  =====  =====
shape (24 or 30 or 40 heads of 128)        cuDNN  FA4
========================================  =====  =====
FLUX.1 1024² (4,608 tokens)                 649    688
Qwen-Image 1024² (4,160)                    608    684
Z-Image 1024² (4,160, 30 heads)             575    661
Qwen-Image-Edit-2511 1024² (8,422)          594    693
Wan 2.1 832×480×81 (32,760, 40 heads)       566    677
========================================  =====  =====

Why a package and not a kernel of ours: FlashAttention is maintained by its authors for each new GPU, and
ours (:mod:`bcg_diffusion.kernels.attention`) runs below cuDNN's in bf16. Why not PyTorch's
``torch.nn.attention.activate_flash_attention_impl("FA4")``: it swaps the kernel of every SDPA call in the
process (an exact-mode pipeline beside this one too), and PyTorch 2.11's wrapper failed on this
FlashAttention-4 release (run 198). Here the kernel is a PyTorch custom operator
(``bcg_diffusion::fa4_attention``) that only the accelerated model's processors call, and that inductor
calls as it is inside fast mode's compiled blocks. The kernel compiles on its first call for a head size
and dtype (about 2 s on an H100, in the warm-up before any capture) and replays from CUDA graphs. It is
deterministic (no split over the keys), so a replay gives its compiled blocks' bytes.

A call whose mask hides keys only (a prompt's padding, :mod:`bcg_diffusion.kernels.key_padding`) passes how
many keys each batch row sees, the first ones (``key_lengths``): FlashAttention-4's ``seqused_k``, which also
skips the hidden keys' work.

Without a GPU the operator computes its reference (:func:`reference`, PyTorch's SDPA), which CPU tests use.

>>> out = attention(query, key, value)  # [B, S, H, 128] bf16 on an H100 or a B200  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .attention import layout_unsupported
from .key_padding import check_lengths, reference_mask

__all__ = ["COMPUTE_CAPABILITIES", "HEAD_DIMS", "attention", "reference", "unavailable", "unsupported"]

# FlashAttention-4's forward kernels: Hopper (9.x) and Blackwell (10.x); run on Hopper only (run 198).
COMPUTE_CAPABILITIES = (9, 10)
# The head size of every model measured (FA4 takes 8 to 256 on Hopper); other sizes keep PyTorch's attention.
HEAD_DIMS = (128,)


@functools.cache
def _import_error() -> str | None:
    """Why ``flash_attn.cute.interface`` cannot be imported (None: it can). Imported once: it loads the CuTe
    DSL's compiler libraries."""
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as error:  # any failure to load the package is the reason reported to the user
        return f"flash-attn-4 cannot be imported ({type(error).__name__}: {error}); pip install bcg-diffusion[fa4]"
    return None


def unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device`` (None: it can): it needs a CUDA GPU of compute capability
    9.x or 10.x and the ``flash-attn-4`` package. Checked once, when fast mode sets a model up."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA GPU"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in COMPUTE_CAPABILITIES:
        return f"FlashAttention-4 runs on compute capability 9.x and 10.x, not {major}.x"
    return _import_error()


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why these ``[B, S, H, D]`` tensors cannot go to the kernel (None: they can): bfloat16 or float16, one
    batch and head count, head size 128. Only tensor properties, so that a compiled block decides when it is
    traced."""
    return layout_unsupported(query, key, value, HEAD_DIMS)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention: ``[B, S, H, D]`` in, a new contiguous ``[B, S, H, D]`` out in the inputs' dtype.
    ``scale`` defaults to ``1 / sqrt(D)``. ``key_lengths`` (int32 ``[B]``, on the inputs' device): each batch
    row attends to its first ``key_lengths[b]`` keys only; None: to all of them.

    Refuses (ValueError) what :func:`unsupported` names, and key lengths of another shape or dtype.
    """
    reason = unsupported(query, key, value)
    if reason is not None:
        raise ValueError(f"FlashAttention-4 cannot take these tensors: {reason}")
    check_lengths(key_lengths, query.shape[0])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return torch.ops.bcg_diffusion.fa4_attention(query, key, value, scale, key_lengths)


def reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the kernel computes, through PyTorch's SDPA: ``[B, S, H, D]`` in and out (contiguous)."""
    mask = None if key_lengths is None else reference_mask(key_lengths, key.shape[1])
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("bcg_diffusion::fa4_attention", mutates_args=())
def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    if not query.is_cuda:
        return reference(query, key, value, scale, key_lengths)
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

    if key_lengths is None:
        return flash_attn_func(query, key, value, softmax_scale=scale)[0]
    return flash_attn_varlen_func(query, key, value, seqused_k=key_lengths, softmax_scale=scale)[0]


@_attention_op.register_fake
def _(query, key, value, scale, key_lengths=None):  # noqa: ANN001, ANN202
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
