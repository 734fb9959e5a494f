"""Build the pipelines this package is tested and benchmarked on: real checkpoints or random weights.

``build_pipeline("qwen-image")`` gives a tiny random-weight ``QwenImagePipeline`` that runs a full call on a CPU in
about a second; ``build_pipeline("qwen-image", "random-full", device="cuda")`` gives one with the real architecture
(20.4B-parameter transformer, Qwen2.5-VL-7B text encoder, real VAE and scheduler configs) and random weights,
built directly on the GPU; any other ``weights`` is loaded with ``from_pretrained``. Random pipelines need no
download: their tokenizer is built in code too (see ``_offline_tokenizer``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from torch import nn
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3Model,
)

from .tokenizer import build_offline_tokenizer

__all__ = ["DEFAULT_PROMPTS", "PIPELINE_NAMES", "RANDOM_WEIGHTS", "build_pipeline"]

logger = logging.getLogger(__name__)

PIPELINE_NAMES: tuple[str, ...] = ("qwen-image", "z-image")
RANDOM_WEIGHTS: tuple[str, ...] = ("tiny", "random-full")

DEFAULT_PROMPTS: tuple[str, ...] = (
    "A red fox in snow",
    "A lighthouse on a stormy coast at dusk, cinematic lighting",
    "A cozy reading nook with a large window, soft morning light, stacks of old books and a sleeping orange cat.",
    "A bustling night market in an old harbor town, strings of warm paper lanterns hanging above narrow stalls "
    "that sell grilled fish, fresh fruit and handmade pottery. In the foreground an elderly woman in a blue coat "
    "counts coins while a small boy holds a wooden toy boat. Wet cobblestones reflect the golden light, fishing boats "
    "rest on the dark water behind them, and thin clouds drift across a full moon.",
    "Small brass telescope",
    "A highly detailed technical illustration of a vintage mechanical pocket watch opened to reveal its inner "
    "workings: brass gears of many sizes, tiny steel screws, a coiled hairspring and jeweled bearings, all arranged "
    "on a dark velvet cloth. Soft studio lighting from the upper left creates gentle shadows, a magnifying glass "
    'rests beside the watch, and a small handwritten label reads "1892" in neat black ink. A sign above it says '
    '"Open every day".',
)

# scheduler/scheduler_config.json of Qwen/Qwen-Image. Its shift_terminal makes num_inference_steps=1 give NaN
# sigmas (0/0 in diffusers' stretch_shift_to_terminal): Qwen-Image calls need 2 steps or more.
_QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# scheduler/scheduler_config.json of Tongyi-MAI/Z-Image-Turbo.
_Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

_TINY_VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class _RandomRecipe:
    """How to construct one random-weight pipeline; each model factory is called with parameters on meta."""

    pipeline_class: type[diffusers.DiffusionPipeline]
    transformer: Callable[[], nn.Module]
    vae: Callable[[], nn.Module]
    text_encoder: Callable[[], nn.Module]
    scheduler: dict[str, Any]


def build_pipeline(
    pipeline: str,
    weights: str = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    num_layers: int | None = None,
) -> diffusers.DiffusionPipeline:
    """Build a ``QwenImagePipeline`` ("qwen-image") or ``ZImagePipeline`` ("z-image").

    Args:
        pipeline: one of ``PIPELINE_NAMES``.
        weights: ``"tiny"``: small random-weight models of the real classes (a 2-step 64x64 call takes about
            0.1 s on a CPU). ``"random-full"``: the real architectures and configs with random weights. Both use
            the offline tokenizer and the real scheduler config. Anything else: a hub id or local pipeline
            directory, loaded with ``from_pretrained(weights, torch_dtype=dtype)`` and moved to ``device``.
        device: where every model's parameters and buffers go. Random weights are created there directly, in
            ``dtype``: no full-precision copy is ever made on the CPU. ``"meta"`` gives uninitialised parameters,
            for inspecting sizes. Plain tensor attributes (e.g. the RoPE tables of ``QwenEmbedRope``) stay on
            the CPU as built, exactly as after ``from_pretrained(...).to(device)``.
        dtype: parameter dtype; default float32 for ``"tiny"``, bfloat16 otherwise.
        seed: random weights are a pure function of ``(seed, parameter name, device type, dtype)``: weights of
            layers kept by ``num_layers`` equal those of the full-depth build.
        num_layers: random weights only: override the depth of the transformer, the text encoder and the vision
            tower (and cap Z-Image's refiners at it), keeping every width, for cheap checks at real widths.

    Returns:
        The pipeline, its models in eval mode. Random weights are normal with mean 0 and variance 1/fan_in, with
        zero biases and unit norm scales: activations stay finite and of order one through the whole pipeline
        (text encoder, every transformer block, VAE decoder) in bfloat16.

    Raises:
        ValueError: unknown ``pipeline``, a non-floating ``dtype``, or a bad or misplaced ``num_layers``.
        FileNotFoundError: ``weights`` looks like a local path that does not exist.
    """
    if pipeline not in PIPELINE_NAMES:
        raise ValueError(f"unknown pipeline {pipeline!r}: expected one of {', '.join(PIPELINE_NAMES)}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if num_layers is not None and (weights not in RANDOM_WEIGHTS or num_layers < 1):
        raise ValueError(f"num_layers must be a positive int and needs random weights, got {num_layers!r}")
    device = torch.device(device)
    if weights not in RANDOM_WEIGHTS:
        return _load_pretrained(pipeline, weights, device, dtype or torch.bfloat16)

    full = weights == "random-full"
    dtype = dtype or (torch.bfloat16 if full else torch.float32)
    start = time.perf_counter()
    tokenizer = build_offline_tokenizer()
    recipe = (_qwen_image_recipe if pipeline == "qwen-image" else _z_image_recipe)(full, tokenizer, num_layers)
    models = {}
    for name in ("transformer", "vae", "text_encoder"):
        # accelerate's init_empty_weights puts every parameter on the meta device as it is registered (not
        # thread-safe: it patches nn.Module.register_parameter for the duration); buffers and plain tensor
        # attributes (RoPE tables) are computed on the CPU exactly as in a normal construction.
        with init_empty_weights(include_buffers=False):
            model = getattr(recipe, name)()
        _materialise(model, name, device, dtype, seed)
        models[name] = model.eval()
    pipe = recipe.pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**recipe.scheduler), tokenizer=tokenizer, **models
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the initialisation kernels are queued: time them too
    logger.info(
        "built %s (%s weights) on %s in %s: %s parameters in %.1f s",
        pipeline,
        weights,
        device,
        dtype,
        _count(sum(p.numel() for m in models.values() for p in m.parameters())),
        time.perf_counter() - start,
    )
    return pipe


def _count(number: int) -> str:
    """``number`` in the largest unit it reaches, for a log line: ``"20.43B"``, ``"1.2M"``, ``"850.3K"``, ``"12"``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.2f}{unit}" if unit == "B" else f"{number / size:.1f}{unit}"
    return str(number)


