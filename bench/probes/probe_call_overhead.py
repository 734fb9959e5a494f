"""GPU probe: Z-Image-Turbo's whole call at full size, back to back, and each component's per-call state check.

An A/B of two trees on one machine (run 211: the tree before issue 56 against HEAD): build full-size Z-Image
with random weights, ``accelerate`` it (fast mode by default), make three calls, then time ten calls back to
back (wall clock, one synchronize at the end) and print the state check's share of each from ``stats``. The
benchmark times each call between synchronizes with its stages; this measures what a server issuing calls
one after another sees. Give each tree its own ``TORCHINDUCTOR_CACHE_DIR``: inductor's cache can hand one
tree's compiled graph, calling our operators with another tree's arguments, to the other.

    python -m bench.probes.probe_call_overhead [--mode fast|exact] [--size 512] [--steps 8] [--calls 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from bcg_diffusion import accelerate, stats
from bcg_diffusion.models import build_pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fast", "exact"), default="fast")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    pipe = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a cat sitting on a mat", height=args.size, width=args.size, output_type="pt")
    call |= {"num_inference_steps": args.steps, "guidance_scale": 0.0}
    with torch.no_grad():
        accelerate(pipe, mode=args.mode)
        for _ in range(3):
            pipe(**call)
        torch.cuda.synchronize()
        before = stats(pipe)
        started = time.perf_counter()
        for _ in range(args.calls):
            pipe(**call)
        torch.cuda.synchronize()
        call_ms = (time.perf_counter() - started) / args.calls * 1e3
        after = stats(pipe)
    for name, component in after["components"].items():
        seconds = component["state_check_seconds"] - before["components"][name]["state_check_seconds"]
        print(f"  {name}: state check {seconds / args.calls * 1e3:.3f} ms a call")
    total = (after["state_check_seconds"] - before["state_check_seconds"]) / args.calls * 1e3
    print(f"{args.mode} {args.size}², {args.steps} steps: {call_ms:.1f} ms a call; state check {total:.3f} ms a call")


if __name__ == "__main__":
    main()
