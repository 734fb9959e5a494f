"""Fast mode: a ControlNet's blocks compiled by inductor, inside its graphs.

A diffusers ControlNet repeats its transformer's blocks: FLUX.1's ``FluxControlNetModel`` holds
``FluxTransformerBlock`` and ``FluxSingleTransformerBlock``, SD3's ``JointTransformerBlock``, Qwen-Image's
``QwenImageTransformerBlock``, Sana's ``SanaTransformerBlock``; the wrapper of several ControlNets holds theirs.
It declares no ``_repeated_blocks`` of its own, so the blocks compiled are those of the classes the
pipeline's transformer declares, wherever they sit in the ControlNet. They compile as the transformer's do
(:func:`~.compiled_blocks.compile_modules`: dynamic shapes, blocks of one class sharing one compile,
inductor's default mode, a compile that fails puts the eager forwards back for good, with a warning), but
without the transformer's fast-mode patches (its attention processors, block glue, fused projections): those
are scoped to the transformer.

Applies in fast mode to an accelerated ControlNet (one of the default components). Compiling changes
rounding only, hence fast mode's; the images stay byte-identical to the same compiled blocks without graphs.
``stats()`` reports ``controlnet_compiles``, ``controlnet_compile_seconds`` and ``controlnet_compile_failure``.
``choose(pipe.controlnet, False)`` before ``accelerate`` keeps its blocks eager inside the graphs.
"""

from __future__ import annotations

import logging

import torch

from .base import Setup
from .compiled_parts import CompiledParts, compile_defaults, set_choice

__all__ = ["COMPILED_CONTROLNET", "CONTROLNET_CHOICE", "CompiledControlNet", "choose"]

COMPILED_CONTROLNET = "controlnet blocks compiled"  # its name in stats()["patches"]
# The attribute on a ControlNet that keeps its blocks eager in fast mode when False.
CONTROLNET_CHOICE = "_bcg_compiled_controlnet"

logger = logging.getLogger(__name__)


def choose(controlnet: torch.nn.Module, compiled: bool) -> None:
    """Let fast mode compile ``controlnet``'s blocks (``compiled=True``, the default) or keep them eager
    (False), before ``accelerate``.

    >>> choose(pipe.controlnet, False)  # doctest: +SKIP

    Raises TypeError for anything but True or False.
    """
    set_choice(controlnet, CONTROLNET_CHOICE, compiled)


class CompiledControlNet(CompiledParts):
    name = "compiled controlnet"
    component = "controlnet"
    defaults = compile_defaults("controlnet")
    choice = CONTROLNET_CHOICE
    patch_name = COMPILED_CONTROLNET

    def parts(self, setup: Setup, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        transformer = getattr(setup.pipe, "transformer", None)
        classes = tuple(getattr(transformer, "_repeated_blocks", None) or ())
        blocks = [(name, block) for name, block in module.named_modules() if type(block).__name__ in classes]
        if not blocks:
            logger.info("fast mode: %s holds none of its transformer's blocks %s", type(module).__name__, classes)
        return blocks
