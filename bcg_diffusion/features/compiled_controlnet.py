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
from typing import Any

import torch

from ..core.hooks import MethodPatches
from .base import Feature, Setup
from .compiled_blocks import BlockCompiles, compile_modules

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
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be True or False, got {compiled!r}")
    setattr(controlnet, CONTROLNET_CHOICE, compiled)


class CompiledControlNet(Feature):
    name = "compiled controlnet"
    component = "controlnet"
    defaults = {"controlnet_compiles": 0, "controlnet_compile_seconds": 0.0, "controlnet_compile_failure": None}

    def __init__(self) -> None:
        self.compiled: BlockCompiles | None = None

    @classmethod
    def create(cls, setup: Setup) -> CompiledControlNet | None:
        return cls() if setup.config.mode == "fast" and cls.component in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        controlnet = setup.modules[self.component]
        if getattr(controlnet, CONTROLNET_CHOICE, True) is False:
            return
        transformer = getattr(setup.pipe, "transformer", None)
        classes = tuple(getattr(transformer, "_repeated_blocks", None) or ())
        blocks = [(name, block) for name, block in controlnet.named_modules() if type(block).__name__ in classes]
        if not blocks:
            logger.info("fast mode: %s holds none of its transformer's blocks %s", type(controlnet).__name__, classes)
            return
        self.compiled = compile_modules(blocks, patches)
        logger.info("fast mode: compiling %d blocks of %s", len(blocks), type(controlnet).__name__)

    def stats(self) -> dict[str, Any]:
        return {} if self.compiled is None else self.compiled.report("controlnet_")

    def patch_names(self) -> list[str]:
        return [] if self.compiled is None else [COMPILED_CONTROLNET]
