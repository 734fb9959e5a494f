"""The pipelines of the coverage check (:mod:`bench.coverage`): diffusers transformer pipelines beyond the two
we tune, built from the installed diffusers' own classes with random weights.

Each builder supplies its call's prompt embeddings directly (no text encoder or tokenizer is needed, so
nothing is downloaded). ``TINY`` builds a tiny pipeline and its call's arguments for the CPU; ``FULL``
the same pipelines at their published sizes (each config written from its checkpoint's config.json,
random bfloat16 weights made on the device), with the arguments of a call at a :class:`Size`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from accelerate import init_empty_weights
from torch import nn

from bcg_diffusion.models.builders import _QWEN_IMAGE_SCHEDULER, _materialise

__all__ = ["FULL", "IMAGE_SIZES", "TINY", "VIDEO_SIZES", "Published", "Size"]


def _kl_vae(latent_channels: int, **extra: Any) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 16],
        latent_channels=latent_channels,
        norm_num_groups=4,
        layers_per_block=1,
        **extra,
    )


def _flux() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    )  # fmt: skip
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_kl_vae(4, shift_factor=0.1, scaling_factor=0.5),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )  # fmt: skip
    return pipe, {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 32)}


def _chroma() -> tuple[Any, dict[str, Any]]:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    transformer = ChromaTransformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
        approximator_layers=1,
    )  # fmt: skip
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_kl_vae(4, shift_factor=0.1, scaling_factor=0.5),
        text_encoder=None, tokenizer=None, transformer=transformer,
    )  # fmt: skip
    mask = torch.ones(1, 8, dtype=torch.bool)
    return pipe, {"prompt_embeds": torch.randn(1, 8, 32), "prompt_attention_mask": mask, "guidance_scale": 1.0}


def _sd3() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=16, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=32,
    )  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_kl_vae(4, shift_factor=0.1, scaling_factor=0.5),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None, transformer=transformer,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 32)}
    embeds |= {"negative_prompt_embeds": torch.randn(1, 8, 32), "negative_pooled_prompt_embeds": torch.randn(1, 32)}
    return pipe, embeds


def _lumina2() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    transformer = Lumina2Transformer2DModel(
        sample_size=16, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1, num_attention_heads=2,
        num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(64, 32, 32), cap_feat_dim=32,
    )  # fmt: skip
    pipe = Lumina2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_kl_vae(4, shift_factor=0.1, scaling_factor=0.5),
        text_encoder=None, tokenizer=None, transformer=transformer,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "prompt_attention_mask": torch.ones(1, 8, dtype=torch.bool)}
    embeds |= {"negative_prompt_embeds": torch.randn(1, 8, 32)}
    embeds |= {"negative_prompt_attention_mask": torch.ones(1, 8, dtype=torch.bool)}
    return pipe, embeds


def _wan() -> tuple[Any, dict[str, Any]]:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=32, freq_dim=16,
        ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )  # fmt: skip
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "negative_prompt_embeds": torch.randn(1, 8, 32)}
    return pipe, {**embeds, "num_frames": 5, "guidance_scale": 4.0}


def _cogvideox() -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=32, num_layers=1, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8,
    )  # fmt: skip
    vae = AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4,
    )  # fmt: skip
    pipe = CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler()
    )
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "negative_prompt_embeds": torch.randn(1, 8, 32)}
    return pipe, {**embeds, "num_frames": 5, "guidance_scale": 4.0, "max_sequence_length": 8}


def _image(width: int = 32, height: int | None = None) -> Any:
    """A deterministic random RGB image of ``width`` x ``height`` (square by default): the edit pipelines' input."""
    import numpy as np
    import PIL.Image

    pixels = np.random.default_rng(0).integers(0, 256, (height or width, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def _qwen_vae() -> Any:
    from diffusers import AutoencoderKLQwenImage

    # Base width 2: the edit pipelines encode their input at about 1024x1024 whatever its size (the VAE
    # encode, which stays eager, is most of a tiny call's time); four levels give the real 8x down-sampling.
    return AutoencoderKLQwenImage(
        base_dim=2, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0, attn_scales=[],
        temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip


def _qwen_edit(plus: bool) -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )

    # zero_cond_t as in Qwen-Image-Edit-2511 (Plus) and Qwen-Image-Edit (not): with it the forward builds
    # its modulation index from img_shapes, a Python list, on every call.
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), zero_cond_t=plus,
    )  # fmt: skip
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_qwen_vae(), text_encoder=None, tokenizer=None,
        processor=None, transformer=transformer,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "prompt_embeds_mask": torch.ones(1, 8, dtype=torch.long)}
    embeds |= {"negative_prompt_embeds": torch.randn(1, 6, 32)}
    embeds |= {"negative_prompt_embeds_mask": torch.ones(1, 6, dtype=torch.long)}
    return pipe, {**embeds, "image": _image(), "true_cfg_scale": 4.0}


