"""Fast mode under FP8: a feed-forward's activation and its down projection's FP8 input in one kernel.

The patch is :mod:`bcg_diffusion.patches.fp8_feed_forward` (on by default; an attribute on a feed-forward
module turns it off for that module); this feature applies it to the accelerated transformer after
quantization (which gives the projections their FP8 weights) and before the blocks compile. Exact mode
never applies it: its kernel's bytes are not eager's.
"""

from __future__ import annotations

from ..core.hooks import MethodPatches
from ..patches.fp8_feed_forward import FP8_FEED_FORWARD_PATCH, patch_fp8_feed_forwards
from .base import Feature, Setup

__all__ = ["Fp8FeedForward"]


class Fp8FeedForward(Feature):
    name = "FP8 feed-forward"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too

    def __init__(self) -> None:
        self.patched = 0

    @classmethod
    def create(cls, setup: Setup) -> Fp8FeedForward | None:
        return cls() if setup.config.mode == "fast" and "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        self.patched = patch_fp8_feed_forwards(setup.modules["transformer"], patches)

    def patch_names(self) -> list[str]:
        return [FP8_FEED_FORWARD_PATCH] if self.patched else []
