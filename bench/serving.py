"""A serving run: warm up, then many requests with random prompts, and count what got captured.

    python -m bench.serving --pipeline qwen-image --weights random-full \
        --resolutions 512x512,1024x1024 --requests 50 --out bench-runs/serving

``accelerate(pipe, lazy_capture=False)`` (and, for Qwen-Image, ``text_buckets``), then
``warm_up`` at every resolution in both CFG modes, then ``--requests`` calls, each with a random
prompt (3 to 60 words), a random resolution from the list and CFG on or off at random. Reported:
the warm-up's calls, captures and seconds; captures, misses (signatures never warmed up, run
eagerly) and eager fallbacks during the requests (all should be 0 with buckets); request latency
(median, p90, max); and, for the first ``--check`` requests, whether the image equals the eager call
with the same inputs, and (with buckets) its largest difference from the unpadded eager call.

Z-Image needs no text buckets: its captions are padded by the model to a multiple of 32 tokens, and
with the pad mask passed in as a tensor (``bcg_diffusion.patches.zimage``) one graph serves every
caption of such a bucket exactly; the warm-up covers every bucket up to 512 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.models import DEFAULT_PROMPTS, PIPELINE_NAMES, build_pipeline
from bcg_diffusion.pipelines import adapter_for

from . import measure, runs

QWEN_BUCKETS = (64, 128, 256, 512)
VOCABULARY = sorted({word.strip(",.").lower() for prompt in DEFAULT_PROMPTS for word in prompt.split()})


def random_prompt(rng: random.Random) -> str:
    """3 to 60 words from the built-in prompts' vocabulary."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(3, 60)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serving", description=__doc__.splitlines()[0], formatter_class=runs.HelpFormatter
    )
    parser.add_argument("--pipeline", choices=PIPELINE_NAMES, default="qwen-image", help="the pipeline to build")
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument(
        "--device", type=runs.device_name, help="cpu, cuda or cuda:N (default: cuda if torch sees one, else cpu)"
    )
    parser.add_argument("--resolutions", type=runs.resolutions, default="512x512,1024x1024", help="WxH,...")
    parser.add_argument("--requests", type=runs.at_least(1), default=50, help="requests after the warm-up")
    parser.add_argument("--steps", type=runs.at_least(2), default=8, help="denoising steps per request")
    parser.add_argument("--check", type=runs.at_least(0), default=5, help="requests compared with eager")
    parser.add_argument("--no-buckets", action="store_true", help="Qwen-Image: exact mode, no text buckets")
    parser.add_argument("--seed", type=int, default=0, help="of the random requests")
    parser.add_argument("--out", type=Path, help="folder for serving.json / serving.md (default: print only)")
    args = parser.parse_args(argv)
    args.device = args.device or runs.default_device()
    if (problem := runs.device_problem(args.device)) is not None:
        parser.error(problem)
    args.device = torch.device(args.device)
    return args


@contextlib.contextmanager
def without_buckets(pipe: Any) -> Iterator[None]:
    """Eager calls without the text-bucket padding (the pipeline's own ``encode_prompt``)."""
    padded = pipe.__dict__.pop("encode_prompt")
    try:
        with eager(pipe):
            yield
    finally:
        pipe.__dict__["encode_prompt"] = padded


def _request_kwargs(pipe: Any, prompt: str, size: tuple[int, int], cfg: bool, steps: int) -> dict[str, Any]:
    kwargs = adapter_for(pipe).warmup_kwargs(*size, cfg=cfg, prompt=prompt)
    kwargs.update(num_inference_steps=steps, output_type="pt")
    return kwargs


def _call(pipe: Any, kwargs: dict[str, Any], seed: int) -> torch.Tensor:
    return pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed)).images


