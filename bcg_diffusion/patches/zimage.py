"""Z-Image: caption pad masks as device tensors, so one graph serves every caption of a length bucket.

Z-Image pads each caption to its next multiple of 32 by repeating the caption's last token, embeds
it, and then overwrites the padded rows with a learned pad token (``patchify_and_embed`` builds the
pad mask from the caption's length, ``_prepare_sequence`` applies it). The mask is the only thing
that depends on the exact token length, but it is built from a host-side int, so every token length
would be a graph signature of its own and a service would capture for almost every new prompt.

Here the padding moves in front of the call: :func:`bucket_captions` pads each caption exactly as
the model would and passes the pad masks as tensors; inside the forward,
:func:`patchify_with_caption_masks` hands the model those masks instead of the all-false ones it
builds for an already padded caption. Every shape, position id and kernel is then that of the
padded length, a graph's static mask buffer takes each call's mask, and the result is the same bytes
as the original call (tests compare them). Rows that differ at all are the batch-padding rows of
the shorter caption in a batch of two lengths (CFG): their RoPE factor is 0 instead of 1, and those
rows are masked out of attention and cut off before the caption joins the image tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "CAPTION_MULTIPLE",
    "bucket_captions",
    "caption_bucket",
    "pad_captions",
    "patchify_with_caption_masks",
    "using_caption_masks",
    "with_caption_masks",
]

CAPTION_MULTIPLE = 32  # diffusers' SEQ_MULTI_OF for Z-Image
_MASKS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("bcg_caption_masks", default=None)


def caption_bucket(length: int) -> int:
    """The padded length Z-Image gives a caption of ``length`` tokens.

    >>> caption_bucket(1), caption_bucket(32), caption_bucket(33)
    (32, 32, 64)
    """
    return length + (-length) % CAPTION_MULTIPLE


@functools.lru_cache(maxsize=256)
def _pad_mask(length: int, padded: int, device: torch.device) -> torch.Tensor:
    # Cached: a step calls the transformer with the same captions every time, and the runner copies
    # the mask into its own buffer, so one read-only tensor per (length, bucket) is enough.
    return torch.arange(padded, device=device) >= length


def pad_captions(cap_feats: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pad each caption ``[L, D]`` to :func:`caption_bucket` ``(L)`` rows by repeating its last row,
    as Z-Image's ``_pad_with_ids`` does, and return ``(padded captions, pad masks)``; a mask is a bool
    ``[bucket]`` tensor, True on the padded rows. Raises ValueError for an empty or non-2-D caption.
    """
    padded, masks = [], []
    for feat in cap_feats:
        if feat.dim() != 2 or feat.shape[0] == 0:
            raise ValueError(
                f"a Z-Image caption must be a non-empty [tokens, features] tensor, got {tuple(feat.shape)}"
            )
        length = feat.shape[0]
        bucket = caption_bucket(length)
        if bucket > length:
            feat = torch.cat([feat, feat[-1:].repeat(bucket - length, 1)], dim=0)
        padded.append(feat)
        capturing = feat.is_cuda and torch.cuda.is_current_stream_capturing()  # no cached tensor from a graph pool
        masks.append(
            torch.arange(bucket, device=feat.device) >= length if capturing else _pad_mask(length, bucket, feat.device)
        )
    return padded, masks


def bucket_captions(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The transformer call's ``(args, kwargs)`` with its captions padded to their buckets and their
    pad masks added as ``caption_pad_masks`` (what :func:`with_caption_masks` takes). Calls that are not
    plain text-to-image (omni mode's nested lists, or anything unexpected) come back unchanged, and keep
    one signature per caption length.
    """
    in_args = len(args) > 2
    cap_feats = args[2] if in_args else kwargs.get("cap_feats")
    x = args[0] if args else kwargs.get("x")
    plain = (
        isinstance(cap_feats, (list, tuple))
        and isinstance(x, (list, tuple))
        and all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] > 0 for t in cap_feats)
        and all(isinstance(t, torch.Tensor) for t in x)
    )
    if not plain or "caption_pad_masks" in kwargs:
        return args, kwargs
    padded, masks = pad_captions(cap_feats)
    if in_args:
        args = (*args[:2], padded, *args[3:])
    else:
        kwargs = dict(kwargs, cap_feats=padded)
    return args, dict(kwargs, caption_pad_masks=masks)


@contextlib.contextmanager
def using_caption_masks(masks: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block, :func:`patchify_with_caption_masks` uses ``masks`` (one per caption)."""
    token = _MASKS.set(list(masks))
    try:
        yield
    finally:
        _MASKS.reset(token)


def with_caption_masks(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the transformer's ``forward`` so that it accepts ``caption_pad_masks=`` (from
    :func:`bucket_captions`) and runs with them; without it, the call is unchanged."""

    @functools.wraps(forward)
    def forward_with_caption_masks(*args: Any, caption_pad_masks: Sequence[torch.Tensor] | None = None, **kwargs: Any):
        if caption_pad_masks is None:
            return forward(*args, **kwargs)
        with using_caption_masks(caption_pad_masks):
            return forward(*args, **kwargs)

    return forward_with_caption_masks


def patchify_with_caption_masks(patchify_and_embed: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a bound ``ZImageTransformer2DModel.patchify_and_embed``: inside :func:`using_caption_masks`,
    its caption pad masks are the given ones. Raises ValueError when a mask does not match its
    caption (the captions were not padded by :func:`pad_captions`)."""

    @functools.wraps(patchify_and_embed)
    def patched(all_image: list, all_cap_feats: list, patch_size: int, f_patch_size: int) -> tuple:
        out = patchify_and_embed(all_image, all_cap_feats, patch_size, f_patch_size)
        masks = _MASKS.get()
        if masks is None:
            return out
        captions = out[1]
        if len(masks) != len(captions) or any(m.shape != (len(c),) for m, c in zip(masks, captions)):
            raise ValueError(
                f"caption pad masks {[tuple(m.shape) for m in masks]} do not match the padded captions "
                f"{[len(c) for c in captions]}"
            )
        return (*out[:6], masks)

    return patched