def _flux_kontext() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6], guidance_embeds=True,
    )  # fmt: skip
    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_kl_vae(4, shift_factor=0.1, scaling_factor=0.5),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 32)}
    # Kontext scales the output to max_area and, with _auto_resize, its input to a ~1024x1024 preferred size.
    return pipe, {**embeds, "image": _image(), "max_area": 32 * 32, "_auto_resize": False}


def _flux_controlnet() -> tuple[Any, dict[str, Any]]:
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    base, inputs = _flux()
    controlnet = live_controlnet(FluxControlNetModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    ))  # fmt: skip
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # the conditioning image
    return FluxControlNetPipeline(**base.components, controlnet=controlnet), {**inputs, "control_image": control}


def live_controlnet(controlnet: nn.Module) -> nn.Module:
    """``controlnet`` with random values, in place, in every parameter that starts at zero (the blocks that write
    its outputs, its conditioning's embedding, zero biases): a new ControlNet adds nothing to the transformer, so
    without this no image would show a ControlNet's output or its conditioning scale."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in controlnet.parameters():
            if not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return controlnet


def _tiny_flux2_vae() -> Any:
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
    )  # fmt: skip


def _flux2() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
    )  # fmt: skip
    vae = _tiny_flux2_vae()
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        transformer=transformer,
    )  # fmt: skip
    # FLUX.2 refuses reference images under 64x64.
    return pipe, {"prompt_embeds": torch.randn(1, 8, 32), "image": _image(64), "guidance_scale": 4.0}


def _flux2_klein() -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    # Klein is step- and guidance-distilled: no guidance embedding, one transformer call per step.
    transformer = Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )  # fmt: skip
    vae = _tiny_flux2_vae()
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        transformer=transformer, is_distilled=True,
    )  # fmt: skip
    return pipe, {"prompt_embeds": torch.randn(1, 8, 32), "guidance_scale": 1.0}


def _wan22() -> tuple[Any, dict[str, Any]]:
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe, kwargs = _wan()
    torch.manual_seed(1)  # the low-noise expert's own random weights
    experts = {
        "transformer": pipe.transformer,
        "transformer_2": WanTransformer3DModel.from_config(pipe.transformer.config),
    }
    # The boundary at timestep 500 (0.5 of 1000 training steps) falls between the two steps (1000, then ~9):
    # the first runs the high-noise expert, the second the low-noise one, each with its own guidance.
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=pipe.vae, scheduler=pipe.scheduler, boundary_ratio=0.5, **experts
    )
    return pipe, {**kwargs, "guidance_scale_2": 3.0}


def _hunyuan_video() -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
        pooled_projection_dim=16, rope_axes_dim=(2, 2, 4),
    )  # fmt: skip
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
    )  # fmt: skip
    pipe = HunyuanVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None, tokenizer_2=None,
    )  # fmt: skip
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 16)}
    embeds |= {"prompt_attention_mask": torch.ones(1, 8, dtype=torch.long)}
    return pipe, {**embeds, "num_frames": 5}


def _ltx() -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=1, caption_channels=32,
    )  # fmt: skip
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=1,
    )  # fmt: skip
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        transformer=transformer,
    )  # fmt: skip
    mask = torch.ones(1, 8, dtype=torch.long)
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "prompt_attention_mask": mask}
    embeds |= {"negative_prompt_embeds": torch.randn(1, 8, 32), "negative_prompt_attention_mask": mask.clone()}
    return pipe, {**embeds, "num_frames": 9, "guidance_scale": 3.0}


def _sana() -> tuple[Any, dict[str, Any]]:
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
        sample_size=32,
    )  # fmt: skip
    vae = AutoencoderDC(
        latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)), scaling_factor=0.41407,
    )  # fmt: skip
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)
    mask = torch.ones(1, 8, dtype=torch.long)
    embeds = {"prompt_embeds": torch.randn(1, 8, 32), "prompt_attention_mask": mask}
    embeds |= {"negative_prompt_embeds": torch.randn(1, 8, 32), "negative_prompt_attention_mask": mask.clone()}
    # Resolution binning would map the size to the model's aspect-ratio table (1024x1024 for sample_size 32).
    return pipe, {**embeds, "negative_prompt": None, "use_resolution_binning": False}


def _hunyuan_image_embeds(
    make: Callable[..., torch.Tensor], device: torch.device, text: tuple[int, int], glyphs: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """HunyuanImage's four prompt tensors and their negatives: ``text`` and ``glyphs`` are (tokens, width) of its
    Qwen2.5-VL and ByT5 embeddings; ``make(*shape, seed=...)`` makes one on ``device``. The prompt has no quoted
    text, so its ByT5 rows are zeros with an empty mask, as ``encode_prompt`` gives them (and the pipeline does not
    choose its OCR guider)."""
    (tokens, width), (glyph_tokens, glyph_width) = text, glyphs
    valid, negative_valid = max(1, tokens // 12), max(1, tokens // 125)  # 83 and 8 of 1,000 tokens
    embeds = {"prompt_embeds": make(1, tokens, width), "negative_prompt_embeds": make(1, tokens, width, seed=1)}
    embeds |= {"prompt_embeds_mask": _mask(device, tokens, valid)}
    embeds |= {"negative_prompt_embeds_mask": _mask(device, tokens, negative_valid)}
    for prefix in ("", "negative_"):
        embeds[f"{prefix}prompt_embeds_2"] = make(1, glyph_tokens, glyph_width).zero_()
        embeds[f"{prefix}prompt_embeds_mask_2"] = _mask(device, glyph_tokens, 0)
    return embeds


def _hunyuan_image() -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )

    transformer = HunyuanImageTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=32, text_embed_2_dim=16, rope_axes_dim=(4, 4),
    )  # fmt: skip
    vae = AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
        spatial_compression_ratio=8, sample_size=32, scaling_factor=0.476986,
    )  # fmt: skip
    # The guider's adaptive projection from the second step on, so that two steps run both of its branches.
    pipe = HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer,
        guider=AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=1),
    )  # fmt: skip

    def make(*shape: int, seed: int = 0) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    return pipe, _hunyuan_image_embeds(make, torch.device("cpu"), text=(12, 32), glyphs=(4, 16))


TINY: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "FLUX.1": _flux,
    "Chroma": _chroma,
    "SD3.5": _sd3,
    "Lumina 2": _lumina2,
    "Wan 2.1 T2V": _wan,
    "CogVideoX": _cogvideox,
    "Qwen-Image Edit": partial(_qwen_edit, plus=False),
    "Qwen-Image Edit Plus": partial(_qwen_edit, plus=True),
    "FLUX.1 Kontext": _flux_kontext,
    "FLUX.1 ControlNet": _flux_controlnet,
    "FLUX.2": _flux2,
    "FLUX.2 klein": _flux2_klein,
    "Wan 2.2 T2V": _wan22,
    "HunyuanVideo": _hunyuan_video,
    "LTX-Video": _ltx,
    "Sana": _sana,
    "HunyuanImage": _hunyuan_image,
}


# Published sizes. Each config is the named checkpoint's config.json, written out from its published values;
# weights are random (bcg_diffusion.models's initialisation), made on the device in bfloat16.


class Size(NamedTuple):
    """One call size: ``frames`` is None for an image pipeline."""

    label: str
    width: int
    height: int
    frames: int | None = None


IMAGE_SIZES = (Size("launch-bound", 512, 512), Size("GPU-bound", 1024, 1024))
VIDEO_SIZES = (Size("launch-bound", 480, 272, 9), Size("GPU-bound", 832, 480, 33))


@dataclass(frozen=True)
class Published:
    """A pipeline at its published size: ``build(device)`` gives it with random bfloat16 weights made on
    ``device`` (``meta``: shapes only), ``inputs(device, size)`` its call arguments at ``size`` (random
    prompt embeddings of the real text encoders' widths and typical lengths, the size, any input image)."""

    checkpoint: str
    build: Callable[[torch.device], Any]
    inputs: Callable[[torch.device, Size], dict[str, Any]]
    sizes: tuple[Size, ...] = IMAGE_SIZES


def _random_model(factory: Callable[[], nn.Module], name: str, device: torch.device) -> nn.Module:
    """``factory()``'s model with random weights on ``device``, in the dtypes ``from_pretrained(...,
    torch_dtype=torch.bfloat16)`` gives a checkpoint's tensors, in eval mode.

    Parameters are made on ``device`` directly (never a full-precision copy on the CPU) and are a
    function of ``name`` and each parameter's name (:func:`bcg_diffusion.models.builders._materialise`), so two
    experts of one class get different weights. Buffers and plain tensor attributes (RoPE tables) are
    computed on the CPU as in a normal construction; on ``meta`` nothing is computed at all.
    """
    if device.type == "meta":
        with torch.device("meta"):
            model = factory()
    else:
        with init_empty_weights(include_buffers=False):
            model = factory()
        _materialise(model, name, device, torch.bfloat16, seed=0)
    _loaded_dtypes(model, torch.bfloat16)
    return model.eval()


def _loaded_dtypes(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s parameters and persistent floating buffers as ``from_pretrained`` casts a checkpoint's:
    to ``dtype``, except those whose dotted name has a part in the class's ``_keep_in_fp32_modules`` (Wan's
    time embedder and norms, for one), which stay float32. Non-persistent buffers are not in a checkpoint and
    keep the dtype they were built in."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for module_name, module in model.named_modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or not tensor.is_floating_point() or name in module._non_persistent_buffers_set:
                continue
            wanted = torch.float32 if keep & set(f"{module_name}.{name}".split(".")) else dtype
            if tensor.dtype == wanted:
                continue
            if name in module._parameters:
                tensor.data = tensor.data.to(wanted)
            else:
                module._buffers[name] = tensor.to(wanted)


def _randn(device: torch.device, *shape: int, seed: int = 0) -> torch.Tensor:
    """Standard-normal bfloat16 embeddings made on ``device``, a function of ``seed``."""
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device).manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=device)