def serve(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, run the requests, and return the figures described in the module docstring."""
    buckets = None if args.no_buckets or args.pipeline != "qwen-image" else QWEN_BUCKETS
    accelerate(pipe, text_buckets=buckets, lazy_capture=False, debug=args.device.type != "cuda")
    try:
        warmup = warm_up(pipe, args.resolutions, cfg=(False, True))
        before = stats(pipe)
        rng = random.Random(args.seed)
        latencies: list[float] = []
        checks: list[dict[str, Any]] = []
        for index in range(args.requests):
            prompt, size, cfg = random_prompt(rng), rng.choice(args.resolutions), rng.random() < 0.5
            kwargs = _request_kwargs(pipe, prompt, size, cfg, args.steps)
            measure.synchronize(args.device)
            started = time.perf_counter()
            image = _call(pipe, kwargs, index)
            measure.synchronize(args.device)
            latencies.append(time.perf_counter() - started)
            if index < args.check:
                with eager(pipe):
                    check = {"equal_to_eager": torch.equal(image, _call(pipe, kwargs, index))}
                if buckets is not None:
                    with without_buckets(pipe):
                        plain = _call(pipe, kwargs, index)
                    check["max_abs_diff_unpadded"] = (image.float() - plain.float()).abs().max().item()
                checks.append(check)
        after = stats(pipe)
    finally:
        restore(pipe)
    ordered = sorted(latencies)
    return {
        "pipeline": args.pipeline,
        "text_buckets": list(buckets) if buckets else None,
        "resolutions": [list(r) for r in args.resolutions],
        "steps": args.steps,
        "warmup": warmup,
        "requests": args.requests,
        "captures_during_requests": after["captures"] - before["captures"],
        "misses": after["misses"] - before["misses"],
        "eager_fallbacks": after["eager_fallbacks"] - before["eager_fallbacks"],
        "graph_memory_bytes": after["graph_memory_bytes"],
        "latency_s": {
            "median": statistics.median(latencies),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1],
        },
        "checks": checks,
    }


def markdown(result: dict[str, Any]) -> str:
    checks = result["checks"]
    equal = sum(c["equal_to_eager"] for c in checks)
    lines = [
        f"`{result['command']}`",
        "",
        f"Environment: {json.dumps(result['environment'])}",
        "",
        f"- text buckets: {result['text_buckets'] or 'none (exact)'}; resolutions {result['resolutions']}",
        f"- warm-up: {result['warmup']['calls']} calls, {result['warmup']['captures']} captures, "
        f"{result['warmup']['seconds']:.1f} s",
        f"- {result['requests']} requests with random prompts: **{result['captures_during_requests']} captures**, "
        f"{result['misses']} transformer or VAE calls missed (ran eagerly), "
        f"{result['eager_fallbacks']} eager fallbacks",
        f"- latency: median {result['latency_s']['median']:.3f} s, p90 {result['latency_s']['p90']:.3f} s, "
        f"max {result['latency_s']['max']:.3f} s; graph memory {result['graph_memory_bytes'] / 2**20:.0f} MiB",
        f"- first {len(checks)} requests equal to eager with the same inputs: {equal} of {len(checks)}",
    ]
    diffs = [c["max_abs_diff_unpadded"] for c in checks if "max_abs_diff_unpadded" in c]
    if diffs:
        lines.append(f"- largest difference from the unpadded eager call (images in [0, 1]): {max(diffs):.4g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smoke = f"python -m bench.serving --pipeline {args.pipeline} --weights tiny --resolutions 32x32 --requests 4"
    if runs.refuse_without_gpu("bench.serving", args.weights, [args.pipeline], smoke):
        return 2
    dtype = torch.bfloat16 if args.device.type == "cuda" else None
    pipe = build_pipeline(args.pipeline, args.weights, device=args.device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    result = serve(pipe, args)
    result["command"] = "python -m bench.serving " + shlex.join(sys.argv[1:] if argv is None else argv)
    result["environment"] = measure.environment(args.device)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving.json").write_text(json.dumps(result, indent=1))
        (args.out / "serving.md").write_text(text + "\n")
    ok = all(c["equal_to_eager"] for c in result["checks"]) and result["captures_during_requests"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
