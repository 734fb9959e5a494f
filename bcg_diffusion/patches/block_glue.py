"""Which blocks may run their glue in :mod:`bcg_diffusion.kernels.block_glue`'s kernels: one switch per block,
read when ``accelerate`` prepares the model (:mod:`bcg_diffusion.patches.zimage_block`,
:mod:`bcg_diffusion.patches.qwenimage_block`, :mod:`bcg_diffusion.patches.flux_block`), and the second half of
a stream that Qwen-Image's and FLUX's blocks share (:func:`gated_feed_forward_fp8`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ..core.hooks import MethodPatches, private_copy
from ..kernels import block_glue as kernels
from .followed import installable
from .fp8_feed_forward import Fp8Rows, gelu_feed_forward_on_fp8

__all__ = [
    "BLOCK_CLASSES",
    "FUSED_BLOCK_CHOICE",
    "choose",
    "chosen_off",
    "gated_feed_forward_fp8",
    "patch_blocks",
    "plain_layer_norm",
    "unfit_class",
]

# Set False on a block (:func:`choose`) to keep inductor's glue for it.
FUSED_BLOCK_CHOICE = "_bcg_fused_block"
# the blocks the kernels know
BLOCK_CLASSES = (
    "ZImageTransformerBlock",
    "QwenImageTransformerBlock",
    "FluxSingleTransformerBlock",
    "FluxTransformerBlock",
)


def plain_layer_norm(norm: Any) -> bool:
    """Whether ``norm`` is a LayerNorm over the last dimension without weight or bias, what the LayerNorm
    kernels compute (Qwen-Image's and FLUX's blocks)."""
    return (
        type(norm) is torch.nn.LayerNorm
        and norm.weight is None
        and norm.bias is None
        and len(norm.normalized_shape) == 1
    )


def chosen_off(block: torch.nn.Module) -> bool:
    """Whether :func:`choose` kept ``block``'s glue out of the kernels."""
    return getattr(block, FUSED_BLOCK_CHOICE, True) is False


def unfit_class(block: torch.nn.Module, class_name: str, module: str) -> str | None:
    """Why ``block`` is not a block whose glue the kernels may take (None: it is): it must be diffusers'
    ``class_name`` from ``module`` itself (not a subclass), not chosen off (:func:`choose`)."""
    if type(block).__name__ != class_name or type(block).__module__ != module:
        return f"not diffusers' {class_name}"
    if chosen_off(block):
        return "chosen off"
    return None


def choose(model: torch.nn.Module, fused: bool) -> int:
    """Let (``fused=True``, the default) or keep (False) the Z-Image, Qwen-Image and FLUX blocks of ``model`` from
    running their glue in the kernels, before ``accelerate``. Returns how many blocks it set; raises
    TypeError when ``fused`` is not a bool.

    >>> choose(pipe.transformer, False)  # doctest: +SKIP
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be True or False, got {fused!r}")
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_CLASSES]
    for block in blocks:
        setattr(block, FUSED_BLOCK_CHOICE, fused)
    return len(blocks)


def patch_blocks(
    model: torch.nn.Module,
    patches: MethodPatches,
    unfit: Callable[[torch.nn.Module], str | None],
    forward: Callable[..., Any],
    followed: str,
) -> int:
    """Give every module of ``model`` that ``unfit`` accepts (None) ``forward`` as its forward, recorded in
    ``patches``; returns how many. The blocks share one copy of ``forward`` (a function of its own per
    call of this one), so fast mode compiles it once for all of them. None is patched (with a warning) when
    the diffusers code ``forward`` inlines is not the code it was written for: the patch ``followed`` names
    in :mod:`bcg_diffusion.patches.followed`."""
    fitting = [module for module in model.modules() if unfit(module) is None]
    if not fitting or not installable(followed, stacklevel=5):
        return 0
    shared = private_copy(forward)
    for module in fitting:
        patches.replace(module, "forward", types.MethodType(shared, module))
    return len(fitting)


def gated_feed_forward_fp8(
    x: torch.Tensor,
    attention_output: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    mlp_gate: torch.Tensor,
    feed_forward: torch.nn.Module,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """A stream after attention in the kernels, as Qwen-Image's and FLUX's double blocks run it: ``x + gate *
    attention_output``, whose kernel also writes the FP8 rows of its ``LayerNorm * (1 + scale) + shift``; diffusers'
    tanh-GELU ``feed_forward`` on those rows (:func:`~bcg_diffusion.patches.fp8_feed_forward.gelu_feed_forward_on_fp8`);
    its output gated by ``mlp_gate`` into the stream. With ``index``, per-token modulation
    (:mod:`bcg_diffusion.kernels.block_glue`). The caller checked that the kernels and the feed-forward take them."""
    x, data, scales = kernels.gated_add_layer_norm_fp8(x, attention_output, gate, eps, scale, shift, index=index)
    feed_forward_output = gelu_feed_forward_on_fp8(feed_forward, Fp8Rows(data, scales, x.dtype))
    return kernels.gated_add(x, feed_forward_output, mlp_gate, index)