def _mask(device: torch.device, length: int, valid: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A text mask of ``length`` tokens whose first ``valid`` are the prompt's and the rest padding."""
    mask = torch.zeros(1, length, dtype=dtype, device=device)
    mask[:, :valid] = 1
    return mask


def _size(size: Size) -> dict[str, Any]:
    return {"width": size.width, "height": size.height} | ({"num_frames": size.frames} if size.frames else {})


def _flux1_vae(device: torch.device) -> nn.Module:
    from diffusers import AutoencoderKL

    # black-forest-labs/FLUX.1-dev vae/config.json: the FLUX.1 autoencoder, Kontext, Chroma and Lumina 2 use it too.
    return _random_model(partial(
        AutoencoderKL, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
        force_upcast=True,
    ), "vae", device)  # fmt: skip


# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json (Kontext's is the same).
_FLUX1_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
}  # fmt: skip


def _flux1_transformer(device: torch.device) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    # black-forest-labs/FLUX.1-dev transformer/config.json (FLUX.1-Kontext-dev's is the same).
    return _random_model(partial(
        FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    ), "transformer", device)  # fmt: skip


def _full_flux(device: torch.device) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX1_SCHEDULER), vae=_flux1_vae(device), text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=_flux1_transformer(device),
    )  # fmt: skip


