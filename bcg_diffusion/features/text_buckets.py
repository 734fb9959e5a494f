"""Text-length buckets for Qwen-Image: one captured signature serves every prompt up to a bucket length.

Every prompt token length is a new transformer signature, so a service sees a new capture for almost
every request. With buckets, the pipeline's ``encode_prompt`` pads the prompt embeddings with zeros
and the mask with zeros up to the next bucket length (e.g. 64, 128, 256, 512), and the transformer
runs its masked path: padded tokens are masked out of attention, and the text RoPE positions of the
real tokens do not move (Qwen-Image places text after the image positions, counting from the start).
The result equals the unpadded call up to rounding: the masked attention sums a different number of
exact zeros and may take another attention kernel. Off by default (exact mode pads nothing).

Z-Image is not bucketed here: its captions are padded by the model itself to a multiple of 32 with a
*learned* pad token that attention sees, so padding further would change the image. Those multiples
of 32 are its buckets, exact ones: see :mod:`bcg_diffusion.patches.zimage`.

The :class:`TextBuckets` feature installs the padding on the pipeline's ``encode_prompt`` (a feature of
each pipeline, not of a shared module). Adapters that bucket exactly by themselves (Z-Image) refuse it,
with a warning.
"""

from __future__ import annotations

import bisect
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..core.runner import BCGWarning
from .base import Feature, Setup

__all__ = ["TextBuckets", "bucket_for", "pad_to_bucket", "text_buckets_wrapper"]

logger = logging.getLogger(__name__)


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``length``; None when ``length`` exceeds every bucket.

    >>> bucket_for(70, (64, 128, 256)), bucket_for(64, (64, 128)), bucket_for(300, (64, 128))
    (128, 64, None)
    """
    index = bisect.bisect_left(buckets, length)
    return buckets[index] if index < len(buckets) else None


def pad_to_bucket(
    embeds: torch.Tensor, mask: torch.Tensor | None, buckets: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pad ``embeds`` ``[B, L, D]`` with zeros and ``mask`` ``[B, L]`` (None: all tokens valid) with zeros
    to the bucket of ``L``. Returns them unchanged when ``L`` exceeds the largest bucket. The mask comes
    back as int64, the dtype Qwen-Image's tokenizer gives, so padded calls share one signature.
    """
    batch, length = embeds.shape[:2]
    target = bucket_for(length, buckets)
    if target is None:
        return embeds, mask
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.long, device=embeds.device)
    if target > length:
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, target - length))
        mask = torch.nn.functional.pad(mask, (0, target - length))
    return embeds, mask.to(torch.long)


def text_buckets_wrapper(encode_prompt: Callable[..., Any], buckets: tuple[int, ...]) -> Callable[..., Any]:
    """Wrap a Qwen-Image pipeline's bound ``encode_prompt`` so its results are padded to ``buckets``."""
    warned = set()

    def padded_encode_prompt(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds, mask = encode_prompt(*args, **kwargs)
        if embeds.shape[1] > buckets[-1] and embeds.shape[1] not in warned:
            warned.add(embeds.shape[1])
            logger.warning(
                "prompt of %d tokens is longer than the largest text bucket (%d): not padded, its own signature",
                embeds.shape[1],
                buckets[-1],
            )
        return pad_to_bucket(embeds, mask, buckets)

    padded_encode_prompt.__wrapped__ = encode_prompt  # type: ignore[attr-defined]
    padded_encode_prompt.__doc__ = encode_prompt.__doc__
    return padded_encode_prompt


class TextBuckets(Feature):
    name = "text buckets"
    component = None

    @classmethod
    def create(cls, setup: Setup) -> TextBuckets | None:
        return cls() if setup.config.text_buckets is not None else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        try:
            setup.adapter.install_text_buckets(setup.pipe, setup.config.text_buckets, patches)
        except ValueError as exc:
            warnings.warn(f"bcg-diffusion: text_buckets ignored: {exc}", BCGWarning, stacklevel=4)
