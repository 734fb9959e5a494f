"""Which blocks may run their glue in :mod:`bcg_diffusion.kernels.block_glue`'s kernels: one switch per block,
read when ``accelerate`` prepares the model (:mod:`bcg_diffusion.patches.zimage_block`,
:mod:`bcg_diffusion.patches.qwenimage_block`)."""

from __future__ import annotations

import torch

__all__ = ["BLOCK_CLASSES", "FUSED_BLOCK_CHOICE", "choose", "chosen_off"]

# Set False on a block (:func:`choose`) to keep inductor's glue for it.
FUSED_BLOCK_CHOICE = "_bcg_fused_block"
BLOCK_CLASSES = ("ZImageTransformerBlock", "QwenImageTransformerBlock")  # the blocks the kernels know


def chosen_off(block: torch.nn.Module) -> bool:
    """Whether :func:`choose` kept ``block``'s glue out of the kernels."""
    return getattr(block, FUSED_BLOCK_CHOICE, True) is False


def choose(model: torch.nn.Module, fused: bool) -> int:
    """Let (``fused=True``, the default) or keep (False) the Z-Image and Qwen-Image blocks of ``model`` from
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