def _full_flux_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # T5-XXL at the pipeline's max_sequence_length (512) and CLIP-L's pooled output.
    embeds = {"prompt_embeds": _randn(device, 1, 512, 4096), "pooled_prompt_embeds": _randn(device, 1, 768, seed=1)}
    return embeds | _size(size) | {"guidance_scale": 3.5}


def _full_flux_kontext(device: torch.device) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    return FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX1_SCHEDULER), vae=_flux1_vae(device), text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=_flux1_transformer(device),
    )  # fmt: skip


def _full_flux_kontext_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # max_area keeps the output at the size; the input image is resized to Kontext's preferred ~1024x1024.
    extra = {"image": _image(size.width, size.height), "max_area": size.width * size.height, "guidance_scale": 2.5}
    return _full_flux_inputs(device, size) | extra


def _full_flux_controlnet(device: torch.device) -> Any:
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    # Shakker-Labs/FLUX.1-dev-ControlNet-Union-Pro-2.0 config.json: six double blocks, no single blocks, no
    # control-mode embedding; its conditioning image goes through the VAE's encoder (no hint block).
    controlnet = _random_model(partial(
        FluxControlNetModel, patch_size=1, in_channels=64, num_layers=6, num_single_layers=0,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    ), "controlnet", device)  # fmt: skip
    return FluxControlNetPipeline(**_full_flux(device).components, controlnet=controlnet)


def _full_flux_controlnet_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # The model card's conditioning scale for its canny and soft-edge modes, the image at the output's size.
    control = {"control_image": _image(size.width, size.height), "controlnet_conditioning_scale": 0.7}
    return _full_flux_inputs(device, size) | control


def _full_chroma(device: torch.device) -> Any:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    # lodestones/Chroma1-HD transformer/config.json; its scheduler taken to be FLUX.1-dev's.
    transformer = _random_model(partial(
        ChromaTransformer2DModel, patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
        approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5,
    ), "transformer", device)  # fmt: skip
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX1_SCHEDULER), vae=_flux1_vae(device), text_encoder=None,
        tokenizer=None, transformer=transformer,
    )  # fmt: skip


def _full_chroma_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # T5-XXL padded to 512 tokens, a 64-token prompt and an 8-token negative prompt.
    embeds = {
        "prompt_embeds": _randn(device, 1, 512, 4096),
        "prompt_attention_mask": _mask(device, 512, 64, torch.bool),
    }
    embeds |= {"negative_prompt_embeds": _randn(device, 1, 512, 4096, seed=1)}
    embeds |= {"negative_prompt_attention_mask": _mask(device, 512, 8, torch.bool)}
    return embeds | _size(size) | {"guidance_scale": 4.0}


