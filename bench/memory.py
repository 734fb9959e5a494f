"""Graph memory of many signatures against one, and peak memory of a replayed call against eager.

    python -m bench.memory --pipeline z-image --weights random-full \
        --resolutions 512x512,768x768,1024x1024,768x1344 --out bench-runs/memory

Two accelerated copies of one pipeline (weights shared): the first captures only the largest
resolution with CFG (the largest single set of signatures); the second warms up every resolution in
both CFG modes through the one shared pool. Z-Image's warm-up is held to one caption bucket (32
tokens, the warm-up prompt's), so both sides count resolutions × CFG modes, not caption buckets
(plus, for Z-Image, one text-encoder graph each: its prompts are padded to one length).
The pool sizes say how much the shared pool saves over capturing each signature into memory of its
own. Then, at the largest resolution, it compares the peak allocated memory of one eager call with
that of one replayed call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.models import PIPELINE_NAMES, build_pipeline
from bcg_diffusion.patches.zimage import CAPTION_MULTIPLE
from bcg_diffusion.pipelines import adapter_for

from . import runs
from .measure import peak_allocated, reset_peak, synchronize
from .modes import pipeline_copy


def _peak_of(pipe: Any, kwargs: dict[str, Any], device: torch.device) -> int:
    synchronize(device)
    reset_peak(device)
    pipe(**kwargs)
    synchronize(device)
    return peak_allocated(device)


def measure(pipe: Any, resolutions: list[tuple[int, int]], device: torch.device) -> dict[str, Any]:
    """The figures described in the module docstring, as a dict (bytes)."""
    debug = device.type != "cuda"
    one_bucket = {"max_sequence_length": CAPTION_MULTIPLE} if adapter_for(pipe).name == "z-image" else {}
    largest = max(resolutions, key=lambda r: r[0] * r[1])
    single = pipeline_copy(pipe)
    accelerate(single, debug=debug)
    try:
        warm_up(single, [largest], cfg=(True,), **one_bucket)
        single_stats = stats(single)
    finally:
        restore(single)
    shared = pipeline_copy(pipe)
    accelerate(shared, debug=debug)
    try:
        warm_up(shared, resolutions, cfg=(False, True), **one_bucket)
        shared_stats = stats(shared)
        kwargs = adapter_for(shared).warmup_kwargs(*largest, cfg=True, prompt="a lighthouse on a rocky coast at dusk")
        kwargs["generator"] = torch.Generator("cpu").manual_seed(0)
        with eager(shared):
            eager_peak = _peak_of(shared, dict(kwargs), device)
        replay_peak = _peak_of(shared, dict(kwargs), device)
    finally:
        restore(shared)
    return {
        "largest_resolution": list(largest),
        "single": {"signatures": single_stats["captures"], "pool_bytes": single_stats["graph_memory_bytes"]},
        "all": {
            "resolutions": [list(r) for r in resolutions],
            "signatures": shared_stats["captures"],
            "pool_bytes": shared_stats["graph_memory_bytes"],
            "per_signature_bytes": {s["signature"]: s["memory_bytes"] for s in shared_stats["signatures"]},
        },
        "pool_ratio_all_over_single": (
            shared_stats["graph_memory_bytes"] / single_stats["graph_memory_bytes"]
            if single_stats["graph_memory_bytes"]
            else None
        ),
        "peak_eager_bytes": eager_peak,
        "peak_replay_bytes": replay_peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.split("\n\n")[0], formatter_class=runs.HelpFormatter
    )
    parser.add_argument("--pipeline", choices=PIPELINE_NAMES, default="z-image", help="the pipeline to build")
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument(
        "--device", type=runs.device_name, help="cpu, cuda or cuda:N (default: cuda if torch sees one, else cpu)"
    )
    parser.add_argument(
        "--resolutions", type=runs.resolutions, default="512x512,768x768,1024x1024,768x1344", help="WxH,..."
    )
    parser.add_argument("--out", type=Path, help="folder for memory.json (default: print only)")
    args = parser.parse_args(argv)
    args.device = args.device or runs.default_device()
    if (problem := runs.device_problem(args.device)) is not None:
        parser.error(problem)
    smoke = f"python -m bench.memory --pipeline {args.pipeline} --weights tiny --resolutions 64x64,48x96"
    if runs.refuse_without_gpu("bench.memory", args.weights, [args.pipeline], smoke):
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    pipe = build_pipeline(args.pipeline, args.weights, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    result = {"command": "python -m bench.memory " + " ".join(sys.argv[1:] if argv is None else argv)}
    result.update(measure(pipe, args.resolutions, device))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
