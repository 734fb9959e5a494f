"""Coverage of diffusers transformer pipelines beyond the two we tune: does ``accelerate`` hold them?

Each entry builds a pipeline of the installed diffusers from its own classes, with random weights,
and supplies its prompt embeddings directly (no text encoder or tokenizer is needed, so nothing is
downloaded). ``tiny`` configs run on a CPU in debug mode: the runner path, equality with eager, and
what a capture would meet outside the eager breaks (``hostile_ops``, :mod:`bcg_diffusion.hostile`).
The GPU columns of the coverage table (captured, segments and breaks, speed-ups) come from the same
builders at their published sizes on the device (issue 23; not measured yet).

    python -m bench.coverage            # tiny configs, CPU, debug mode: a Markdown table
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg_diffusion import BCGWarning, accelerate, restore, stats


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


TINY: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "FLUX.1": _flux,
    "Chroma": _chroma,
    "SD3.5": _sd3,
    "Lumina 2": _lumina2,
    "Wan 2.1 T2V": _wan,
    "CogVideoX": _cogvideox,
}


def _call(pipe: Any, embeds: dict[str, Any]) -> torch.Tensor:
    kwargs = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in embeds.items()}
    out = pipe(
        **kwargs,
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    )
    return out.images if hasattr(out, "images") else out.frames  # video pipelines return frames


def check_tiny(name: str) -> dict[str, Any]:
    """Build ``name``'s tiny pipeline on the CPU, compare debug mode with eager over two calls, and
    report the runner's state and what a capture would meet."""
    torch.manual_seed(0)
    pipe, embeds = TINY[name]()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        reference = _call(pipe, embeds)
        with warnings.catch_warnings():  # "no adapter for ...: using the generic one": what is tested here
            warnings.filterwarnings("ignore", message=".*has no adapter", category=BCGWarning)
            accelerate(pipe, debug=True)
        try:
            images = [_call(pipe, embeds) for _ in range(2)]
            report = stats(pipe)
        finally:
            restore(pipe)
    hostile = sorted({op for s in report["signatures"] for op in s["hostile_ops"] or []})
    return {
        "pipeline": name,
        "class": type(pipe).__name__,
        "adapter": report["adapter"],
        "active": report["active"],
        "reason": report["reason"],
        "identical": all(torch.equal(image, reference) for image in images),
        "signatures": len(report["signatures"]),
        "replays": report["replays"],
        "hostile_ops": hostile,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", default=",".join(TINY), help="comma-separated, from " + ", ".join(TINY))
    args = parser.parse_args(argv)
    rows = [check_tiny(name) for name in args.pipelines.split(",")]
    print("| pipeline | class | runner active | identical to eager (debug) | a capture would meet |")
    print("|---|---|---|---|---|")
    for row in rows:
        met = "; ".join(row["hostile_ops"]) or "nothing outside the breaks"
        active = "yes" if row["active"] else f"no: {row['reason']}"
        print(f"| {row['pipeline']} | {row['class']} | {active} | {'yes' if row['identical'] else '**no**'} | {met} |")
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