def _full_sd3(device: torch.device) -> Any:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    # stabilityai/stable-diffusion-3.5-large transformer/config.json (Large, 8.1B; not Medium).
    transformer = _random_model(partial(
        SD3Transformer2DModel, sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
        out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json.
    vae = _random_model(partial(
        AutoencoderKL, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True, force_upcast=True,
    ), "vae", device)  # fmt: skip
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=vae, text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
        transformer=transformer,
    )  # fmt: skip


def _full_sd3_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # 77 CLIP tokens and 256 T5 tokens side by side; the two CLIPs' pooled outputs together (768 + 1280).
    embeds = {"prompt_embeds": _randn(device, 1, 333, 4096), "pooled_prompt_embeds": _randn(device, 1, 2048, seed=1)}
    embeds |= {"negative_prompt_embeds": _randn(device, 1, 333, 4096, seed=2)}
    embeds |= {"negative_pooled_prompt_embeds": _randn(device, 1, 2048, seed=3)}
    return embeds | _size(size) | {"guidance_scale": 3.5}


def _full_lumina2(device: torch.device) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    # Alpha-VLLM/Lumina-Image-2.0 transformer/config.json; its scheduler's shift of 6.0 not checked.
    transformer = _random_model(partial(
        Lumina2Transformer2DModel, sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
        num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256, norm_eps=1e-5,
        scaling_factor=1.0, axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512), cap_feat_dim=2304,
    ), "transformer", device)  # fmt: skip
    return Lumina2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0), vae=_flux1_vae(device),
        text_encoder=None, tokenizer=None, transformer=transformer,
    )  # fmt: skip


def _full_lumina2_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Gemma-2-2B padded to the pipeline's 256 tokens, a 64-token prompt and an 8-token negative prompt.
    embeds = {
        "prompt_embeds": _randn(device, 1, 256, 2304),
        "prompt_attention_mask": _mask(device, 256, 64, torch.bool),
    }
    embeds |= {"negative_prompt_embeds": _randn(device, 1, 256, 2304, seed=1)}
    embeds |= {"negative_prompt_attention_mask": _mask(device, 256, 8, torch.bool)}
    return embeds | _size(size) | {"guidance_scale": 4.0}


def _wan_transformer(name: str, device: torch.device) -> nn.Module:
    from diffusers import WanTransformer3DModel

    # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (14B, not 1.3B); each expert of
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers has the same.
    return _random_model(partial(
        WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ), name, device)  # fmt: skip


def _wan_vae(device: torch.device) -> nn.Module:
    from diffusers import AutoencoderKLWan

    # Wan-AI/Wan2.1-T2V-14B-Diffusers vae/config.json (Wan 2.2 A14B's too); latents_mean/std: the class defaults.
    return _random_model(partial(
        AutoencoderKLWan, base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0,
    ), "vae", device)  # fmt: skip


def _full_qwen_vae(device: torch.device) -> nn.Module:
    from diffusers import AutoencoderKLQwenImage

    # Qwen/Qwen-Image-Edit-2511 vae/config.json (Qwen-Image's); latents_mean/std: the class defaults.
    return _random_model(partial(
        AutoencoderKLQwenImage, base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0,
    ), "vae", device)  # fmt: skip


def _unipc(flow_shift: float) -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift)


def _full_wan(device: torch.device) -> Any:
    from diffusers import WanPipeline

    # UniPC with flow_shift 3.0: diffusers' documented Wan 2.1 default, for 480p.
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=_wan_vae(device), scheduler=_unipc(3.0),
        transformer=_wan_transformer("transformer", device),
    )  # fmt: skip


def _full_wan_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # UMT5-XXL: the pipeline pads every prompt to 512 tokens with zeros, so the transformer sees 512.
    embeds = {
        "prompt_embeds": _randn(device, 1, 512, 4096),
        "negative_prompt_embeds": _randn(device, 1, 512, 4096, seed=1),
    }
    return embeds | _size(size) | {"guidance_scale": 5.0}


def _full_wan22(device: torch.device) -> Any:
    from diffusers import WanPipeline

    # Wan 2.2 A14B: boundary_ratio 0.875 (its model_index.json); flow_shift 12.0 is the sample_shift of Wan 2.2's
    # own t2v-A14B config (not checked against the diffusers repository's scheduler config).
    experts = {name: _wan_transformer(name, device) for name in ("transformer", "transformer_2")}
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=_wan_vae(device), scheduler=_unipc(12.0), boundary_ratio=0.875,
        **experts,
    )  # fmt: skip


def _full_wan22_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    return _full_wan_inputs(device, size) | {"guidance_scale": 4.0, "guidance_scale_2": 3.0}


