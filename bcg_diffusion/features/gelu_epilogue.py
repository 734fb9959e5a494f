"""Fast mode: the transformer's tanh GELUs in their matrix products' epilogues.

The patch is :mod:`bcg_diffusion.patches.gelu` (rounding differs from the separate activation, so it
belongs to fast mode); this feature applies it to the accelerated transformer after quantization (which
decides which projections stay plain) and before the blocks compile.
"""

from __future__ import annotations

from ..core.hooks import MethodPatches
from ..patches.gelu import GELU_EPILOGUE_PATCH, patch_gelu_epilogues
from .base import Feature, Setup

__all__ = ["GeluEpilogue"]


class GeluEpilogue(Feature):
    name = "GELU epilogue"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too

    def __init__(self) -> None:
        self.patched = 0

    @classmethod
    def create(cls, setup: Setup) -> GeluEpilogue | None:
        return cls() if setup.config.mode == "fast" and "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        self.patched = patch_gelu_epilogues(setup.modules["transformer"], patches)

    def patch_names(self) -> list[str]:
        return [GELU_EPILOGUE_PATCH] if self.patched else []