def _qwen_image_recipe(full: bool, tokenizer: PreTrainedTokenizerBase, num_layers: int | None) -> _RandomRecipe:
    if full:
        depth = num_layers or 60
        transformer = partial(
            QwenImageTransformer2DModel,
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=depth,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            guidance_embeds=False,
            axes_dims_rope=(16, 56, 56),
        )
        # Qwen/Qwen-Image vae/config.json; the class defaults of latents_mean/latents_std are its values.
        vae = partial(
            AutoencoderKLQwenImage,
            base_dim=96,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=2,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            dropout=0.0,
        )
        vision_depth = min(num_layers or 32, 32)
        # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct).
        config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": 152064,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": num_layers or 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "hidden_act": "silu",
                "max_position_embeddings": 128000,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
                "use_sliding_window": False,
                "sliding_window": 32768,
                "max_window_layers": 28,
                "attention_dropout": 0.0,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
            vision_config={
                "depth": vision_depth,
                "hidden_act": "silu",
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "in_chans": 3,
                "out_hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [i for i in (7, 15, 23, 31) if i < vision_depth],
                "tokens_per_second": 2,
            },
            vocab_size=152064,
            image_token_id=151655,
            video_token_id=151656,
            vision_start_token_id=151652,
            vision_end_token_id=151653,
            vision_token_id=151654,
            tie_word_embeddings=False,
        )
    else:
        hidden = 32
        transformer = partial(
            QwenImageTransformer2DModel,
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=num_layers or 2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=hidden,
            guidance_embeds=False,
            axes_dims_rope=(4, 6, 6),
        )
        # Same depth of down-sampling as the real VAE (8x), so latent shapes follow the real ones.
        vae = partial(
            AutoencoderKLQwenImage,
            base_dim=16,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 2.0, 1.0, 2.5],
        )
        config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": _tiny_vocab_size(tokenizer),
                "hidden_size": hidden,
                "intermediate_size": 64,
                "num_hidden_layers": num_layers or 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "rope_theta": 1000000.0,
                "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
                "bos_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": hidden,
                "fullatt_block_indexes": [0],
            },
            vocab_size=_tiny_vocab_size(tokenizer),
        )
    return _RandomRecipe(
        pipeline_class=QwenImagePipeline,
        transformer=transformer,
        vae=vae,
        text_encoder=partial(Qwen2_5_VLForConditionalGeneration, config),
        scheduler=_QWEN_IMAGE_SCHEDULER,
    )