def _full_cogvideox(device: torch.device) -> Any:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    # THUDM/CogVideoX-5b transformer/config.json (5B, not 2B).
    transformer = _random_model(partial(
        CogVideoXTransformer3DModel, num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
        flip_sin_to_cos=True, freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42,
        sample_width=90, sample_height=60, sample_frames=49, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=226, activation_fn="gelu-approximate", timestep_activation_fn="silu",
        norm_elementwise_affine=True, norm_eps=1e-5, spatial_interpolation_scale=1.875,
        temporal_interpolation_scale=1.0, use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=False,
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json: the class defaults but for 5B's scaling factor.
    vae = _random_model(partial(AutoencoderKLCogVideoX, scaling_factor=0.7), "vae", device)
    scheduler = CogVideoXDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=True,
        prediction_type="v_prediction", rescale_betas_zero_snr=True, snr_shift_scale=1.0, timestep_spacing="trailing",
    )  # fmt: skip
    return CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)


def _full_cogvideox_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # T5-XXL at the model's 226 text tokens.
    embeds = {
        "prompt_embeds": _randn(device, 1, 226, 4096),
        "negative_prompt_embeds": _randn(device, 1, 226, 4096, seed=1),
    }
    return embeds | _size(size) | {"guidance_scale": 6.0}


def _full_qwen_edit(device: torch.device, plus: bool) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )

    # Qwen/Qwen-Image-Edit transformer/config.json, Qwen-Image's (bcg_diffusion.models's random-full); the
    # Plus pipeline is built as Qwen/Qwen-Image-Edit-2511, whose transformer adds zero_cond_t.
    transformer = _random_model(partial(
        QwenImageTransformer2DModel, patch_size=2, in_channels=64, out_channels=16, num_layers=60,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56), zero_cond_t=plus,
    ), "transformer", device)  # fmt: skip
    vae = _full_qwen_vae(device)
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**_QWEN_IMAGE_SCHEDULER), vae=vae, text_encoder=None,
        tokenizer=None, processor=None, transformer=transformer,
    )  # fmt: skip


def _full_qwen_edit_inputs(device: torch.device, size: Size, plus: bool) -> dict[str, Any]:
    # Qwen2.5-VL-7B sees the input image with the instruction: Edit gives it the image at about 1024x1024
    # (some 1330 image tokens), Plus at about 384x384 (some 190); the negative prompt is shorter by the instruction.
    length, negative = (230, 200) if plus else (1360, 1340)
    embeds = {"prompt_embeds": _randn(device, 1, length, 3584), "prompt_embeds_mask": _mask(device, length, length)}
    embeds |= {"negative_prompt_embeds": _randn(device, 1, negative, 3584, seed=1)}
    embeds |= {"negative_prompt_embeds_mask": _mask(device, negative, negative)}
    return embeds | _size(size) | {"image": _image(size.width, size.height), "true_cfg_scale": 4.0}


# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json (the klein models use it too).
_FLUX2_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
    "num_train_timesteps": 1000, "shift": 3.0, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip


