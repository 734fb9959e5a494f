"""A linear layer over several blocks of rows, each product written straight into its rows of one output.

``stacked_linear(parts, weight, bias)`` is ``F.linear(torch.cat(parts), weight, bias)`` without the
concatenation: one output ``[sum of rows, N]`` is allocated and each part's product (cuBLAS, through
``torch.addmm``) writes its own rows of it. Fast mode's Qwen-Image attention uses it for the image
stream's output projection: each CFG group's attention output is a tensor of its own (SDPA allocates
it), and joining the groups' image rows before the product was a copy of the whole stream, 30–42 µs of
a Qwen-Image block at 1024² (2.8 ms in FP8, 4.4 ms in bf16; runs 93, 94 and 145).

Each part is its own product, so a row's bytes are those of ``F.linear`` on its part, which cuBLAS may
compute with another kernel than the product over all rows (fast mode allows it; its contract is with its
own compiled blocks, which call the same operator). A PyTorch custom operator
(``bcg_diffusion::stacked_linear``): compiled, inductor calls it as it is and cannot turn its writes into
a product and a copy again. No backward.
"""

from __future__ import annotations

import torch

__all__ = ["stacked_linear", "unsupported"]


def unsupported(parts: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why :func:`stacked_linear` refuses these tensors (None: it takes them): ``parts`` at least one
    ``[rows, K]`` tensor, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None, all plain tensors of one dtype
    on one device, none requiring grad where autograd is on."""
    if not parts:
        return "no parts"
    tensors = [*parts, weight, *((bias,) if bias is not None else ())]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return "a tensor subclass (e.g. a quantized weight)"
    if weight.dim() != 2 or any(p.dim() != 2 or p.shape[1] != weight.shape[1] for p in parts):
        return f"parts {[tuple(p.shape) for p in parts]} are not [rows, {weight.shape[-1]}] for weight {tuple(weight.shape)}"
    if bias is not None and bias.shape != (weight.shape[0],):
        return f"bias {tuple(bias.shape)} is not [{weight.shape[0]}]"
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        return "the tensors differ in dtype or device"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd is on and a tensor requires grad (no backward)"
    return None


def stacked_linear(parts: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(torch.cat(parts), weight, bias)`` with each part's product written into its rows of the
    output, in ``parts`` order; ``[sum of rows, N]``. Raises ValueError on what :func:`unsupported` names.

    >>> w, parts = torch.randn(3, 4), [torch.randn(2, 4), torch.randn(5, 4)]
    >>> stacked_linear(parts, w).shape
    torch.Size([7, 3])
    """
    reason = unsupported(parts, weight, bias)
    if reason is not None:
        raise ValueError(f"bcg_diffusion's stacked linear cannot take these tensors: {reason}")
    return torch.ops.bcg_diffusion.stacked_linear(parts, weight, bias)


@torch.library.custom_op("bcg_diffusion::stacked_linear", mutates_args=())
def _stacked_linear_op(parts: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = _empty(parts, weight)
    start = 0
    for part in parts:
        rows = out[start : start + part.shape[0]]
        if bias is None:
            torch.mm(part, weight.t(), out=rows)
        else:
            torch.addmm(bias, part, weight.t(), out=rows)
        start += part.shape[0]
    return out


def _empty(parts: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    rows = sum(part.shape[0] for part in parts)
    return torch.empty((rows, weight.shape[0]), dtype=weight.dtype, device=weight.device)


@_stacked_linear_op.register_fake
def _(parts, weight, bias):  # noqa: ANN001, ANN202
    return _empty(parts, weight)
