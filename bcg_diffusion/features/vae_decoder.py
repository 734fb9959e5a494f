"""Fast mode's VAE decoder: channels-last with fused kernels, its group norms patched, or compiled whole.

A VAE decode at 512² is a few dozen convolutions and the elementwise work between them: group norms,
SiLU, residual adds, upsampling, the convolutions' biases, and the layout changes cuDNN makes around
each convolution. Eagerly the elementwise work costs more than the convolutions. FLUX.1's decoder
(Z-Image's), replayed from a CUDA graph on an H200 (run 113, ``bench.probes.probe_outside_blocks
--sections vae``):

=========================================  =========  ==========
decoder                                     512²       1024²
=========================================  =========  ==========
eager, group norms patched                  12.63 ms   48.05 ms
channels-last, eager                        11.73 ms   44.02 ms
its blocks compiled, dynamic shapes         11.65 ms   46.16 ms
the whole decoder compiled, static shapes   7.32 ms    34.71 ms
channels-last, glue fused (run 133)         5.96 ms    24.15 ms
=========================================  =========  ==========

What fast mode does to the decoder is a choice (:func:`choose`, before ``accelerate``):

* ``"fused"``, the default: the decoder's activations channels-last, its group norms with their SiLU
  and the convolutions' biases, and each resnet block's residual, in kernels of our own
  (:mod:`bcg_diffusion.patches.vae`). Nothing is compiled by inductor; its first use builds
  about two dozen small Triton kernels, which Triton's cache keeps. Where the decoder is diffusers'
  2-D ``Decoder`` on a CUDA device with Triton. Wan's causal 3-D ``WanDecoder3d`` (Wan 2.1 and 2.2) and
  Qwen-Image's copy of it (``QwenImageDecoder3d``: Qwen-Image and its Edit variants) get their own:
  channels-last, each RMS norm with its SiLU one kernel, convolutions padding for themselves
  (:mod:`bcg_diffusion.patches.wan_vae`). Elsewhere (another decoder, a CPU) fast mode takes
  ``"patched"``.
* ``"patched"``: the group norms of :mod:`bcg_diffusion.patches.group_norm` (moments from one parallel
  reduction), everything else eager.
* ``"compiled"``: the whole ``forward`` compiled by inductor with static shapes, where the decoder is
  diffusers' 2-D ``Decoder`` on a CUDA device (anything else keeps the patched norms). One compile per
  latent shape, about 16 s cold at each of 512² and 1024² (runs 116 and 118), which took
  Z-Image-Turbo's cold first call in fast mode with FP8 from 13.4 to 29.4 s (bench, run 116) and 34–36 s
  in a fresh process (``bench.warm_start``, runs 118 and 119), past fast mode's 30 s.

All three change rounding only, which is why they are fast mode's; none changes the weights. ``restore``
gives the decoder its forwards back. A compile that fails puts the eager decoder back for good, with
a warning. ``stats()`` reports ``vae_compiles`` and ``vae_compile_seconds`` (the calls that compiled,
compiling included) for the compiled decoder.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..kernels import triton_unavailable
from ..patches.followed import installable
from ..patches.group_norm import VAE_GROUP_NORM_PATCH, patch_group_norms
from ..patches.vae import VAE_FUSED_PATCH, fusable, fuse_decoder
from ..patches.wan_vae import QWENIMAGE_VAE_FUSED_PATCH, WAN_VAE_FUSED_PATCH, qwenimage_fusable
from ..patches.wan_vae import fusable as wan_fusable
from ..patches.wan_vae import fuse_decoder as fuse_wan_decoder
from .base import Feature, Setup
from .compiled_blocks import BlockCompiles, compile_forward, private_copy

__all__ = ["VAE_DECODER_CHOICE", "VAE_DECODER_COMPILED", "FastVaeDecoder", "choose", "compile_decoder"]

VAE_DECODER_COMPILED = "vae decoder compiled (static shapes)"  # its name in stats()["patches"]
# The attribute on a VAE that picks what fast mode does to its decoder: "fused" (the default), "patched" or
# "compiled".
VAE_DECODER_CHOICE = "_bcg_vae_decoder"
_CHOICES = ("fused", "patched", "compiled")


def choose(vae: torch.nn.Module, choice: str) -> None:
    """Pick what fast mode does to ``vae``'s decoder, before ``accelerate``: ``"fused"`` (channels-last
    with fused kernels, the default), ``"patched"`` (its group norms only) or ``"compiled"`` (the whole
    decoder by inductor), each where it can be (see the module docstring).

    >>> choose(pipe.vae, "compiled")  # doctest: +SKIP

    Raises ValueError for another choice.
    """
    if choice not in _CHOICES:
        raise ValueError(f"choice must be one of {_CHOICES}, got {choice!r}")
    setattr(vae, VAE_DECODER_CHOICE, choice)


def _compilable(decoder: Any) -> bool:
    """Whether ``decoder`` is diffusers' 2D VAE decoder, its forward the class's own."""
    from diffusers.models.autoencoders.vae import Decoder

    return type(decoder) is Decoder and "forward" not in decoder.__dict__


# The fused decoders: (whether one serves a decoder, its name in patches.followed, how it fuses, its name in
# stats()["patches"]).
_FUSED_DECODERS: tuple[tuple[Callable[[Any], bool], str, Callable[..., dict[str, int]], str], ...] = (
    (fusable, "vae decoder (fused)", fuse_decoder, VAE_FUSED_PATCH),
    (wan_fusable, "wan vae decoder (fused)", fuse_wan_decoder, WAN_VAE_FUSED_PATCH),
    (qwenimage_fusable, "qwenimage vae decoder (fused)", fuse_wan_decoder, QWENIMAGE_VAE_FUSED_PATCH),
)


def _fused_kind(decoder: Any) -> tuple[Callable[..., dict[str, int]], str] | None:
    """The fused decoder that serves ``decoder`` and its patch name, where the diffusers code under it is
    the code it was written against (None: none serves it, or that code changed, with a warning)."""
    for serves, followed, fuse, patch_name in _FUSED_DECODERS:
        if serves(decoder):
            return (fuse, patch_name) if installable(followed, stacklevel=5) else None
    return None


def compile_decoder(decoder: torch.nn.Module, patches: MethodPatches) -> BlockCompiles:
    """Replace ``decoder.forward`` by an inductor-compiled one (whole graph, static shapes; recorded in
    ``patches``). Returns the record of its compiles; a call that fails to compile runs the eager
    forward from then on, with a warning (see :func:`~.compiled_blocks.compile_repeated_blocks`)."""
    record = BlockCompiles(names=["decoder"])
    target = types.MethodType(private_copy(type(decoder).forward), decoder)
    compile_forward(decoder, target, patches, record, dynamic=False, fullgraph=True, wrap=_quiet)
    return record


def _quiet(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` without dynamo's warning about tracing through ``functools.lru_cache``: diffusers'
    upsampling calls ``is_torch_version`` (cached), a pure function of the installed versions, so tracing
    through its cache is safe, and the warning would only alarm users."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
            return compiled(*args, **kwargs)

    return call


class FastVaeDecoder(Feature):
    name = "VAE decoder"
    component = "vae"
    defaults = {"vae_compiles": 0, "vae_compile_seconds": 0.0, "vae_compile_failure": None}

    def __init__(self) -> None:
        self.compiled: BlockCompiles | None = None
        self.fused: dict[str, int] | None = None
        self.fused_patch = VAE_FUSED_PATCH
        self.patched = False

    @classmethod
    def create(cls, setup: Setup) -> FastVaeDecoder | None:
        return cls() if setup.config.mode == "fast" and "vae" in setup.accelerated else None

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        vae = setup.modules["vae"]
        decoder = getattr(vae, "decoder", vae)
        choice = getattr(vae, VAE_DECODER_CHOICE, "fused")
        weight = next(decoder.parameters(), None)
        device = weight.device if weight is not None else torch.device("cpu")
        if choice == "compiled" and device.type == "cuda" and _compilable(decoder):
            self.compiled = compile_decoder(decoder, patches)
        elif choice == "fused" and triton_unavailable(device) is None and (fused := _fused_kind(decoder)):
            fuse, self.fused_patch = fused
            self.fused = fuse(decoder, patches)
        else:
            self.patched = bool(patch_group_norms(decoder, patches))

    def stats(self) -> dict[str, Any]:
        if self.compiled is None:
            return {}
        return self.compiled.report("vae_")

    def patch_names(self) -> list[str]:
        if self.compiled is not None:
            return [VAE_DECODER_COMPILED]
        if self.fused is not None:
            return [self.fused_patch]
        return [VAE_GROUP_NORM_PATCH] if self.patched else []
