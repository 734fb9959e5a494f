"""Z-Image (``ZImagePipeline`` and relatives).

The transformer takes and returns *lists* of tensors (one per batch item, the outputs views into one
buffer). Captions are padded by the model to a multiple of 32 with a learned pad token, and the
image RoPE positions start after that padded length, so we never pad further: the multiple of 32 is
the caption's bucket. The pad mask is the only thing that depends on the exact token length; it is
built before the call and passed in as a tensor (:mod:`bcg_diffusion.patches.zimage`), so one graph
serves every caption of a bucket, byte-identical to eager. CFG runs cond and uncond as one call of
batch 2B; ``cfg_truncation`` drops to batch B mid-run, a second signature. The forward is capturable
as one graph (no host syncs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.hooks import MethodPatches
from ..patches.attention import ZIMAGE_ATTENTION_PATCH, ZIMAGE_ROPE_PATCH
from ..patches.followed import changed, installable
from ..patches.zimage import (
    CAPTION_MULTIPLE,
    bucket_captions,
    caption_bucket,
    patchify_with_caption_masks,
    with_caption_masks,
)
from .base import PipelineAdapter, WarmupRequest

MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's default: every prompt is padded to this many tokens
CAPTION_BUCKETS = "zimage caption buckets"  # the patch's name in bcg_diffusion.patches.followed


class ZImageAdapter(PipelineAdapter):
    name = "z-image"
    class_prefixes = ("ZImage",)
    tested_classes = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")
    guidance_values = (0.0, 4.0)  # CFG when guidance_scale > 0
    fast_patches = (ZIMAGE_ATTENTION_PATCH, ZIMAGE_ROPE_PATCH)  # exactly one applies (see patches.attention)
    # The Qwen3 text encoder too: captured, it is byte-equal to eager (H200) and encodes in 17 ms
    # (11 ms trimmed, fast mode) instead of 40-60 ms (runs 12, 29 and 37). Not a ControlNet: Z-Image's shares the
    # transformer's embedders and refiner blocks (``ZImageControlNetModel.from_transformer``) and patchifies
    # captions without our caption buckets; untested as graphs, it stays eager unless named.
    default_components = ("transformer", "vae", "text_encoder")
    text_trim_multiple = 64  # the pipeline pads every prompt to 512 tokens for its causal Qwen3 encoder

    # Caption buckets pass the pad masks through diffusers' patchify: only where that is the code they were
    # written for (bcg_diffusion.patches.followed); otherwise one signature per caption length, with a warning.
    def install_module(self, component: str, module: torch.nn.Module, patches: MethodPatches) -> None:
        if (
            component == "transformer"
            and callable(getattr(module, "patchify_and_embed", None))
            and installable(CAPTION_BUCKETS, stacklevel=5)
        ):
            patches.replace(module, "patchify_and_embed", patchify_with_caption_masks(module.patchify_and_embed))

    def runner_callable(self, component: str, method: Callable[..., Any]) -> Callable[..., Any]:
        if component == "transformer":
            return method if changed(CAPTION_BUCKETS) else with_caption_masks(method)
        return super().runner_callable(component, method)

    def prepare_call(self, component: str) -> Callable[[tuple, dict], tuple[tuple, dict]] | None:
        return bucket_captions if component == "transformer" and not changed(CAPTION_BUCKETS) else None

    def install_text_buckets(self, pipe: Any, buckets: tuple[int, ...], patches: MethodPatches) -> None:
        raise ValueError(
            f"Z-Image buckets captions itself, exactly, to multiples of {CAPTION_MULTIPLE} tokens (padding "
            "further would change the image); text_buckets is for Qwen-Image"
        )

    def warmup_calls(self, pipe: Any, request: WarmupRequest) -> list[dict[str, Any]]:
        """The prompts' calls (they also capture the text encoder, when it is accelerated), then one call
        per caption bucket up to ``call_kwargs["max_sequence_length"]`` tokens (default 512) with zero
        embeddings of exactly that length, so that afterwards any prompt replays. With CFG the negative
        prompt is ``call_kwargs["negative_prompt"]`` (default ``" "``), encoded once: its bucket is part
        of every CFG signature, so a service with several negative prompts warms up with each."""
        calls = super().warmup_calls(pipe, request)
        call_kwargs = request.call_kwargs
        max_sequence_length = call_kwargs.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        transformer = pipe.transformer
        negative = None
        if request.cfg:
            with torch.no_grad():  # as inside the pipeline's call: embeddings that require grad key apart
                negative, _ = pipe.encode_prompt(
                    call_kwargs.get("negative_prompt") or " ",
                    device=transformer.device,
                    do_classifier_free_guidance=False,
                    max_sequence_length=max_sequence_length,
                )
        width_of_caption = transformer.config.cap_feat_dim
        for length in range(CAPTION_MULTIPLE, caption_bucket(max_sequence_length) + 1, CAPTION_MULTIPLE):
            kwargs, dtype = self.embeddings_call(pipe, request)
            kwargs["prompt_embeds"] = [torch.zeros(length, width_of_caption, dtype=dtype, device=transformer.device)]
            if request.cfg:
                kwargs["negative_prompt_embeds"] = negative
            calls.append(kwargs)
        return calls

    def text_encoder_warmup_calls(
        self, pipe: Any, call_kwargs: Mapping[str, Any], multiple: int
    ) -> list[dict[str, Any]]:
        """The encoder as the pipeline calls it, once per trim bucket up to ``max_sequence_length``, each
        with one padding token. A prompt whose tokens fill its bucket exactly takes transformers'
        "every token valid" path, a signature of its own, left to lazy capture."""
        full = int(call_kwargs.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
        device = pipe.text_encoder.device
        input_ids = torch.zeros(1, full, dtype=torch.long, device=device)
        positions = torch.arange(full, device=device)[None]
        return [
            {"input_ids": input_ids, "attention_mask": positions < min(bucket, full) - 1, "output_hidden_states": True}
            for bucket in range(multiple, full + multiple, multiple)
        ]
