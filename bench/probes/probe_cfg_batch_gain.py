"""GPU probe: what batching true CFG's two transformer calls would gain FLUX.1 (its ``true_cfg_scale``).

CFG batching pays where a call reads its weights for few tokens: two calls of batch 1 read every weight twice,
one call of batch 2 once. This probe times full-size FLUX.1-dev's transformer (random weights, bf16, replayed
from a CUDA graph, diffusers' own kernels) at batch 1 and batch 2 with its published text length (512), and
prints what one batch of two saves against two calls of one: ``1 - t(2) / (2 t(1))``. Run 190 timed each replay
by wall clock after a synchronize; the probe now times them with CUDA events (``graph_replay_ms``).

    python -m bench.probes.probe_cfg_batch_gain [--sizes 512,1024] [--replays 10]
"""

from __future__ import annotations

import argparse

import torch

from bench.coverage_models import _flux1_transformer
from bench.probes.probe_fast_floor import graph_replay_ms


def _inputs(batch: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
    tokens = (size // 16) ** 2
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)

    return {
        "hidden_states": randn(batch, tokens, 64),
        "encoder_hidden_states": randn(batch, 512, 4096),
        "pooled_projections": randn(batch, 768),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=torch.bfloat16),
        "guidance": torch.full((batch,), 3.5, device=device, dtype=torch.bfloat16),
        "txt_ids": torch.zeros(512, 3, device=device, dtype=torch.bfloat16),
        "img_ids": torch.zeros(tokens, 3, device=device, dtype=torch.bfloat16),
    }


def _replay_ms(transformer: torch.nn.Module, inputs: dict[str, torch.Tensor], replays: int) -> float:
    with torch.no_grad():
        milliseconds, _ = graph_replay_ms(lambda: transformer(**inputs, return_dict=False), replays)
    return milliseconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    transformer = _flux1_transformer(device)
    print("| FLUX.1-dev transformer | batch 1 (ms) | batch 2 (ms) | two calls of batch 1 (ms) | batching saves |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        one = _replay_ms(transformer, _inputs(1, size, device), args.replays)
        two = _replay_ms(transformer, _inputs(2, size, device), args.replays)
        print(f"| {size}² | {one:.2f} | {two:.2f} | {2 * one:.2f} | {1 - two / (2 * one):.1%} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
