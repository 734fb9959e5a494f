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
with its own compiled blocks, which take the same path).

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

from .fp8_feed_forward import linear_on_fp8

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


def _row_wise_fp8(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is torchao's ``Float8Tensor`` in e4m3 with one scale per output row whose product
    takes activations quantized per row in e4m3 (``Float8DynamicActivationFloat8WeightConfig(PerRow())``'s
    weights): what :func:`linear_on_fp8` multiplies an input quantized per row with. A weight-only FP8
    weight (no product settings, bf16 activations) is not. Types and attributes only (dynamo guards on
    them)."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return False  # a plain weight: no need to import torchao (FP8 attention runs without it)
    try:
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows import Float8Tensor, QuantizeTensorToFloat8Kwargs
    except ImportError:  # without torchao no weight is its FP8 tensor: the scaled path, which needs none
        return False
    if not isinstance(weight, Float8Tensor):
        return False
    activation = weight.act_quant_kwargs
    return (
        weight.qdata.dtype == torch.float8_e4m3fn
        and tuple(weight.block_size) == (1, weight.shape[-1])
        and weight.mm_config is not None
        and isinstance(activation, QuantizeTensorToFloat8Kwargs)
        and isinstance(activation.granularity, PerRow)
        and activation.float8_dtype == torch.float8_e4m3fn
    )


def takes_fp8(attn: torch.nn.Module) -> bool:
    """Whether ``attn``'s output projection takes attention's FP8 output as it is: the module chose
    ``"direct"`` (:data:`FP8_OUTPUT_ATTRIBUTE`, the default) and ``attn.to_out[0]`` is a plain ``nn.Linear``
    with a torchao FP8 weight whose product takes activations quantized per row (:func:`_row_wise_fp8`),
    no hooks of its own and no forward replaced on it. Raises ValueError for a value of the attribute that
    is not one of :data:`FP8_OUTPUT_CHOICES`."""
    choice = getattr(attn, FP8_OUTPUT_ATTRIBUTE, "direct")
    if choice not in FP8_OUTPUT_CHOICES:
        raise ValueError(
            f"{type(attn).__name__}.{FP8_OUTPUT_ATTRIBUTE} is {choice!r}; expected one of {FP8_OUTPUT_CHOICES}"
        )
    projection = attn.to_out[0]
    return (
        choice == "direct"
        and type(projection) is torch.nn.Linear
        and "forward" not in projection.__dict__
        and not (projection._forward_hooks or projection._forward_pre_hooks)
        and _row_wise_fp8(projection.weight)
    )


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
