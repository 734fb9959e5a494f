"""Fast mode under FP8: a Z-Image, Qwen-Image or FLUX double block's glue in three kernels of ours
(:mod:`bcg_diffusion.patches.zimage_block`, :mod:`bcg_diffusion.patches.qwenimage_block`,
:mod:`bcg_diffusion.patches.flux_block`), and a FLUX single block's norm and joined FP8 input in kernels of ours
(:mod:`bcg_diffusion.patches.flux_block`).

Applied to the accelerated transformer after quantization, the fused query, key and value product and the FP8
feed-forward's choice (the patches need them), and before the blocks compile. Exact mode never applies
it: its kernels' bytes are not eager's. ``patches.block_glue.choose(pipe.transformer, False)`` before
``accelerate`` keeps inductor's glue.
"""

from __future__ import annotations

import logging

from ..core.hooks import MethodPatches
from ..patches.flux_block import (
    FLUX_DOUBLE_BLOCK_PATCH,
    FLUX_SINGLE_BLOCK_PATCH,
    patch_flux_double_blocks,
    patch_flux_single_blocks,
)
from ..patches.qwenimage_block import QWENIMAGE_BLOCK_PATCH, patch_qwenimage_blocks
from ..patches.zimage_block import ZIMAGE_BLOCK_PATCH, patch_zimage_blocks
from .base import Feature, Setup
from .quantization import FP8

__all__ = ["FusedBlockGlue"]

logger = logging.getLogger(__name__)

_PATCHES = (
    (ZIMAGE_BLOCK_PATCH, patch_zimage_blocks),
    (QWENIMAGE_BLOCK_PATCH, patch_qwenimage_blocks),
    (FLUX_DOUBLE_BLOCK_PATCH, patch_flux_double_blocks),
    (FLUX_SINGLE_BLOCK_PATCH, patch_flux_single_blocks),
)


class FusedBlockGlue(Feature):
    name = "FP8 block glue"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {"fused_blocks": 0}

    def __init__(self) -> None:
        self.patched: dict[str, int] = {}

    @classmethod
    def create(cls, setup: Setup) -> FusedBlockGlue | None:
        fast_fp8 = setup.config.mode == "fast" and setup.config.quantize == FP8
        return cls() if fast_fp8 and "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        if setup.quantized is None:
            return
        for name, patch in _PATCHES:
            patched = patch(setup.modules["transformer"], patches)
            if patched:
                self.patched[name] = patched
                logger.info("fast mode: %d blocks run their glue in our kernels (%s)", patched, name)

    def patch_names(self) -> list[str]:
        return list(self.patched)

    def stats(self) -> dict[str, int]:
        return {"fused_blocks": sum(self.patched.values())}
