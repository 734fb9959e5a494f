"""Fast mode: the accelerated VAE decoder's group norms take their statistics from one parallel reduction.

The kernel is :mod:`bcg_diffusion.patches.group_norm` (rounding differs from PyTorch's, so it belongs
to fast mode); this feature applies it to the decoder of an accelerated VAE.
"""

from __future__ import annotations

from ..core.hooks import MethodPatches
from ..patches.group_norm import VAE_GROUP_NORM_PATCH, patch_group_norms
from .base import Feature, Setup

__all__ = ["VaeGroupNorm"]


class VaeGroupNorm(Feature):
    name = "VAE group norm"
    component = "vae"

    def __init__(self) -> None:
        self.applied = False

    @classmethod
    def create(cls, setup: Setup) -> VaeGroupNorm | None:
        return cls() if setup.config.mode == "fast" and "vae" in setup.accelerated else None

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        vae = setup.modules["vae"]
        self.applied = bool(patch_group_norms(getattr(vae, "decoder", vae), patches))

    def patch_names(self) -> list[str]:
        return [VAE_GROUP_NORM_PATCH] if self.applied else []