def _full_flux2(device: torch.device) -> Any:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    # black-forest-labs/FLUX.2-dev transformer/config.json (32B; not the Klein models).
    transformer = _random_model(partial(
        Flux2Transformer2DModel, patch_size=1, in_channels=128, num_layers=8, num_single_layers=48,
        attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True,
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json: the class defaults (32 latent channels, 2x2 patches).
    vae = _random_model(AutoencoderKLFlux2, "vae", device)
    scheduler = FlowMatchEulerDiscreteScheduler(**_FLUX2_SCHEDULER)
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)


def _full_flux2_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Mistral-Small-3.1-24B: three layers' hidden states side by side (3 x 5120), 512 tokens; one reference
    # image of the output's size (under 1 MP, so the pipeline keeps its size).
    embeds = {"prompt_embeds": _randn(device, 1, 512, 15360)}
    return embeds | _size(size) | {"image": _image(size.width, size.height), "guidance_scale": 4.0}


def _full_flux2_klein(device: torch.device) -> Any:
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    # black-forest-labs/FLUX.2-klein-4B: 5 double-stream and 20 single-stream blocks of FLUX.2's shape at 24
    # heads (hidden 3072), fed three hidden layers of Qwen3-4B side by side (3 x 2560); no guidance embedding
    # (step- and guidance-distilled, 4 steps). Its VAE and scheduler: FLUX.2's.
    transformer = _random_model(partial(
        Flux2Transformer2DModel, patch_size=1, in_channels=128, num_layers=5, num_single_layers=20,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False,
    ), "transformer", device)  # fmt: skip
    vae = _random_model(AutoencoderKLFlux2, "vae", device)
    scheduler = FlowMatchEulerDiscreteScheduler(**_FLUX2_SCHEDULER)
    return Flux2KleinPipeline(
        scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer, is_distilled=True
    )


def _full_flux2_klein_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Qwen3-4B: three layers' hidden states side by side (3 x 2560), 512 tokens; text to image, no CFG.
    return {"prompt_embeds": _randn(device, 1, 512, 7680)} | _size(size) | {"guidance_scale": 1.0}


def _full_hunyuan_video(device: torch.device) -> Any:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    # hunyuanvideo-community/HunyuanVideo transformer/config.json (13B).
    transformer = _random_model(partial(
        HunyuanVideoTransformer3DModel, in_channels=16, out_channels=16, num_attention_heads=24,
        attention_head_dim=128, num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0,
        patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
        pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json: the class defaults.
    vae = _random_model(AutoencoderKLHunyuanVideo, "vae", device)
    return HunyuanVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None, tokenizer_2=None,
    )  # fmt: skip


def _full_hunyuan_video_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Llava-Llama-3-8B padded to the pipeline's 256 tokens (a 64-token prompt) and CLIP-L's pooled output;
    # guidance is distilled into the model (guidance_scale is an input, one call per step).
    embeds = {"prompt_embeds": _randn(device, 1, 256, 4096), "prompt_attention_mask": _mask(device, 256, 64)}
    embeds |= {"pooled_prompt_embeds": _randn(device, 1, 768, seed=1)}
    return embeds | _size(size) | {"guidance_scale": 6.0}


def _full_ltx(device: torch.device) -> Any:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    # Lightricks/LTX-Video transformer/config.json (the 2B of 0.9.0/0.9.1).
    transformer = _random_model(partial(
        LTXVideoTransformer3DModel, in_channels=128, out_channels=128, patch_size=1, patch_size_t=1,
        num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048, num_layers=28,
        activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
        norm_eps=1e-6, caption_channels=4096, attention_bias=True, attention_out_bias=True,
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json (0.9.0's): the class defaults.
    vae = _random_model(AutoencoderKLLTXVideo, "vae", device)
    # Its scheduler/scheduler_config.json.
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096, max_shift=2.05, num_train_timesteps=1000,
        shift=1.0, shift_terminal=0.1, use_dynamic_shifting=True,
    )  # fmt: skip
    return LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)


def _full_ltx_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # T5-XXL padded to the pipeline's 128 tokens: a 64-token prompt, an 8-token negative prompt.
    embeds = {"prompt_embeds": _randn(device, 1, 128, 4096), "prompt_attention_mask": _mask(device, 128, 64)}
    embeds |= {"negative_prompt_embeds": _randn(device, 1, 128, 4096, seed=1)}
    embeds |= {"negative_prompt_attention_mask": _mask(device, 128, 8)}
    return embeds | _size(size) | {"guidance_scale": 3.0}


def _full_sana(device: torch.device) -> Any:
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    # Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json (1.6B).
    transformer = _random_model(partial(
        SanaTransformer2DModel, in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32,
        num_layers=20, num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
        caption_channels=2304, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=32, patch_size=1,
        norm_elementwise_affine=False, norm_eps=1e-6,
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json (mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers).
    blocks = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    vae = _random_model(partial(
        AutoencoderDC, in_channels=3, latent_channels=32, attention_head_dim=32, encoder_block_types=blocks,
        decoder_block_types=blocks, encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
        decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024), encoder_layers_per_block=(2, 2, 2, 3, 3, 3),
        decoder_layers_per_block=(3, 3, 3, 3, 3, 3), encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), upsample_block_type="interpolate",
        downsample_block_type="Conv", decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    ), "vae", device)  # fmt: skip
    # Its scheduler/scheduler_config.json.
    scheduler = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++", beta_schedule="linear", beta_start=0.0001, beta_end=0.02, flow_shift=3.0,
        prediction_type="flow_prediction", solver_order=2, solver_type="midpoint", use_flow_sigmas=True,
    )  # fmt: skip
    return SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)


def _full_sana_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Gemma-2-2B: the pipeline keeps the last 300 tokens of the complex human instruction and the prompt (all
    # valid); the empty negative prompt, padded to 300, has one.
    embeds = {"prompt_embeds": _randn(device, 1, 300, 2304), "prompt_attention_mask": _mask(device, 300, 300)}
    embeds |= {"negative_prompt_embeds": _randn(device, 1, 300, 2304, seed=1)}
    embeds |= {"negative_prompt_attention_mask": _mask(device, 300, 1)}
    # Resolution binning off: it would snap the size to the model's aspect-ratio table.
    extra = {"guidance_scale": 4.5, "negative_prompt": None, "use_resolution_binning": False}
    return embeds | _size(size) | extra


def _full_hunyuan_image(device: torch.device) -> Any:
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )

    # hunyuanvideo-community/HunyuanImage-2.1-Diffusers transformer/config.json (17B, the undistilled model).
    transformer = _random_model(partial(
        HunyuanImageTransformer2DModel, in_channels=64, out_channels=64, num_attention_heads=28,
        attention_head_dim=128, num_layers=20, num_single_layers=40, num_refiner_layers=2, patch_size=(1, 1),
        qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584, text_embed_2_dim=1472, rope_theta=256.0,
        rope_axes_dim=(64, 64),
    ), "transformer", device)  # fmt: skip
    # Its vae/config.json: 32x spatial compression, 64 latent channels.
    vae = _random_model(partial(
        AutoencoderKLHunyuanImage, in_channels=3, out_channels=3, latent_channels=64,
        block_out_channels=(128, 256, 512, 512, 1024, 1024), layers_per_block=2, spatial_compression_ratio=32,
        sample_size=384, scaling_factor=0.75289, downsample_match_channel=True, upsample_match_channel=True,
    ), "vae", device)  # fmt: skip
    # The guider with its defaults (CFG 3.5, the adaptive projection from step 5); a flow shift changes no work.
    return HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer, guider=AdaptiveProjectedMixGuidance(),
    )  # fmt: skip


