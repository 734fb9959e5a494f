"""Pipeline calls shared by the CPU (debug mode) and GPU (graphs) equality tests."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch

from bcg_diffusion.models import build_pipeline

SHORT = "a red fox in the snow"
LONG = (
    "a detailed oil painting of an old lighthouse on a rocky coast at sunset, waves crashing against the rocks, "
    "seagulls flying over the water, warm orange light and long shadows, dramatic clouds in the sky"
)

# name -> pipeline keyword arguments (prompt lists are rebuilt per call: Z-Image edits them in place)
QWEN_CASES: dict[str, dict[str, Any]] = {
    "no_cfg": {"prompt": SHORT, "true_cfg_scale": 1.0},
    "true_cfg": {"prompt": SHORT, "negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0},
    "mask_two_lengths": {"prompt": [SHORT, LONG], "negative_prompt": [" ", "ugly"], "true_cfg_scale": 4.0},
}
ZIMAGE_CASES: dict[str, dict[str, Any]] = {
    "no_cfg": {"prompt": SHORT, "guidance_scale": 0.0},
    "cfg": {"prompt": SHORT, "negative_prompt": "blurry", "guidance_scale": 4.0},
    "cfg_truncation": {"prompt": SHORT, "guidance_scale": 4.0, "cfg_truncation": 0.5},
    "two_lengths": {"prompt": [SHORT, LONG], "guidance_scale": 0.0},
}
CASES = {"qwen-image": QWEN_CASES, "z-image": ZIMAGE_CASES}


def run_case(
    pipe: Any,
    pipeline: str,
    case: str,
    *,
    height: int,
    width: int,
    steps: int = 2,
    output_type: str = "pt",
    seed: int = 0,
) -> torch.Tensor:
    """One pipeline call; returns the image (``output_type="pt"``) or latents as a CPU tensor."""
    kwargs = {k: (list(v) if isinstance(v, list) else v) for k, v in CASES[pipeline][case].items()}
    out = pipe(
        **kwargs,
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=output_type,
    )
    images = out.images
    return images.detach().cpu() if isinstance(images, torch.Tensor) else torch.stack([i.cpu() for i in images])


# A case per pipeline with CFG (Qwen-Image's true CFG, Z-Image's batched CFG), for the quantization tests.
CFG_CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}


def tiny_pipeline(name: str) -> Any:
    """``name``'s tiny CPU pipeline, progress bar off."""
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_cfg_case(pipe: Any, name: str) -> torch.Tensor:
    """``CFG_CASE[name]`` at 32x32, two steps."""
    return run_case(pipe, name, CFG_CASE[name], height=32, width=32, steps=2)


# GPU tests: which weights to build (``BCG_TEST_WEIGHTS``, comma-separated; ``random-full`` builds the
# real architectures with random weights and needs ~60 GB of GPU memory for Qwen-Image).
GPU_WEIGHTS = [w.strip() for w in os.environ.get("BCG_TEST_WEIGHTS", "tiny").split(",") if w.strip()]


@contextlib.contextmanager
def cuda_pipeline(name: str, weights: str) -> Iterator[Any]:
    """A bf16 pipeline on the GPU, freed (and dynamo's compiled code dropped) afterwards."""
    pipe = build_pipeline(name, weights, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    try:
        yield pipe
    finally:
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()


def flux2_klein_kv_case() -> tuple[Any, dict[str, Any]]:
    """A tiny random ``Flux2KleinKVPipeline`` on the CPU and a call's arguments: a reference image, so the
    first step extracts the reference tokens' K/V into a ``Flux2KVCache`` that the transformer returns, and
    the later steps pass that cache object back to it."""
    import numpy as np
    from diffusers import Flux2KleinKVPipeline
    from PIL import Image

    from bench.coverage_models import TINY

    torch.manual_seed(0)
    klein, _ = TINY["FLUX.2 klein"]()  # the tiny klein's transformer, VAE and scheduler
    components = {name: getattr(klein, name) for name in ("scheduler", "vae", "transformer")}
    pipe = Flux2KleinKVPipeline(**components, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    return pipe, {"image": image, "prompt_embeds": torch.randn(1, 8, 32), "height": 32, "width": 32}


def zimage_block_call(
    block: Any, generator: torch.Generator, mask: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One tiny Z-Image block called on random inputs drawn from ``generator`` (in ``dtype``): 2 rows of 24
    tokens, RoPE frequencies, and with ``mask`` the second row's last 7 tokens masked."""
    tokens, dim = 24, block.dim
    x = torch.randn(2, tokens, dim, generator=generator).to(dtype)
    angles = torch.rand(2, tokens, block.head_dim // 2, generator=generator) * 6.28
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    attn_mask = torch.arange(tokens)[None] < torch.tensor([[tokens], [17]]) if mask else None
    adaln = torch.randn(2, block.adaLN_modulation[0].in_features, generator=generator).to(dtype)
    return block(x, attn_mask, freqs_cis, adaln)


def qwen_attention_on_gpu() -> tuple[Any, torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """One attention module of Qwen-Image's shape (3072 wide, 24 heads of 128) in bf16 on the GPU, its norms'
    weights spread around 1, and a CFG batch of two prompts (1,024 image tokens, 77 text tokens of which
    50 and 77 valid) with RoPE tables: ``(attn, hidden, text, args)``, ``args`` the arguments of
    ``qwen_joint_attention_per_group`` (``hidden`` and ``text`` among them, to change in place)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    attn = QwenImageTransformerBlock(3072, 24, 128).attn.to("cuda", torch.bfloat16).eval()
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        norm.weight.data.normal_(1.0, 0.5)
    hidden = torch.randn(2, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, 77, 3072, device="cuda", dtype=torch.bfloat16)
    angles = (torch.rand(1024, 64, device="cuda") * 6.28, torch.rand(77, 64, device="cuda") * 6.28)
    rope = tuple(torch.polar(torch.ones_like(a), a) for a in angles)
    return attn, hidden, text, (attn.processor, attn, hidden, text, rope, (50, 77))
