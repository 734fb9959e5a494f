"""``text_buckets``: Qwen-Image's prompt embeddings padded to a few token lengths, one graph per bucket.

The padding is :mod:`bcg_diffusion.buckets`; the adapter installs it on the pipeline's
``encode_prompt`` (a feature of each pipeline, not of a shared module). Adapters that bucket exactly by
themselves (Z-Image) refuse it, with a warning.
"""

from __future__ import annotations

import warnings

from ..hooks import MethodPatches
from ..runner import BCGWarning
from .base import Feature, Setup

__all__ = ["TextBuckets"]


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
