"""Fast mode's attention under FP8 (Qwen-Image's, Z-Image's): cuDNN's FP8 attention output handed straight to
an FP8 output projection, instead of scaled back to bf16 and quantized again.

On Hopper cuDNN's FP8 attention writes its output in float8 e4m3, with one descale (per CFG group for
Qwen-Image; :func:`bcg_diffusion.kernels.cudnn_fp8_attention.attention_fp8_output`). Where the output
projection (``to_out``; Qwen-Image's image stream's) is an FP8 linear too (``quantize="fp8"`` with
``quantize_filter=block_linears(model)``; the default filter keeps it in bf16), the output used to be scaled
back to bf16 (a pass over the output, 21 µs of a Qwen-Image block at 1024² with CFG, run 148), then
quantized again, row by row, by torchao's dynamic activation quantization, before the same FP8 product.
:func:`project` instead gives torchao's product the attention's float8 rows as they are, each row's
scale its group's descale (:func:`bcg_diffusion.patches.fp8_feed_forward.linear_on_fp8`). The product then
quantizes nothing, and its input is rounded once (by attention) instead of three times (attention, bf16,
the row quantization): another rounding than the path it replaces, which fast mode allows (its contract is
with its own compiled blocks, which take the same path). Measured on an H200 (runs 158 and 159): 0.015 s of
Qwen-Image's 50 steps at 1024² with CFG (within the runs' spread) and 2% of a Z-Image-Turbo call at 1024²
(0.508 → 0.499 s); most of what FP8 output projections gain is the product's own.

Per attention module, :data:`FP8_OUTPUT_ATTRIBUTE` chooses (:func:`choose`): ``"direct"`` (the default) or
``"scaled"``, the output scaled back and quantized again, as before. The projection must be a plain
``nn.Linear`` whose weight is torchao's float8 e4m3 tensor with one scale per row and activations quantized
per row, without hooks of its own or a forward replaced (:func:`takes_fp8`); a LoRA layer, a bf16 or
weight-only FP8 weight or a hook gets the scaled path. A module attribute, so that the check of the Python
state a graph read sees it change. The direct path calls the product itself, not the module: a global
module hook sees no call of the projection there, as with the stacked output projection.
"""

from __future__ import annotations

import torch

from .fp8_feed_forward import linear_on_fp8, unfit_float8_weight
from .stacked_output import plain_linear

__all__ = ["FP8_OUTPUT_ATTRIBUTE", "FP8_OUTPUT_CHOICES", "choose", "project", "takes_fp8"]

FP8_OUTPUT_ATTRIBUTE = "_bcg_fp8_attention_output"
FP8_OUTPUT_CHOICES = ("direct", "scaled")


def choose(model: torch.nn.Module, choice: str) -> int:
    """Set ``choice`` (one of :data:`FP8_OUTPUT_CHOICES`) on every attention module of ``model`` (those with
    a ``to_out`` list), before or after ``accelerate``; returns how many. Raises ValueError for another
    choice.

    >>> choose(pipe.transformer, "scaled")  # doctest: +SKIP
    """
    if choice not in FP8_OUTPUT_CHOICES:
        raise ValueError(f"choice must be one of {FP8_OUTPUT_CHOICES}, got {choice!r}")
    modules = [m for m in model.modules() if isinstance(getattr(m, "to_out", None), torch.nn.ModuleList)]
    for module in modules:
        setattr(module, FP8_OUTPUT_ATTRIBUTE, choice)
    return len(modules)


def takes_fp8(attn: torch.nn.Module) -> bool:
    """Whether ``attn``'s output projection takes attention's FP8 output as it is: the module chose
    ``"direct"`` (:data:`FP8_OUTPUT_ATTRIBUTE`, the default) and ``attn.to_out[0]`` is a plain ``nn.Linear``
    (:func:`bcg_diffusion.patches.stacked_output.plain_linear`: no hooks of its own, no forward replaced)
    with a torchao FP8 weight whose product takes activations quantized per row, as fast mode's FP8
    feed-forward asks of its weights (:func:`bcg_diffusion.patches.fp8_feed_forward.unfit_float8_weight`).
    Raises ValueError for a value of the attribute that is not one of :data:`FP8_OUTPUT_CHOICES`."""
    choice = getattr(attn, FP8_OUTPUT_ATTRIBUTE, "direct")
    if choice not in FP8_OUTPUT_CHOICES:
        raise ValueError(
            f"{type(attn).__name__}.{FP8_OUTPUT_ATTRIBUTE} is {choice!r}; expected one of {FP8_OUTPUT_CHOICES}"
        )
    projection = attn.to_out[0]
    return choice == "direct" and plain_linear(projection) and unfit_float8_weight(projection.weight) is None


def project(
    attn: torch.nn.Module, parts: list[torch.Tensor], descales: list[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """``attn.to_out`` (projection, then dropout) on rows given in float8: ``parts`` ``[rows, C]`` e4m3 each,
    all of the same rows (in batch order; for Qwen-Image each a batch row's image tokens), ``descales`` one
    float32 scalar per part (the part's real values are ``part.float() * descale``); returns
    ``[len(parts), rows, N]`` in ``dtype``. One torchao product over the parts joined (a copy of float8
    rows, half the bytes of the bf16 join; one part is not copied), each row's scale its part's descale.
    Needs :func:`takes_fp8`; raises ValueError when the parts and descales differ in number or the parts
    are not float8 e4m3."""
    if len(parts) != len(descales) or not parts:
        raise ValueError(f"{len(parts)} parts and {len(descales)} descales: one descale per part is needed")
    if any(part.dtype != torch.float8_e4m3fn for part in parts):
        raise ValueError(f"the parts must be float8_e4m3fn, not {sorted({str(p.dtype) for p in parts})}")
    data = torch.cat(parts) if len(parts) > 1 else parts[0]
    scale = torch.cat([d.float().reshape(1, 1).expand(part.shape[0], 1) for part, d in zip(parts, descales)])
    output = linear_on_fp8(attn.to_out[0], data, scale, dtype).unflatten(0, (len(parts), -1))
    if len(attn.to_out) > 1:
        output = attn.to_out[1](output)  # dropout
    return output
