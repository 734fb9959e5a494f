"""Fast mode under FP8: a Z-Image block's glue in three kernels, each product's FP8 input made by the kernel
before it.

A Z-Image block (``ZImageTransformerBlock`` with modulation) normalizes, modulates and gates around its two
products (the lines are in :mod:`bcg_diffusion.kernels.block_glue`). With torchao's row-wise FP8 weights
each product quantizes its input first. Compiled, inductor makes that glue three kernels, at 1.2–2.3 TB/s
on an H200 (45 µs of a 535 µs FP8 block at 512², run 113). The patched forward runs the block's steps with
:mod:`bcg_diffusion.kernels.block_glue`: the first norm with its modulation and the FP8 rows of the fused
query, key and value product; the attention's gated residual with the feed-forward's norm, modulation and
FP8 rows (quantized once for both of its up projections); the feed-forward's gated residual. The products
are torchao's, on those rows; the feed-forward's activation is
:func:`bcg_diffusion.kernels.activation_fp8.swiglu_fp8`, as fast mode's FP8 feed-forward runs it. One block
replayed on an H200: 489.7 → 485.5 µs at 512², 2009.5 → 1974.6 µs at 1024² (run 136); Z-Image-Turbo end to
end, 8 steps: 0.151 → 0.147 s at 512², 0.566 → 0.543 s at 1024² (run 140).

The same steps as the unpatched block with fast mode's FP8 feed-forward and fused query, key and value:
on a CPU, where the operators run their PyTorch references, the patched forward gives the unpatched one's
bytes. On a GPU the kernels' float32 arithmetic is a few ulps from PyTorch's; fast mode allows it, its
contract being with its own compiled blocks, which run the same kernels.

Applies to a block whose four norms are diffusers' ``RMSNorm`` with a weight and no bias, whose attention
holds the fused FP8 product (:mod:`bcg_diffusion.features.fused_qkv`) and runs fast mode's processor, and
whose feed-forward takes fast mode's FP8 kernel (:func:`bcg_diffusion.patches.fp8_feed_forward.unfit`,
chosen ``"fused"``): :func:`unfit` says why a block is left as it is. Checked again at every call (types and
identities, which dynamo turns into guards): a call with per-token modulation (a noise mask), a projection
replaced or the fused product dropped runs the class's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels import block_glue
from ..kernels.activation_fp8 import swiglu_fp8
from .attention import FUSED_QKV_ATTRIBUTE, TAKES_FP8_ROWS
from .block_glue import patch_blocks, unfit_class
from .fp8_feed_forward import (
    Fp8Rows,
    linear_on_fp8,
    plain_fp8_linear,
    unfit_chosen,
    unfit_weight,
)

__all__ = [
    "ZIMAGE_BLOCK_PATCH",
    "fused_block_forward",
    "patch_zimage_blocks",
    "unfit",
]

ZIMAGE_BLOCK_PATCH = "Z-Image FP8 block: norms, modulation, gated residuals and FP8 inputs in three kernels"
_Z_IMAGE = "diffusers.models.transformers.transformer_z_image"
_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")


def _plain_norm(norm: Any) -> bool:
    from diffusers.models.normalization import RMSNorm

    return type(norm) is RMSNorm and norm.weight is not None and getattr(norm, "bias", None) is None


def unfit(block: torch.nn.Module) -> str | None:
    """Why ``block`` does not take :func:`fused_block_forward` (None: it does)."""
    reason = unfit_class(block, "ZImageTransformerBlock", _Z_IMAGE)
    if reason is not None:
        return reason
    if not getattr(block, "modulation", False):
        return "a block without modulation"
    if "forward" in block.__dict__:
        return "its forward was replaced already"
    if not all(_plain_norm(getattr(block, name, None)) for name in _NORMS):
        return "a norm is not diffusers' RMSNorm with a weight and no bias"
    modulation = getattr(block, "adaLN_modulation", None)
    if not isinstance(modulation, torch.nn.Sequential) or len(modulation) != 1:
        return "its modulation is not one product"
    fused = getattr(block.attention, FUSED_QKV_ATTRIBUTE, None)
    if fused is None:
        return "its attention has no fused FP8 query, key and value product"
    reason = unfit_weight(fused.weight)
    if reason is not None:
        return f"the fused product: {reason}"
    return unfit_chosen(block.feed_forward, "feed-forward")


def _ready(block: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether this call can take the kernels' path: what :func:`unfit` checked at patch time still holds
    (identities and types only: dynamo guards on them)."""
    from torchao.quantization.quantize_.workflows import Float8Tensor

    attention, feed_forward = block.attention, block.feed_forward
    fused = getattr(attention, FUSED_QKV_ATTRIBUTE, None)
    return (
        fused is not None
        and isinstance(fused.weight, Float8Tensor)
        and getattr(type(attention.processor).__call__, TAKES_FP8_ROWS, False)
        and all(plain_fp8_linear(getattr(feed_forward, name, None), Float8Tensor) for name in ("w1", "w2", "w3"))
        and all(_plain_norm(getattr(block, name)) for name in _NORMS)
        and all(getattr(block, name).weight.dtype == x.dtype for name in _NORMS)
    )


def fused_block_forward(
    self: torch.nn.Module,
    x: torch.Tensor,
    attn_mask: torch.Tensor,
    freqs_cis: torch.Tensor,
    adaln_input: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    adaln_noisy: torch.Tensor | None = None,
    adaln_clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ZImageTransformerBlock.forward`` with its glue in :mod:`bcg_diffusion.kernels.block_glue`'s
    kernels (the module docstring); the class's forward where the call does not fit (:func:`_ready`, or
    per-token modulation)."""
    class_forward = type(self).forward
    if noise_mask is not None or adaln_input is None or not _ready(self, x):
        return class_forward(self, x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)
    modulation = self.adaLN_modulation(adaln_input).chunk(4, dim=1)
    if block_glue.unsupported(x, (), modulation) is not None:  # a stream or modulation the kernels do not take
        return class_forward(self, x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)
    scale_msa, gate_msa, scale_mlp, gate_mlp = modulation
    norm = self.attention_norm1
    data, scale = block_glue.modulated_norm_fp8(x, norm.weight, norm.eps, scale_msa)
    attn_out = self.attention(Fp8Rows(data, scale, x.dtype), attention_mask=attn_mask, freqs_cis=freqs_cis)
    branch_norm, norm = self.attention_norm2, self.ffn_norm1
    x, data, scale = block_glue.gated_residual_fp8(
        x, attn_out, branch_norm.weight, branch_norm.eps, gate_msa, norm.weight, norm.eps, scale_mlp
    )
    feed_forward = self.feed_forward
    gate, up = (
        linear_on_fp8(feed_forward.w1, data, scale, x.dtype),
        linear_on_fp8(feed_forward.w3, data, scale, x.dtype),
    )
    data, scale = swiglu_fp8(gate, up)
    out = linear_on_fp8(feed_forward.w2, data, scale, x.dtype)
    branch_norm = self.ffn_norm2
    return block_glue.gated_residual(x, out, branch_norm.weight, branch_norm.eps, gate_mlp)


def patch_zimage_blocks(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every block of ``model`` that fits (:func:`unfit`) the forward of :func:`fused_block_forward`,
    recorded in ``patches``; returns how many (:func:`bcg_diffusion.patches.block_glue.patch_blocks`)."""
    return patch_blocks(model, patches, unfit, fused_block_forward, "zimage fused block")