def _z_image_recipe(full: bool, tokenizer: PreTrainedTokenizerBase, num_layers: int | None) -> _RandomRecipe:
    if full:
        # Tongyi-MAI/Z-Image-Turbo transformer/config.json.
        transformer = partial(
            ZImageTransformer2DModel,
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=3840,
            n_layers=num_layers or 30,
            n_refiner_layers=min(num_layers or 2, 2),
            n_heads=30,
            n_kv_heads=30,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=2560,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[32, 48, 48],
            axes_lens=[1536, 512, 512],
        )
        # Tongyi-MAI/Z-Image-Turbo vae/config.json (the FLUX.1 autoencoder).
        vae = partial(
            AutoencoderKL,
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            act_fn="silu",
            latent_channels=16,
            norm_num_groups=32,
            sample_size=1024,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            force_upcast=True,
            use_quant_conv=False,
            use_post_quant_conv=False,
            mid_block_add_attention=True,
        )
        # Tongyi-MAI/Z-Image-Turbo text_encoder/config.json (Qwen3-4B), loaded there as a Qwen3Model.
        config = qwen3_4b_config(num_layers)
    else:
        hidden = 32
        transformer = partial(
            ZImageTransformer2DModel,
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=32,
            n_layers=num_layers or 2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=hidden,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[8, 4, 4],
            axes_lens=[1024, 128, 128],
        )
        # Four blocks: the real 8x down-sampling.
        vae = partial(
            AutoencoderKL,
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=64,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        config = Qwen3Config(
            vocab_size=_tiny_vocab_size(tokenizer),
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=num_layers or 2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return _RandomRecipe(
        pipeline_class=ZImagePipeline,
        transformer=transformer,
        vae=vae,
        text_encoder=partial(Qwen3Model, config),
        scheduler=_Z_IMAGE_SCHEDULER,
    )


def qwen3_4b_config(num_layers: int | None = None) -> Qwen3Config:
    """Qwen3-4B's config (``num_layers`` overrides its 36 layers): Z-Image's text encoder, FLUX.2 klein 4B's too."""
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=num_layers or 36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _tiny_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    return -(-len(tokenizer) // _TINY_VOCAB_MULTIPLE) * _TINY_VOCAB_MULTIPLE


def _materialise(model: nn.Module, prefix: str, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """Replace ``model``'s meta parameters by initialised ones on ``device`` in ``dtype``; move its buffers there.

    Shared parameters stay shared. On a CPU the initialisation runs on a thread per core (each parameter has its
    own generator, so threads do not change the result); on a GPU the kernels are queued in order.
    """
    fresh: dict[int, nn.Parameter] = {}
    jobs: list[tuple[torch.Tensor, str, str, bool]] = []
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:
                data = torch.empty(param.shape, dtype=dtype, device=device)
                fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
                full_name = f"{prefix}.{module_name}.{name}" if module_name else f"{prefix}.{name}"
                jobs.append((data, full_name, name, _is_norm(module)))
            module._parameters[name] = fresh[id(param)]
    model.to(device)
    if device.type == "meta":
        return

    def initialise(job: tuple[torch.Tensor, str, str, bool]) -> None:
        tensor, full_name, name, in_norm = job
        if in_norm:
            tensor.fill_(0.0 if name == "bias" else 1.0)
        elif name == "bias" or tensor.ndim < 2:
            tensor.zero_()
        else:
            generator = torch.Generator(device=device).manual_seed(_parameter_seed(seed, full_name))
            tensor.normal_(0.0, tensor[0].numel() ** -0.5, generator=generator)

    if device.type == "cpu":
        with ThreadPoolExecutor(max_workers=max(torch.get_num_threads(), 1)) as pool:
            list(pool.map(initialise, jobs))
    else:
        for job in jobs:
            initialise(job)


def _is_norm(module: nn.Module) -> bool:
    """Normalisation layers (their weights are scales: 1 at init), by type or by the ``*Norm*`` naming convention."""
    norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, norms) or "norm" in type(module).__name__.lower()


def _parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _load_pretrained(
    pipeline: str, weights: str, device: torch.device, dtype: torch.dtype
) -> diffusers.DiffusionPipeline:
    pipeline_class = QwenImagePipeline if pipeline == "qwen-image" else ZImagePipeline
    path = os.path.expanduser(weights)
    # A hub id is "name" or "owner/name"; anything else that is not a directory is a mistyped local path.
    looks_like_path = weights.startswith(("/", ".", "~")) or "\\" in weights or weights.count("/") > 1
    if not os.path.isdir(path) and looks_like_path:
        raise FileNotFoundError(
            f"weights {weights!r} is not a directory: expected {' or '.join(map(repr, RANDOM_WEIGHTS))}, a hub id "
            "such as 'Qwen/Qwen-Image', or a local pipeline directory"
        )
    start = time.perf_counter()
    pipe = pipeline_class.from_pretrained(path if os.path.isdir(path) else weights, torch_dtype=dtype)
    pipe = pipe.to(device)
    logger.info("loaded %s from %s on %s in %.1f s", pipeline, weights, device, time.perf_counter() - start)
    return pipe
