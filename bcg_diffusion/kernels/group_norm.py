"""Group norm, optionally with a bias added before it and SiLU after it, in three small kernels.

A VAE decoder spends most of its time between convolutions: each resnet block runs
``conv -> + bias -> group norm -> SiLU -> conv``, and eagerly each arrow is a pass over the activation
(PyTorch adds a convolution's bias in a kernel of its own), besides the group norm's own passes for its
moments and its affine map. :func:`group_norm` reads the activation once for the moments and once to
write the normalised, activated result, with the preceding convolution's bias folded into both reads
(``pre_bias``), in the input's memory layout: contiguous, channels-last, or the channels-innermost
``[N, C, H*W]`` view diffusers' VAE attention normalises.

Arithmetic: ``x + pre_bias`` in float32; each (sample, group)'s mean and variance (population, as
``nn.GroupNorm``'s) from per-chunk sums of values shifted by a sample of their channel, merged with
Chan's formula in a fixed order; ``y = x * a + b`` with ``a = weight / sqrt(var + eps)`` and ``b = bias - mean * a`` in
float32, then SiLU with the GPU's fast exp2, rounded once to the input's dtype. PyTorch's eager
modules round after the bias, after the norm and after the SiLU, so results differ from theirs by
rounding only (fast mode's kind of change). :func:`reference_group_norm` computes the same with
PyTorch's operators; it runs where the kernels cannot (CPU, no Triton), and the tests hold the kernels
to it (Triton's interpreter on a CPU, the GPU).

The launch configuration is fixed and no atomics are used: a call's bytes depend on its inputs only, so
a CUDA graph of it replays the bytes of an eager call. Plain Python functions, not PyTorch custom
operators: they run in fast mode's eager-captured VAE decoder, never inside compiled code.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from . import triton_unavailable

__all__ = ["group_norm", "reference_group_norm", "unavailable", "unsupported"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (elements per tile, warps, programs the moments' first pass aims for, partials per step of the second):
# fixed, so that bytes never depend on a timing.
_CONFIG = (4096, 4, 1024, 1024)
_MAX_TILE_CHANNELS = 1024  # channels-last: one program takes up to this many channels (whole groups)

unavailable = triton_unavailable  # why the Triton kernels cannot run on a device (None: they can)


def _spatial_stride(x: torch.Tensor) -> int | None:
    """The one stride of ``x``'s spatial dimensions seen as one (``x.flatten(2)`` a view), or None."""
    stride = None
    expected = None
    for size, step in reversed(list(zip(x.shape[2:], x.stride()[2:]))):
        if size == 1:
            continue
        if stride is None:
            stride, expected = step, step * size
        elif step != expected:
            return None
        else:
            expected = step * size
    return 1 if stride is None else stride


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill its storage span exactly (a permutation of a contiguous tensor)."""
    expected = 1
    for step, size in sorted((st, s) for s, st in zip(x.shape, x.stride()) if s != 1):
        if step != expected:
            return False
        expected *= size
    return True


def unsupported(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    pre_bias: torch.Tensor | None = None,
) -> str | None:
    """Why :func:`group_norm`'s kernels refuse these arguments (None: they take them). Only tensor
    properties; :func:`group_norm` computes the reference instead."""
    if x.dim() < 2:
        return "the input has fewer than two dimensions"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (needs one of {_DTYPES})"
    channels = x.shape[1]
    if num_groups < 1 or channels % num_groups:
        return f"{channels} channels cannot be split into {num_groups} groups"
    per_group = channels // num_groups
    if per_group & (per_group - 1):
        return f"{per_group} channels per group is not a power of two"
    if not _dense(x) or _spatial_stride(x) is None:
        return "the spatial dimensions do not flatten to one stride over dense memory"
    for name, t in (("weight", weight), ("bias", bias), ("pre_bias", pre_bias)):
        if t is not None and (t.shape != (channels,) or not t.is_contiguous() or t.device != x.device):
            return f"{name} is not a contiguous [{channels}] tensor on the input's device"
    return None


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    pre_bias: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """``silu?(F.group_norm(x + pre_bias[c], num_groups, weight, bias, eps))`` for ``x`` ``[N, C, *]``,
    up to rounding (see the module docstring), in ``x``'s dtype and memory layout. Runs the Triton
    kernels where they can (a CUDA tensor they take, :func:`unsupported`), the reference elsewhere.
    Raises ValueError when ``C`` is not a multiple of ``num_groups``; refuses autograd (a tensor that
    requires grad) with ValueError, as it has no backward.

    >>> x = torch.randn(1, 8, 4, 4)
    >>> torch.allclose(group_norm(x, 2, silu=True), F.silu(F.group_norm(x, 2)), atol=1e-5)
    True
    """
    if x.dim() >= 2 and x.shape[1] % max(num_groups, 1):
        raise ValueError(f"{x.shape[1]} channels cannot be split into {num_groups} groups")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, pre_bias)):
        raise ValueError("bcg_diffusion's group norm has no backward: call it without autograd")
    if unavailable(x.device) is not None or unsupported(x, num_groups, weight, bias, pre_bias) is not None:
        return reference_group_norm(x, num_groups, weight, bias, eps, pre_bias=pre_bias, silu=silu)
    out = torch.empty_like(x)
    if x.numel():
        _launch(x, out, num_groups, weight, bias, eps, pre_bias, silu)
    return out


def reference_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    pre_bias: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """:func:`group_norm` with PyTorch's operators: everything in float32, rounded once at the end."""
    channel_shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    values = x.float()
    if pre_bias is not None:
        values = values + pre_bias.float().view(channel_shape)
    grouped = values.reshape(x.shape[0], num_groups, -1)
    var, mean = torch.var_mean(grouped, dim=-1, correction=0, keepdim=True)
    y = ((grouped - mean) * torch.rsqrt(var + eps)).view(x.shape)
    if weight is not None:
        y = y * weight.float().view(channel_shape)
    if bias is not None:
        y = y + bias.float().view(channel_shape)
    if silu:
        y = F.silu(y)
    out = torch.empty_like(x)
    out.copy_(y)
    return out


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    pre_bias: torch.Tensor | None,
    silu: bool,
    config: tuple[int, int, int, int] | None = None,
) -> None:
    """Run the three kernels of ``x`` into ``out`` (strided alike). On CPU tensors they run only in
    Triton's interpreter (``TRITON_INTERPRET=1``)."""
    from . import _group_norm_triton as kernels

    tile, warps, aim, step = config or _CONFIG
    batch, channels = x.shape[:2]
    spatial = math.prod(x.shape[2:])
    per_group = channels // num_groups
    stride_s = _spatial_stride(x)
    group_block = 1
    if x.stride(1) == 1:  # channels innermost: a program takes whole rows of channels (coalesced)
        while num_groups % (group_block * 2) == 0 and group_block * 2 * per_group <= min(_MAX_TILE_CHANNELS, tile):
            group_block *= 2
    block_s = max(1, tile // (group_block * per_group))
    blocks = num_groups // group_block
    tiles = -(-spatial // block_s)
    iters = max(1, (tiles * batch * blocks) // aim)
    chunks = -(-tiles // iters)
    partial_mean = torch.empty(batch, num_groups, chunks, dtype=torch.float32, device=x.device)
    partial_m2 = torch.empty_like(partial_mean)
    moments = torch.empty(batch, num_groups, 2, dtype=torch.float32, device=x.device)
    anything = x  # a pointer for the parameters a launch does not read
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()  # CPU: interpreter
    with device:
        kernels.group_partials[(chunks, batch, blocks)](
            x, pre_bias if pre_bias is not None else anything, partial_mean, partial_m2, spatial, x.stride(0),
            x.stride(1), stride_s, iters, chunks, num_groups,
            CG=per_group, GPP=group_block, BLOCK_S=block_s, HAS_PRE_BIAS=pre_bias is not None, num_warps=warps,
        )  # fmt: skip
        kernels.group_moments[(batch * num_groups,)](
            partial_mean, partial_m2, moments, spatial, block_s * iters, chunks, per_group, float(eps),
            BLOCK_R=step, num_warps=warps,
        )  # fmt: skip
        kernels.group_apply[(tiles, batch, blocks)](
            x, out, moments, weight if weight is not None else anything, bias if bias is not None else anything,
            pre_bias if pre_bias is not None else anything, spatial, x.stride(0), x.stride(1), stride_s, num_groups,
            CG=per_group, GPP=group_block, BLOCK_S=block_s, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, HAS_PRE_BIAS=pre_bias is not None, SILU=silu, num_warps=warps,
        )  # fmt: skip
