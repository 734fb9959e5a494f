"""Fast mode, opt-in: the transformer's attention in FP8 (``accelerate(pipe, mode="fast", attention="fp8")``).

Query, key, value and the softmax probabilities are quantized to float8 e4m3 and both products of
attention run on FP8 tensor cores. Two kernels can do it:

* **cuDNN's** (:mod:`bcg_diffusion.kernels.cudnn_fp8_attention`), where NVIDIA's
  ``nvidia-cudnn-frontend`` package is installed (``pip install bcg-diffusion[cudnn]``) on a GPU of
  compute capability 9.0 or newer: the faster one at 1024² (one scale per tensor);
* **ours, in Triton** (:mod:`bcg_diffusion.kernels.attention`; scales per token, head and channel):
  used otherwise, with one INFO line saying why cuDNN's is not.

Each module's choice can be set before ``accelerate`` (:func:`choose`, e.g. to compare the two). The
quantization is plain PyTorch inside the compiled blocks, so inductor fuses it into the kernels around,
except cuDNN's query and key, which attention's fused prologue writes in float8 itself (FLUX.1, FLUX.2,
Qwen-Image, Z-Image); Wan's are scaled by their norms' bounds, so that inductor quantizes them in the norm's
kernel without a reduction (:mod:`bcg_diffusion.patches.wan_attention`). :func:`choose_prologue` turns
either off, to compare.

It changes the image more than FP8 linears do (measured in ``docs/quantization.md``), so it is never a
default, not even under ``quantize="fp8"``; fast mode's promise holds: with graphs, the same bytes as
its compiled blocks without graphs (``with eager(pipe):``).

How it reaches the kernel, in any model whose attention goes through diffusers' dispatcher (FLUX.1,
FLUX.2, Wan, Qwen-Image and its Edit variants, Z-Image, HunyuanImage, LTX...):

* processors that call ``dispatch_attention_fn`` themselves get a copy whose dispatch sends plain
  calls to the kernel (:mod:`bcg_diffusion.patches.dispatched_attention`): no model patch needed;
* fast mode's own processors for Qwen-Image and Z-Image (which also fuse attention's prologue) call
  :func:`bcg_diffusion.patches.attention.attend`, which reads the kernel's name from an attribute of the
  attention module (:data:`~bcg_diffusion.patches.attention.KERNEL_ATTRIBUTE`).

``restore`` undoes both. Calls the kernel cannot take (a mask, a head size other than 64 or 128,
context parallelism, an attention backend the user chose in diffusers) keep PyTorch's attention.

Where it cannot apply (no Triton, no GPU of compute capability 8.9 or newer, no attention processor
that dispatches in the model), the pipeline keeps bf16 attention with a warning.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from ..kernels import cudnn_fp8_attention
from ..kernels.attention import unavailable
from ..patches import dispatched_attention
from ..patches.attention import FP8_PROLOGUE_ATTRIBUTE, KERNEL_ATTRIBUTE
from .base import Feature, Setup, transformer_device

__all__ = [
    "FP8_ATTENTION_KERNELS",
    "FP8_ATTENTION_PROCESSORS",
    "Fp8Attention",
    "attention_modules",
    "choose",
    "choose_prologue",
]

logger = logging.getLogger(__name__)

# The processors whose fast-mode ``__call__`` routes attention through ``patches.attention.attend``.
FP8_ATTENTION_PROCESSORS = dispatched_attention.OWN_PROCESSORS
# The attribute on an attention module naming which FP8 kernel it wants: "auto" (cuDNN's where it runs,
# else ours), "cudnn" (cuDNN's; ours, with the INFO line, where it cannot run) or "triton" (ours).
FP8_ATTENTION_KERNEL_ATTRIBUTE = "_bcg_fp8_attention_kernel"
FP8_ATTENTION_KERNELS = ("auto", "cudnn", "triton")
# patches.attention's kernel names for each
_KERNEL_NAMES = {"cudnn": "cudnn-fp8", "triton": "fp8"}


def choose(model: torch.nn.Module, kernel: str) -> int:
    """Set ``kernel`` (one of :data:`FP8_ATTENTION_KERNELS`) on every attention module of ``model`` that
    ``attention="fp8"`` applies to, read when ``accelerate`` prepares it; returns how many. Raises
    ValueError for another kernel.

    >>> choose(pipe.transformer, "triton")  # doctest: +SKIP
    """
    if kernel not in FP8_ATTENTION_KERNELS:
        raise ValueError(f"FP8 attention kernel {kernel!r}: expected one of {FP8_ATTENTION_KERNELS}")
    return _set_on_attention(model, FP8_ATTENTION_KERNEL_ATTRIBUTE, kernel)


def choose_prologue(model: torch.nn.Module, fp8: bool) -> int:
    """Whether attention's fused prologue writes cuDNN's FP8 query and key itself (``fp8=True``, the
    default) or in bf16, quantized after it by their own pass (``False``: what fast mode did before, kept
    to measure the difference), on every attention module of ``model`` that ``attention="fp8"`` applies
    to; returns how many. Either way the same bounds scale them, except in Wan's attention, whose query and
    key ``False`` scales by their largest magnitudes (:mod:`bcg_diffusion.patches.wan_attention`). Raises
    TypeError for a non-bool.

    >>> choose_prologue(pipe.transformer, False)  # doctest: +SKIP
    """
    if not isinstance(fp8, bool):
        raise TypeError(f"choose_prologue takes True or False, not {fp8!r}")
    return _set_on_attention(model, FP8_PROLOGUE_ATTRIBUTE, fp8)


def _dispatching(module: torch.nn.Module) -> bool:
    """Whether ``module``'s processor reaches the FP8 kernel through the generic dispatch."""
    processor = module.__dict__.get("processor")
    return (
        processor is not None
        and not dispatched_attention.own_processor(module)
        and dispatched_attention.dispatches_attention(processor)
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` that ``attention="fp8"`` applies to: those with one of fast mode's
    own processors, and those whose processor calls diffusers' dispatcher."""
    return dispatched_attention.attention_modules(model)


def _set_on_attention(model: torch.nn.Module, attribute: str, value: object) -> int:
    """Set ``attribute`` on every attention module of ``model`` that ``attention="fp8"`` applies to;
    returns how many."""
    modules = attention_modules(model)
    for module in modules:
        setattr(module, attribute, value)
    return len(modules)


def _not_applied(reason: str) -> None:
    warnings.warn(
        f"bcg-diffusion: attention='fp8' not applied: {reason}; attention stays in bf16", BCGWarning, stacklevel=5
    )


class Fp8Attention(Feature):
    name = "FP8 attention"
    component = "transformer"
    experts = True  # Wan 2.2's second expert too
    defaults = {"attention": None, "fp8_attention_modules": 0, "fp8_attention_kernels": {}}

    def __init__(self, cudnn_reason: str | None) -> None:
        self.cudnn_reason = cudnn_reason  # why cuDNN's kernel cannot run here (None: it can)
        self.kernels: dict[str, int] = {}  # "cudnn" / "triton": how many modules use it

    @classmethod
    def create(cls, setup: Setup) -> Fp8Attention | None:
        if setup.config.attention != "fp8":
            return None
        device, reason = transformer_device(setup)
        reason = reason or unavailable(device)
        if reason is not None:
            _not_applied(reason)
            return None
        return cls(cudnn_fp8_attention.unavailable(device))

    @property
    def modules(self) -> int:
        return sum(self.kernels.values())

    def _kernel(self, module: torch.nn.Module) -> str:
        """The kernel ``module`` gets: its choice (:func:`choose`), cuDNN's only where it can run."""
        choice = getattr(module, FP8_ATTENTION_KERNEL_ATTRIBUTE, "auto")
        if choice not in FP8_ATTENTION_KERNELS:
            raise ValueError(
                f"{type(module).__name__}.{FP8_ATTENTION_KERNEL_ATTRIBUTE} is {choice!r}; "
                f"expected one of {FP8_ATTENTION_KERNELS}"
            )
        return "cudnn" if choice != "triton" and self.cudnn_reason is None else "triton"

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        wanted_cudnn = False
        dispatching = []
        for module in attention_modules(setup.modules["transformer"]):
            kernel = self._kernel(module)
            wanted_cudnn |= getattr(module, FP8_ATTENTION_KERNEL_ATTRIBUTE, "auto") != "triton"
            if dispatched_attention.own_processor(module):
                patches.replace(module, KERNEL_ATTRIBUTE, _KERNEL_NAMES[kernel])
            else:
                dispatching.append(module)
            self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        dispatched_attention.install(dispatching, lambda module: _KERNEL_NAMES[self._kernel(module)], patches)
        if self.modules == 0:
            _not_applied(
                "the transformer has no attention processor that calls diffusers' dispatch_attention_fn "
                f"(nor one of {FP8_ATTENTION_PROCESSORS})"
            )
            return
        logger.info("FP8 attention in %d attention modules: %s", self.modules, self.kernels)
        if wanted_cudnn and self.cudnn_reason is not None:
            logger.info("FP8 attention runs our Triton kernel, not cuDNN's: %s", self.cudnn_reason)

    def stats(self) -> dict[str, object]:
        return {
            "attention": "fp8" if self.modules else None,
            "fp8_attention_modules": self.modules,
            "fp8_attention_kernels": dict(self.kernels),
        }

    def patch_names(self) -> list[str]:
        return ["fp8 attention"] if self.modules else []