def _full_hunyuan_image_inputs(device: torch.device, size: Size) -> dict[str, Any]:
    # Qwen2.5-VL-7B padded to the pipeline's 1,000 tokens (an 83-token prompt, an 8-token negative one), ByT5's
    # 128 glyph tokens (zeros: no quoted text).
    embeds = _hunyuan_image_embeds(partial(_randn, device), device, text=(1000, 3584), glyphs=(128, 1472))
    return embeds | _size(size)


FULL: dict[str, Published] = {
    "FLUX.1": Published("black-forest-labs/FLUX.1-dev", _full_flux, _full_flux_inputs),
    "Chroma": Published("lodestones/Chroma1-HD", _full_chroma, _full_chroma_inputs),
    "SD3.5": Published("stabilityai/stable-diffusion-3.5-large", _full_sd3, _full_sd3_inputs),
    "Lumina 2": Published("Alpha-VLLM/Lumina-Image-2.0", _full_lumina2, _full_lumina2_inputs),
    "Wan 2.1 T2V": Published("Wan-AI/Wan2.1-T2V-14B-Diffusers", _full_wan, _full_wan_inputs, VIDEO_SIZES),
    "CogVideoX": Published("THUDM/CogVideoX-5b", _full_cogvideox, _full_cogvideox_inputs, VIDEO_SIZES),
    "Qwen-Image Edit": Published(
        "Qwen/Qwen-Image-Edit", partial(_full_qwen_edit, plus=False), partial(_full_qwen_edit_inputs, plus=False)
    ),
    "Qwen-Image Edit Plus": Published(
        "Qwen/Qwen-Image-Edit-2511", partial(_full_qwen_edit, plus=True), partial(_full_qwen_edit_inputs, plus=True)
    ),
    "FLUX.1 Kontext": Published("black-forest-labs/FLUX.1-Kontext-dev", _full_flux_kontext, _full_flux_kontext_inputs),
    "FLUX.1 ControlNet": Published(
        "Shakker-Labs/FLUX.1-dev-ControlNet-Union-Pro-2.0", _full_flux_controlnet, _full_flux_controlnet_inputs
    ),
    "FLUX.2": Published("black-forest-labs/FLUX.2-dev", _full_flux2, _full_flux2_inputs),
    "FLUX.2 klein": Published("black-forest-labs/FLUX.2-klein-4B", _full_flux2_klein, _full_flux2_klein_inputs),
    "Wan 2.2 T2V": Published("Wan-AI/Wan2.2-T2V-A14B-Diffusers", _full_wan22, _full_wan22_inputs, VIDEO_SIZES),
    "HunyuanVideo": Published(
        "hunyuanvideo-community/HunyuanVideo", _full_hunyuan_video, _full_hunyuan_video_inputs, VIDEO_SIZES
    ),
    # LTX-Video wants sizes that are multiples of 32: 480x288 for the launch-bound one.
    "LTX-Video": Published(
        "Lightricks/LTX-Video", _full_ltx, _full_ltx_inputs, (Size("launch-bound", 480, 288, 9), VIDEO_SIZES[1])
    ),
    "Sana": Published("Efficient-Large-Model/Sana_1600M_1024px_diffusers", _full_sana, _full_sana_inputs),
    # HunyuanImage 2.1 renders at 2048x2048 (its VAE compresses 32x: 4,096 image tokens there).
    "HunyuanImage": Published(
        "hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
        _full_hunyuan_image,
        _full_hunyuan_image_inputs,
        (Size("launch-bound", 1024, 1024), Size("GPU-bound", 2048, 2048)),
    ),
}
