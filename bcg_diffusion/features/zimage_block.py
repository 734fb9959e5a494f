"""Fast mode under FP8: Z-Image's block glue in three kernels (:mod:`bcg_diffusion.patches.zimage_block`).

Applied to the accelerated transformer after quantization, the fused query, key and value product and the FP8
feed-forward's choice (the patch needs all three), and before the blocks compile. Exact mode never applies
it: its kernels' bytes are not eager's. ``patches.zimage_block.choose(pipe.transformer, False)`` before
``accelerate`` keeps inductor's glue.
"""

from __future__ import annotations

import logging

from ..core.hooks import MethodPatches
from ..patches.zimage_block import ZIMAGE_BLOCK_PATCH, patch_zimage_blocks
from .base import Feature, Setup
from .quantization import FP8

__all__ = ["FusedZImageBlocks"]

logger = logging.getLogger(__name__)


class FusedZImageBlocks(Feature):
    name = "Z-Image FP8 block glue"
    component = "transformer"
    defaults = {"fused_blocks": 0}

    def __init__(self) -> None:
        self.patched = 0

    @classmethod
    def create(cls, setup: Setup) -> FusedZImageBlocks | None:
        fast_fp8 = setup.config.mode == "fast" and setup.config.quantize == FP8
        return cls() if fast_fp8 and "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        if setup.quantized is None:
            return
        self.patched = patch_zimage_blocks(setup.modules["transformer"], patches)
        if self.patched:
            logger.info("fast mode: %d Z-Image blocks run their glue in three kernels", self.patched)

    def patch_names(self) -> list[str]:
        return [ZIMAGE_BLOCK_PATCH] if self.patched else []

    def stats(self) -> dict[str, int]:
        return {"fused_blocks": self.patched}
