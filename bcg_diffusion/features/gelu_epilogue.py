"""Fast mode: the transformer's tanh GELUs in their matrix products' epilogues.

The patches are :mod:`bcg_diffusion.patches.gelu` (diffusers' ``GELU`` modules: every ``FeedForward`` with
``activation_fn="gelu-approximate"``) and, for FLUX.1's single blocks, whose GELU feeds a joined row,
:func:`bcg_diffusion.patches.flux_block.split_output_single_block_forward` (the output projection split at the
join). Rounding differs from the separate activation, so they belong to fast mode; this feature applies them
to the accelerated transformer after quantization (which decides which projections stay plain) and before
the blocks compile.
"""

from __future__ import annotations

from ..core.hooks import MethodPatches
from ..patches.flux_block import FLUX_SPLIT_OUTPUT_PATCH, patch_flux_split_outputs
from ..patches.gelu import GELU_EPILOGUE_PATCH, patch_gelu_epilogues
from .base import Feature, Setup

__all__ = ["GeluEpilogue"]


class GeluEpilogue(Feature):
    name = "GELU epilogue"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too

    def __init__(self) -> None:
        self.patched = 0
        self.split_blocks = 0

    @classmethod
    def create(cls, setup: Setup) -> GeluEpilogue | None:
        return cls() if setup.config.mode == "fast" and "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        self.patched = patch_gelu_epilogues(setup.modules["transformer"], patches)
        self.split_blocks = patch_flux_split_outputs(setup.modules["transformer"], patches)

    def patch_names(self) -> list[str]:
        names = [GELU_EPILOGUE_PATCH] if self.patched else []
        return names + ([FLUX_SPLIT_OUTPUT_PATCH] if self.split_blocks else [])
