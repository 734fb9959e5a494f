"""GPU probe: what the CFG batcher's per-step timestep check (one host sync) costs end to end.

Answered (run 25, `bench/results/2026-11-30-h200/probe-cfg-sync.log`): the CFG batcher's per-step timestep check costs +1.0% end to end.

Times full-size Qwen-Image (random weights) 512², 50 steps, true CFG 4, ``mode="fast"``, with the
batcher as shipped and with its value check skipped (identity only, for this measurement; never
shipped), interleaved A/B/B/A. Prints the medians and their ratio.

    python -m bench.probes.probe_cfg_sync [--runs 3] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bcg_diffusion import accelerate, stats
from bcg_diffusion.features import cfg_batching as cfg_batch
from bcg_diffusion.models import build_pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    pipe = build_pipeline("qwen-image", "random-full", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, mode="fast")
    checked = cfg_batch.CfgBatcher._mismatch

    def identity_only(self, pending, arguments):
        pending.values = {name: arguments.get(name) for name in pending.values}
        return checked(self, pending, arguments)

    def call() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(
            "a red fox in the snow",
            negative_prompt=" ",
            true_cfg_scale=4.0,
            height=512,
            width=512,
            num_inference_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="pt",
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    call()  # compile and capture
    times: dict[str, list[float]] = {"checked": [], "identity only": []}
    for index in range(args.runs * 2):
        variant = "checked" if index % 4 in (0, 3) else "identity only"
        cfg_batch.CfgBatcher._mismatch = checked if variant == "checked" else identity_only
        times[variant].append(call())
    cfg_batch.CfgBatcher._mismatch = checked
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:14s} median {medians[name]:.3f} s  runs {[round(v, 3) for v in values]}")
    print(
        f"the check costs {medians['checked'] / medians['identity only'] - 1:+.2%}; stats: {stats(pipe)['cfg_batched']} batched"
    )


if __name__ == "__main__":
    main()
