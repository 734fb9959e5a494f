"""Z-Image (``ZImagePipeline`` and relatives).

The transformer takes and returns *lists* of tensors (one per batch item, the outputs views into one
buffer), so signatures include each item's caption length: captions are padded only to their own
multiple of 32 with a learned pad token, and the image RoPE positions depend on that padded length,
so we never pad further. CFG runs cond and uncond as one call of batch 2B; ``cfg_truncation`` drops
to batch B mid-run, a second signature. The forward is capturable as one graph (no host syncs).
"""

from __future__ import annotations

from .base import PipelineAdapter


class ZImageAdapter(PipelineAdapter):
    name = "z-image"
    class_prefixes = ("ZImage",)
    tested_classes = ("ZImagePipeline",)
    guidance_values = (0.0, 4.0)  # CFG when guidance_scale > 0
