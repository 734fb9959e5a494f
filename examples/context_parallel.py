"""Qwen-Image on several GPUs: diffusers' context parallelism plus bcg-diffusion's graphs.

    torchrun --nproc_per_node=2 examples/context_parallel.py                      # full size, random weights
    torchrun --nproc_per_node=2 examples/context_parallel.py --weights Qwen/Qwen-Image --out fox.png

Every rank loads the whole pipeline; diffusers splits each sequence over the ranks
(``ulysses_degree`` = number of processes) and every rank gets the whole image back. Call
``enable_parallelism`` before ``accelerate``: the collectives it adds become eager breaks, and
everything between them is replayed from CUDA graphs on every rank. Text and image token counts
must divide by the number of ranks; ``text_buckets`` pads every prompt to a bucket (64, 128, ...),
which does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bcg_diffusion import accelerate, restore, stats  # noqa: E402
from bcg_diffusion.models import build_pipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="random-full", help="random-full | hub id | local path")
    parser.add_argument("--prompt", default="a red fox in the snow, golden hour")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="rank 0 saves the image here")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        pipe = build_pipeline("qwen-image", args.weights, device=device, dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=dist.get_rank() != 0)
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
        accelerate(pipe, text_buckets=(64, 128, 256, 512))
        for _ in range(2):  # the first call captures, the second replays
            image = pipe(
                prompt=args.prompt,
                negative_prompt=" ",
                true_cfg_scale=4.0,
                width=args.size,
                height=args.size,
                num_inference_steps=args.steps,
                generator=torch.Generator(device).manual_seed(0),
            ).images[0]
        if dist.get_rank() == 0:
            report = stats(pipe)
            print(f"captures {report['captures']}, replays {report['replays']}, fallbacks {report['eager_fallbacks']}")
            if args.out is not None:
                image.save(args.out)
        restore(pipe)
    finally:
        dist.destroy_process_group()  # every rank reaches this: no collective is left waiting


if __name__ == "__main__":
    main()
