"""Fast mode: the tanh GELU of a feed-forward in the epilogue of its matrix product.

diffusers' ``GELU`` module (``activation_fn="gelu-approximate"``: Qwen-Image's feed-forwards) runs its
projection, then the activation as a separate pass: compiled, a kernel that reads and writes the whole
``[tokens, 4 x dim]`` hidden state once more (0.15 ms of each Qwen-Image block at 1024² with CFG,
run 82). cuBLASLt applies the same tanh GELU in the product's epilogue
(``torch._addmm_activation(..., use_gelu=True)``), so the pass disappears; the activation is computed in
the product's float32 accumulator before rounding, which changes rounding only (fast mode's).

Applied to modules whose projection is a plain ``nn.Linear`` with a bias, in bf16 or fp16, on a CUDA
GPU; a quantized projection (torchao's FP8 weights) keeps its own path, where inductor already fuses
the GELU into the next product's activation quantization.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.hooks import MethodPatches
from .followed import installable

__all__ = ["GELU_EPILOGUE_PATCH", "gelu_in_epilogue", "patch_gelu_epilogues"]

GELU_EPILOGUE_PATCH = "GELU in the matrix product's epilogue"


def gelu_in_epilogue(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for diffusers' ``GELU`` ``module`` (tanh approximation) that computes
    ``gelu(proj(x))`` as one cuBLASLt product with the activation in its epilogue. Should ``module.proj``
    be replaced later (a LoRA layer wrapping it), the module's own forward runs instead."""
    proj = module.proj
    original = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if module.proj is not proj:
            return original(module, hidden_states)
        flat = hidden_states.flatten(0, -2)
        out = torch._addmm_activation(proj.bias, flat, proj.weight.t(), use_gelu=True)
        return out.unflatten(0, hidden_states.shape[:-1])

    return forward


def _fits(module: torch.nn.Module) -> bool:
    proj = getattr(module, "proj", None)
    return (
        type(module).__name__ == "GELU"
        and getattr(module, "approximate", None) == "tanh"
        and type(proj) is torch.nn.Linear  # not a quantized or LoRA-wrapped linear
        and proj.bias is not None
        and type(proj.weight) in (torch.Tensor, torch.nn.Parameter)
        and proj.weight.dtype in (torch.bfloat16, torch.float16)
        and proj.weight.is_cuda
    )


def patch_gelu_epilogues(model: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every fitting ``GELU`` module in ``model`` the forward of :func:`gelu_in_epilogue`
    (recorded in ``patches``); returns how many. None is patched (with a warning) when diffusers' ``GELU`` is not
    the code it was written for (:mod:`bcg_diffusion.patches.followed`)."""
    fitting = [module for module in model.modules() if _fits(module)]
    if not fitting or not installable("gelu epilogue", stacklevel=4):
        return 0
    for module in fitting:
        patches.replace(module, "forward", gelu_in_epilogue(module))
    return len(fitting)
