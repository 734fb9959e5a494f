"""Fast mode's VAE encoder: channels-last with fused kernels, as the decoder.

Image-to-image, inpainting, edit and image-to-video pipelines encode their input with the VAE on every call,
before denoising. The decoder's graphs do not serve that call (``vae.decode`` is the captured method), so the
encoder runs eagerly in every mode. In fast mode it gets the decoder's fused parts where it is made of them:

* diffusers' 2-D ``Encoder`` (``AutoencoderKL``: FLUX.1 Kontext, FLUX.1 and SD3 image-to-image and
  inpainting): its resnet blocks' norms, SiLU, biases and residuals fused, channels-last
  (:func:`bcg_diffusion.patches.vae.fuse_encoder`);
* Wan's causal 3-D ``WanEncoder3d`` (Wan 2.1 and 2.2 image-to-video) and Qwen-Image's copy of it,
  ``QwenImageEncoder3d`` (Qwen-Image's image-to-image and inpainting, Qwen-Image-Edit and Edit Plus): each RMS
  norm with its SiLU in one pass, channels-last, and an image's single frame convolved in 2-D, a third of the
  causal convolutions' work (:func:`bcg_diffusion.patches.wan_vae.fuse_encoder`).

It follows the decoder's choice (:func:`bcg_diffusion.features.vae_decoder.choose`): only under ``"fused"``,
the default, on a CUDA device with Triton. The encoder rounds differently from eager, so the image latents
do too: fast mode's kind of change. ``restore`` gives the encoder its forwards back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels import triton_unavailable
from ..patches import vae, wan_vae
from ..patches.followed import installable
from .base import Feature, Setup
from .vae_decoder import VAE_DECODER_CHOICE

__all__ = ["FastVaeEncoder"]

# The fused encoders: (whether one serves an encoder, its name in patches.followed, how it fuses, its name in
# stats()["patches"]).
_FUSED_ENCODERS: tuple[tuple[Callable[[Any], bool], str, Callable[..., dict[str, int]], str], ...] = (
    (vae.encoder_fusable, "vae encoder (fused)", vae.fuse_encoder, vae.VAE_ENCODER_FUSED_PATCH),
    (wan_vae.encoder_fusable, "wan vae encoder (fused)", wan_vae.fuse_encoder, wan_vae.WAN_VAE_ENCODER_FUSED_PATCH),
    (wan_vae.qwenimage_encoder_fusable, "qwenimage vae encoder (fused)", wan_vae.fuse_encoder,
     wan_vae.QWENIMAGE_VAE_ENCODER_FUSED_PATCH),
)  # fmt: skip


class FastVaeEncoder(Feature):
    name = "VAE encoder"
    component = "vae"

    def __init__(self) -> None:
        self.patch_name: str | None = None

    @classmethod
    def create(cls, setup: Setup) -> FastVaeEncoder | None:
        if setup.config.mode != "fast" or "vae" not in setup.accelerated:
            return None
        model = setup.modules["vae"]
        encoder = getattr(model, "encoder", None)
        if not isinstance(encoder, torch.nn.Module) or getattr(model, VAE_DECODER_CHOICE, "fused") != "fused":
            return None
        weight = next(encoder.parameters(), None)
        if weight is None or triton_unavailable(weight.device) is not None:
            return None
        return cls()

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        encoder = setup.modules["vae"].encoder
        for serves, followed, fuse, patch_name in _FUSED_ENCODERS:
            if serves(encoder):
                if installable(followed, stacklevel=5):
                    fuse(encoder, patches)
                    self.patch_name = patch_name
                return

    def patch_names(self) -> list[str]:
        return [] if self.patch_name is None else [self.patch_name]
