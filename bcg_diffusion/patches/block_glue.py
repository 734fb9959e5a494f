"""Which blocks may run their glue in :mod:`bcg_diffusion.kernels.block_glue`'s kernels: one switch per block,
read when ``accelerate`` prepares the model (:mod:`bcg_diffusion.patches.zimage_block`,
:mod:`bcg_diffusion.patches.qwenimage_block`, :mod:`bcg_diffusion.patches.flux_block`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ..core.hooks import MethodPatches, private_copy
from .followed import installable

__all__ = ["BLOCK_CLASSES", "FUSED_BLOCK_CHOICE", "choose", "chosen_off", "patch_blocks"]

# Set False on a block (:func:`choose`) to keep inductor's glue for it.
FUSED_BLOCK_CHOICE = "_bcg_fused_block"
# the blocks the kernels know
BLOCK_CLASSES = (
    "ZImageTransformerBlock",
    "QwenImageTransformerBlock",
    "FluxSingleTransformerBlock",
    "FluxTransformerBlock",
)


def chosen_off(block: torch.nn.Module) -> bool:
    """Whether :func:`choose` kept ``block``'s glue out of the kernels."""
    return getattr(block, FUSED_BLOCK_CHOICE, True) is False


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
