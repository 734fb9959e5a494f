"""Qwen-Image (``QwenImagePipeline`` and its img2img / inpaint / edit relatives).

Per denoising step the pipeline calls the transformer once, or twice with true CFG (cond and
uncond, each with its own text length, so two signatures; fast mode batches the two, the first step
too, from the prompts ``encode_prompt`` returned, see :mod:`bcg_diffusion.features.cfg_batching`). When prompts in a batch differ in length
it passes a text mask: the masked path's only host copy (``compute_text_seq_len_from_mask``) is
patched to a device-side fill. RoPE tables are built and cached during warm-up, before capture. In
fast mode the blocks apply RoPE in real arithmetic (inductor does not compile complex multiplication),
and a CFG batch of two prompts of different lengths attends per prompt, without a text mask
(:mod:`bcg_diffusion.patches.attention`).
Edit Plus 2511 builds a tensor from a Python list inside the forward (``zero_cond_t``); the capture
holds it as a graph constant (:mod:`bcg_diffusion.core.python_data`). The Edit variants are not in
``tested_classes`` (an INFO line says so; their text encoder sees the input image, so fast mode's text
trimming does not apply) but are measured in ``docs/coverage.md``, and fast mode batches their CFG calls:
the input image's latents ride in the latents both calls share.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..features.cfg_batching import CfgBatchSpec
from ..features.text_buckets import text_buckets_wrapper
from ..patches.attention import QWEN_ATTENTION_PATCH
from ..patches.qwenimage import TEXT_SEQ_LEN_PATCH
from ..patches.rope import QWEN_REAL_ROPE_PATCH
from .base import PipelineAdapter, WarmupRequest


class QwenImageAdapter(PipelineAdapter):
    name = "qwen-image"
    class_prefixes = ("QwenImage",)
    tested_classes = ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
    # Not the text encoder: Qwen2.5-VL encodes each prompt at its own length (one capture per length), and the
    # Edit variants' encoder reads the input image too. A ControlNet, as every adapter's (QwenImageControlNetPipeline).
    default_components = ("transformer", "controlnet", "vae")
    patches = (TEXT_SEQ_LEN_PATCH,)
    guidance_argument = "true_cfg_scale"  # true CFG: a second transformer call per step when > 1
    fast_patches = (QWEN_REAL_ROPE_PATCH, QWEN_ATTENTION_PATCH)
    cfg_batch_classes = (*tested_classes, "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    cfg_batch = CfgBatchSpec(
        latents="hidden_states",
        text="encoder_hidden_states",
        text_mask="encoder_hidden_states_mask",
        values=("timestep", "guidance"),
        lists=("img_shapes",),
        absent=("controlnet_block_samples", "additional_t_cond"),
        attention_kwargs="attention_kwargs",
        encoder="encode_prompt",
    )

    def install_text_buckets(self, pipe: Any, buckets: tuple[int, ...], patches: MethodPatches) -> None:
        patches.replace(pipe, "encode_prompt", text_buckets_wrapper(pipe.encode_prompt, buckets))

    def warmup_calls(self, pipe: Any, request: WarmupRequest) -> list[dict[str, Any]]:
        """With buckets, one call per bucket with zero embeddings of exactly that length (the negative
        prompt too, with CFG). Cond and uncond then share the transformer signature of their bucket,
        so CFG adds nothing to capture; its calls cost replays only."""
        if request.text_buckets is None:
            return super().warmup_calls(pipe, request)
        transformer = pipe.transformer
        calls = []
        for length in request.text_buckets:
            kwargs, dtype = self.embeddings_call(pipe, request)
            shape, device = (1, length, transformer.config.joint_attention_dim), transformer.device
            kwargs["prompt_embeds"] = torch.zeros(shape, dtype=dtype, device=device)
            kwargs["prompt_embeds_mask"] = torch.ones(1, length, dtype=torch.long, device=device)
            if request.cfg:
                kwargs["negative_prompt_embeds"] = torch.zeros(shape, dtype=dtype, device=device)
                kwargs["negative_prompt_embeds_mask"] = torch.ones(1, length, dtype=torch.long, device=device)
            calls.append(kwargs)
        return calls
