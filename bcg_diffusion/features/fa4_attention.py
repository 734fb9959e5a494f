"""Fast mode, opt-in: the transformer's bf16 attention through FlashAttention-4
(``accelerate(pipe, mode="fast", attention="fa4")``).

FlashAttention-4's forward kernel (:mod:`bcg_diffusion.kernels.fa4_attention`; ``pip install
bcg-diffusion[fa4]``) computes the same attention as the cuDNN kernel PyTorch picks on Hopper, in the
same precision, faster at every shape measured: 6% at FLUX.1's 1024² shapes, 12–20% at Qwen-Image's,
Edit-2511's, Z-Image's and Wan's (H100, run 198). Only rounding changes (another kernel sums in another
order), which is why it is fast mode's; fast mode's promise holds: with graphs, the same bytes as its
compiled blocks without graphs (``with eager(pipe):``). It combines with ``quantize="fp8"``; FP8 attention
(``attention="fp8"``) is the other choice of the same option.

It reaches the kernel the way FP8 attention does, in every model whose attention goes through diffusers'
dispatcher (FLUX.1, FLUX.2, Wan, Qwen-Image and its Edit variants, Z-Image, HunyuanImage, LTX...): processors
that call ``dispatch_attention_fn`` get a copy whose dispatch sends plain calls to the kernel
(:mod:`bcg_diffusion.patches.dispatched_attention`), and fast mode's own Qwen-Image and Z-Image processors
read the kernel's name from the attention module (:data:`~bcg_diffusion.patches.attention.KERNEL_ATTRIBUTE`).
``restore`` undoes both. Calls the kernel cannot take (a mask, a head size other than 128, context
parallelism, an attention backend the user chose in diffusers) keep PyTorch's attention.

Where it cannot apply (the package missing, no GPU of compute capability 9.x or 10.x, no attention processor
that dispatches in the model), the pipeline keeps PyTorch's attention with a warning.
"""

from __future__ import annotations

import logging
import warnings

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from ..kernels import fa4_attention
from ..patches import dispatched_attention
from ..patches.attention import KERNEL_ATTRIBUTE
from .base import Feature, Setup, transformer_device

__all__ = ["Fa4Attention"]

logger = logging.getLogger(__name__)

KERNEL = "fa4"  # patches.attention's and patches.dispatched_attention's name for it


def _not_applied(reason: str) -> None:
    warnings.warn(
        f"bcg-diffusion: attention='fa4' not applied: {reason}; attention stays PyTorch's",
        BCGWarning,
        stacklevel=5,
    )


class Fa4Attention(Feature):
    name = "FlashAttention-4"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {"attention": None, "fa4_attention_modules": 0}

    def __init__(self) -> None:
        self.modules = 0

    @classmethod
    def create(cls, setup: Setup) -> Fa4Attention | None:
        if setup.config.attention != KERNEL:
            return None
        device, reason = transformer_device(setup)
        reason = reason or fa4_attention.unavailable(device)
        if reason is not None:
            _not_applied(reason)
            return None
        return cls()

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        dispatching = []
        for module in dispatched_attention.attention_modules(setup.modules["transformer"]):
            if dispatched_attention.own_processor(module):
                patches.replace(module, KERNEL_ATTRIBUTE, KERNEL)
            else:
                dispatching.append(module)
            self.modules += 1
        dispatched_attention.install(dispatching, lambda module: KERNEL, patches)
        if self.modules == 0:
            _not_applied(
                "the transformer has no attention processor that calls diffusers' dispatch_attention_fn "
                f"(nor one of {dispatched_attention.OWN_PROCESSORS})"
            )
            return
        logger.info("FlashAttention-4 in %d attention modules", self.modules)

    def stats(self) -> dict[str, object]:
        return {"attention": KERNEL if self.modules else None, "fa4_attention_modules": self.modules}

    def patch_names(self) -> list[str]:
        return ["fa4 attention"] if self.modules else []
