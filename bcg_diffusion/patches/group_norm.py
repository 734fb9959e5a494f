"""Group norm with its statistics from one parallel reduction, for fast mode's VAE decode.

PyTorch's CUDA group norm computes each (sample, group) row's moments in one thread block. A VAE
decoder at batch 1 has 32 groups, so those moments run on 32 of an H200's 132 multiprocessors, each
reading megabytes: at 512² the moments took 10.4 of Z-Image's 20.6 ms VAE decode, and 46 of 86 ms
at 1024² (run 35). ``torch.var_mean`` over the same rows spreads each row over many blocks, and one
``addcmul`` then applies the normalisation and the affine weights.

The arithmetic is the native kernel's: moments accumulated in float32 and rounded to the input's
dtype, then ``y = x * a + b`` in float32 with ``a = rstd * weight`` and ``b = bias - mean * a``,
rounded once. Only where the moments are rounded differs (PyTorch rounds ``mean`` and ``rstd``, we
``mean`` and ``var``), so results match the original up to that rounding (tested against it).
Fast mode applies it to the accelerated VAE's decoder only (:func:`patch_group_norms`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ..core.hooks import MethodPatches

__all__ = ["VAE_GROUP_NORM_PATCH", "group_norm", "patch_group_norms"]

VAE_GROUP_NORM_PATCH = "vae decoder group norm (parallel moments)"  # its name in stats()["patches"]


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)`` for a contiguous ``[N, C, *]`` tensor, with
    the moments from ``torch.var_mean``. Anything else goes to ``F.group_norm`` as is: other memory
    layouts (channels-last), and calls that autograd records (the fused ``addcmul`` writes into a
    preallocated output, which autograd refuses).

    >>> x = torch.randn(1, 8, 4, 4)
    >>> torch.allclose(group_norm(x, 2), F.group_norm(x, 2), atol=1e-5)
    True
    """
    recorded = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if recorded or x.dim() < 2 or not x.is_contiguous():
        return F.group_norm(x, num_groups, weight, bias, eps)
    batch, channels = x.shape[:2]
    if channels % num_groups:
        raise ValueError(f"{channels} channels cannot be split into {num_groups} groups")
    grouped = x.view(batch, num_groups, channels // num_groups, -1)
    var, mean = torch.var_mean(grouped, dim=(2, 3), correction=0, keepdim=True)  # [N, G, 1, 1]
    scale = torch.rsqrt(var.float() + eps)
    if weight is not None:
        scale = scale * weight.float().view(1, num_groups, -1, 1)  # [N, G, C/G, 1]
    shift = -mean.float() * scale
    if bias is not None:
        shift = shift + bias.float().view(1, num_groups, -1, 1)
    out = torch.empty_like(x)
    # Computed in float32 (the type of shift and scale), rounded once into x's dtype.
    torch.addcmul(shift, grouped, scale, out=out.view(grouped.shape))
    return out


def _forward(module: torch.nn.GroupNorm) -> Any:
    @functools.wraps(type(module).forward)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return group_norm(x, module.num_groups, module.weight, module.bias, module.eps)

    return forward


def patch_group_norms(module: torch.nn.Module, patches: MethodPatches) -> int:
    """Give every ``nn.GroupNorm`` inside ``module`` the forward above (recorded in ``patches``, so
    ``patches.undo()`` restores them); returns how many. Modules whose forward someone else already
    replaced on the instance are left alone."""
    count = 0
    for submodule in module.modules():
        if type(submodule) is torch.nn.GroupNorm and "forward" not in submodule.__dict__:
            patches.replace(submodule, "forward", _forward(submodule))
            count += 1
    return count
