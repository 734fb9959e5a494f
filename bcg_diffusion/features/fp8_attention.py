"""Fast mode, opt-in: the transformer's attention in FP8 (``accelerate(pipe, mode="fast", attention="fp8")``).

Query, key, value and the softmax probabilities are quantized to float8 e4m3 and both products of
attention run on FP8 tensor cores, in our Triton kernel (:mod:`bcg_diffusion.kernels.attention`; no
maintained package gives FP8 attention that installs with PyTorch and captures in CUDA graphs). The
quantization is plain PyTorch inside the compiled blocks, so inductor fuses it into the kernels that
produce the query, key and value.

It changes the image more than FP8 linears do (measured in ``docs/quantization.md``), so it is never a
default, not even under ``quantize="fp8"``; fast mode's promise holds: with graphs, the same bytes as
its compiled blocks without graphs (``with eager(pipe):``).

How it reaches the kernel: fast mode's attention processors (Qwen-Image's joint attention, Z-Image's)
call :func:`bcg_diffusion.patches.attention.attend`, which reads the kernel's name from an attribute of
the attention module (:data:`~bcg_diffusion.patches.attention.KERNEL_ATTRIBUTE`). This feature sets it,
and ``restore`` removes it. Calls the kernel cannot take (a mask, a head size other than 64 or 128,
context parallelism, an attention backend the user chose in diffusers) keep PyTorch's attention.

Where it cannot apply (no Triton, no GPU of compute capability 8.9 or newer, no attention processor of
fast mode's in the model), the pipeline keeps bf16 attention with a warning.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from ..kernels.attention import unavailable
from ..patches.attention import KERNEL_ATTRIBUTE
from .base import Feature, Setup

__all__ = ["Fp8Attention", "FP8_ATTENTION_PROCESSORS"]

logger = logging.getLogger(__name__)

# The processors whose fast-mode ``__call__`` routes attention through ``patches.attention.attend``.
FP8_ATTENTION_PROCESSORS = ("QwenDoubleStreamAttnProcessor2_0", "ZSingleStreamAttnProcessor")


def _not_applied(reason: str) -> None:
    warnings.warn(
        f"bcg-diffusion: attention='fp8' not applied: {reason}; attention stays in bf16", BCGWarning, stacklevel=5
    )


class Fp8Attention(Feature):
    name = "FP8 attention"
    component = "transformer"
    defaults = {"attention": None, "fp8_attention_modules": 0}

    def __init__(self) -> None:
        self.modules = 0

    @classmethod
    def create(cls, setup: Setup) -> Fp8Attention | None:
        if setup.config.attention != "fp8":
            return None
        transformer = setup.modules.get("transformer")
        if transformer is None or "transformer" not in setup.accelerated:
            _not_applied("the transformer is not among the accelerated components")
            return None
        parameter = next(transformer.parameters(), None)
        reason = unavailable(parameter.device if parameter is not None else torch.device("cpu"))
        if reason is not None:
            _not_applied(reason)
            return None
        return cls()

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        for module in setup.modules["transformer"].modules():
            processor = getattr(module, "processor", None)
            if type(processor).__name__ in FP8_ATTENTION_PROCESSORS:
                patches.replace(module, KERNEL_ATTRIBUTE, "fp8")
                self.modules += 1
        if self.modules == 0:
            _not_applied(
                f"the transformer has none of the attention processors it supports ({FP8_ATTENTION_PROCESSORS})"
            )
        else:
            logger.info("FP8 attention in %d attention modules", self.modules)

    def stats(self) -> dict[str, object]:
        return {"attention": "fp8" if self.modules else None, "fp8_attention_modules": self.modules}

    def patch_names(self) -> list[str]:
        return ["fp8 attention"] if self.modules else []
