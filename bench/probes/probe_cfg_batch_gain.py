"""GPU probe: what batching CFG's two transformer calls would gain FLUX.1 (true CFG) and Wan 2.1.

CFG batching pays where a call reads its weights for few tokens: two calls of batch 1 read every weight twice,
one call of batch 2 once. This probe times a full-size transformer (random weights, bf16, replayed from a CUDA
graph, diffusers' own kernels) at batch 1 and batch 2 with its published text length (512 tokens for both), and
prints what one batch of two saves against two calls of one: ``1 - t(2) / (2 t(1))``. Run 190 timed FLUX.1's
replays by wall clock after a synchronize; the probe now times them with CUDA events (``graph_replay_ms``).

    python -m bench.probes.probe_cfg_batch_gain [--model flux|wan] [--sizes 512,1024] [--replays 10]

``--sizes`` names FLUX.1's square sizes; Wan 2.1 T2V 14B is timed at its published 832x480, 81 frames.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.coverage_models import _flux1_transformer, _wan_transformer
from bench.probes.probe_fast_floor import graph_replay_ms


def _randn_on(device: torch.device) -> Callable[..., torch.Tensor]:
    generator = torch.Generator(device).manual_seed(0)
    return lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)


def _flux_inputs(batch: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
    tokens = (size // 16) ** 2
    randn = _randn_on(device)
    return {
        "hidden_states": randn(batch, tokens, 64),
        "encoder_hidden_states": randn(batch, 512, 4096),
        "pooled_projections": randn(batch, 768),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=torch.bfloat16),
        "guidance": torch.full((batch,), 3.5, device=device, dtype=torch.bfloat16),
        "txt_ids": torch.zeros(512, 3, device=device, dtype=torch.bfloat16),
        "img_ids": torch.zeros(tokens, 3, device=device, dtype=torch.bfloat16),
    }


def _wan_inputs(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    # 832x480, 81 frames: latents of 21 x 60 x 104 (VAE 4x in time, 8x in space), 32,760 tokens after 1x2x2 patches.
    randn = _randn_on(device)
    return {
        "hidden_states": randn(batch, 16, 21, 60, 104),
        "encoder_hidden_states": randn(batch, 512, 4096),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=torch.bfloat16),
    }


def _replay_ms(transformer: torch.nn.Module, inputs: dict[str, torch.Tensor], replays: int) -> float:
    with torch.no_grad():
        milliseconds, _ = graph_replay_ms(lambda: transformer(**inputs, return_dict=False), replays)
    return milliseconds


def _row(label: str, one: float, two: float) -> str:
    return f"| {label} | {one:.2f} | {two:.2f} | {2 * one:.2f} | {1 - two / (2 * one):.1%} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("flux", "wan"), default="flux")
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    title = {"flux": "FLUX.1-dev transformer", "wan": "Wan 2.1 T2V 14B transformer"}[args.model]
    print(f"| {title} | batch 1 (ms) | batch 2 (ms) | two calls of batch 1 (ms) | batching saves |")
    print("|---|---|---|---|---|")
    if args.model == "wan":
        transformer = _wan_transformer("transformer", device)
        one = _replay_ms(transformer, _wan_inputs(1, device), args.replays)
        two = _replay_ms(transformer, _wan_inputs(2, device), args.replays)
        print(_row("832x480, 81 frames", one, two), flush=True)
        return
    transformer = _flux1_transformer(device)
    for size in (int(s) for s in args.sizes.split(",")):
        one = _replay_ms(transformer, _flux_inputs(1, size, device), args.replays)
        two = _replay_ms(transformer, _flux_inputs(2, size, device), args.replays)
        print(_row(f"{size}²", one, two), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
