"""Qwen-Image (``QwenImagePipeline`` and its img2img / inpaint / edit relatives).

Per denoising step the pipeline calls the transformer once, or twice with true CFG (cond and
uncond, each with its own text length, so two signatures). When prompts in a batch differ in length
it passes a text mask: the masked path's only host copy (``compute_text_seq_len_from_mask``) is
patched to a device-side fill. RoPE tables are built and cached during warm-up, before capture. In fast mode the blocks apply RoPE
in real arithmetic (inductor does not compile complex multiplication).
The Edit variants build a tensor from a Python list inside the forward (``zero_cond_t``); their
capture fails and they run eagerly with a warning.
"""

from __future__ import annotations

from ..patches.qwenimage import TEXT_SEQ_LEN_PATCH
from ..patches.rope import QWEN_REAL_ROPE_PATCH
from .base import PipelineAdapter


class QwenImageAdapter(PipelineAdapter):
    name = "qwen-image"
    class_prefixes = ("QwenImage",)
    tested_classes = ("QwenImagePipeline",)
    patches = (TEXT_SEQ_LEN_PATCH,)
    fast_patches = (QWEN_REAL_ROPE_PATCH,)
