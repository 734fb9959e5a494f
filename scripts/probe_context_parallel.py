"""Probe: diffusers' context parallelism on CPU with gloo (groundwork for issue 8's CPU test).

    torchrun --nproc_per_node=2 scripts/probe_context_parallel.py

Builds the tiny Qwen-Image pipeline on every rank, enables Ulysses context parallelism over the two
processes and generates one image; both ranks print the same mean. diffusers derives the device from
``torch.accelerator.device_count()``, which is 0 without an accelerator (a division by zero), so the
probe reports one CPU "device". Text and image token counts must divide by the degree: "a red fox"
gives 8 text tokens with the tiny tokenizer; "a fox" (7) fails diffusers' divisibility check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

from bcg_diffusion.loading import build_pipeline


def main() -> None:
    dist.init_process_group("gloo")
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1  # one CPU "device" per rank (see the docstring)
    rank = dist.get_rank()
    try:
        pipe = build_pipeline("qwen-image", "tiny", device="cpu")
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
        image = pipe(
            prompt="a red fox",
            height=64,
            width=64,
            num_inference_steps=2,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).images
        print(f"rank {rank}: image {tuple(image.shape)}, mean {image.float().mean().item():.6f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
