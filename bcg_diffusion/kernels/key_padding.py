"""Attention masks that only hide keys (a text's padding), turned into the key counts our kernels take.

Models that pad their prompt to a fixed length hand diffusers' dispatcher a boolean mask of shape
``[B, 1, 1, S_k]``: every query of a batch row sees the same keys, the padding hidden (HunyuanImage 2.1,
HunyuanVideo). cuDNN's FP8 attention and FlashAttention-4 take instead, per batch row, how many
keys it attends to: the first ones. :func:`visible_keys` recognises such a mask and :func:`visible_first`
puts the visible keys first, in their order, and counts them.

Why a gather and not the mask taken as a prefix: whether the visible keys come first is known only on the
GPU, and reading the mask on the host would wait for it on every call (an automatic break in a graph).
The gather is one pass over the key and the value, which inductor folds into the kernel around it inside
fast mode's compiled blocks (the FP8 kernel's quantization of them, for one). A softmax does not depend on
the order of its keys, except in rounding; where the visible keys come first already (HunyuanImage's
mask), the order is unchanged.

>>> mask = torch.tensor([True, False, True])[None, None, None, :]
>>> visible = visible_keys(mask, torch.zeros(1, 3, 1, 4))
>>> key, value, lengths = visible_first(torch.arange(3.0)[None, :, None, None], torch.zeros(1, 3, 1, 1), visible)
>>> key.flatten().tolist(), lengths.tolist()
([0.0, 2.0, 1.0], [2])
"""

from __future__ import annotations

import torch

__all__ = ["check_lengths", "reference_mask", "visible_first", "visible_first_order", "visible_keys"]


def visible_keys(attn_mask: object, key: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, S_k]`` boolean mask of the keys each batch row sees, when ``attn_mask`` hides keys only: a
    boolean tensor of shape ``(B or 1, 1, 1, S_k)`` for a ``[B, S_k, H, D]`` ``key``. None for any other mask
    (additive, per query or per head, another length): those calls keep PyTorch's attention."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or attn_mask.ndim != 4:
        return None
    batch, tokens = key.shape[0], key.shape[1]
    rows, heads, queries, keys = attn_mask.shape
    if heads != 1 or queries != 1 or keys != tokens or rows not in (1, batch):
        return None
    return attn_mask.reshape(rows, tokens).expand(batch, tokens)


def visible_first(
    key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` (``[B, S_k, H, D]``) with each batch row's visible keys first, in their order, and
    how many there are: ``(key, value, lengths)``, ``lengths`` int32 ``[B]``. ``visible`` is
    :func:`visible_keys`' ``[B, S_k]`` mask. No host sync: a stable sort on "hidden" and a gather. A row that
    sees no key has no defined attention (PyTorch's is NaN there); the kernels give theirs, not checked."""
    order = visible_first_order(visible)
    rows = torch.arange(key.shape[0], device=key.device)[:, None]
    lengths = visible.sum(dim=1, dtype=torch.int32)
    return key[rows, order], value[rows, order], lengths


def visible_first_order(visible: torch.Tensor) -> torch.Tensor:
    """For a ``[B, S]`` boolean ``visible``, the ``[B, S]`` int64 indices that put each row's visible positions
    first and the hidden ones after, each group in its original order (a stable sort on "hidden": fixed shapes,
    no host sync). Gathering by them moves values without arithmetic."""
    return torch.argsort((~visible).to(torch.uint8), dim=1, stable=True)


def reference_mask(lengths: torch.Tensor, tokens: int) -> torch.Tensor:
    """The ``[B, 1, 1, tokens]`` boolean mask that shows each batch row its first ``lengths`` keys: what the
    kernels' references hand PyTorch's attention."""
    return (torch.arange(tokens, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def check_lengths(key_lengths: torch.Tensor | None, batch: int) -> None:
    """Raise ValueError unless ``key_lengths`` is None or what :func:`visible_first` returns for ``batch``
    rows: int32 of shape ``[batch]``."""
    if key_lengths is not None and (key_lengths.dtype != torch.int32 or tuple(key_lengths.shape) != (batch,)):
        raise ValueError(
            f"key_lengths must be int32 of shape ({batch},), not {key_lengths.dtype} {tuple(key_lengths.shape)}"
        )
