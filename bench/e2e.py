"""End-to-end latency: eager against bcg-diffusion, measured side by side in one process.

For each case the same pipeline object is timed eagerly, then accelerated (first call = capture
cost), then eagerly and accelerated again, interleaved A/B/B/A so that clock or thermal drift does not
favour one mode. It also reports, from ``torch.profiler``, the wall time of the denoising loop against
the sum of its GPU kernel time: a ratio near 1.0 means no launch gaps are left.

    python -m bench --pipeline z-image --weights random-full --height 512 --width 512 --steps 8 --guidance 0
    python -m bench --preset issue2 --out bench/results/h200-issue2.json   # the H200 record
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.loading import DEFAULT_PROMPTS, PIPELINE_NAMES, build_pipeline


@dataclass(frozen=True)
class Case:
    """One benchmarked pipeline call."""

    pipeline: str
    height: int
    width: int
    steps: int
    guidance: float  # Qwen-Image: true_cfg_scale (CFG when > 1); Z-Image: guidance_scale (CFG when > 0)
    batch_prompts: tuple[str, ...] = (DEFAULT_PROMPTS[0],)
    negative_prompt: str = "blurry, low quality"
    profile: bool = True  # also profile the denoising loop (wall time against GPU kernel time)

    @property
    def label(self) -> str:
        cfg = f"cfg {self.guidance:g}" if self.uses_cfg else "no cfg"
        batch = f", batch {len(self.batch_prompts)}" if len(self.batch_prompts) > 1 else ""
        return f"{self.pipeline} {self.width}x{self.height}, {self.steps} steps, {cfg}{batch}"

    @property
    def uses_cfg(self) -> bool:
        return self.guidance > 1 if self.pipeline == "qwen-image" else self.guidance > 0

    def kwargs(self, output_type: str = "pt") -> dict[str, Any]:
        prompts = list(self.batch_prompts)
        kwargs: dict[str, Any] = {
            "prompt": prompts if len(prompts) > 1 else prompts[0],
            "height": self.height,
            "width": self.width,
            "num_inference_steps": self.steps,
            "output_type": output_type,
            "generator": torch.Generator("cpu").manual_seed(0),
        }
        negative = [self.negative_prompt] * len(prompts) if len(prompts) > 1 else self.negative_prompt
        if self.pipeline == "qwen-image":
            kwargs["true_cfg_scale"] = self.guidance
            if self.uses_cfg:
                kwargs["negative_prompt"] = negative
        else:
            kwargs["guidance_scale"] = self.guidance
            if self.uses_cfg:
                kwargs["negative_prompt"] = negative
        return kwargs


@dataclass
class CaseResult:
    case: str
    eager_s: list[float] = field(default_factory=list)
    bcg_s: list[float] = field(default_factory=list)
    eager_first_s: float = 0.0
    bcg_first_s: float = 0.0
    speedup: float = 0.0
    identical: bool = False
    eager_md5: str = ""
    bcg_md5: str = ""
    denoise: dict[str, Any] = field(default_factory=dict)
    captures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0
    graph_memory_bytes: int = 0
    peak_memory_eager_bytes: int = 0
    peak_memory_bcg_bytes: int = 0


def _timed_call(pipe: Any, case: Case, output_type: str = "pt") -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    images = pipe(**case.kwargs(output_type)).images
    torch.cuda.synchronize()
    return time.perf_counter() - start, images


def _md5(images: torch.Tensor) -> str:
    return hashlib.md5(images.detach().float().cpu().numpy().tobytes()).hexdigest()


def _prompt_inputs(pipe: Any, case: Case) -> dict[str, Any]:
    """Prompt embeddings computed once, so the profiled call is the denoising loop (output_type=latent)."""
    kwargs = case.kwargs("latent")
    prompts = kwargs.pop("prompt")
    negative = kwargs.pop("negative_prompt", None)
    if case.pipeline == "qwen-image":
        embeds, mask = pipe.encode_prompt(prompts, device=pipe.device)
        kwargs.update(prompt_embeds=embeds, prompt_embeds_mask=mask)
        if negative is not None:
            neg, neg_mask = pipe.encode_prompt(negative, device=pipe.device)
            kwargs.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
    else:
        pos, neg = pipe.encode_prompt(
            prompts, device=pipe.device, do_classifier_free_guidance=case.uses_cfg, negative_prompt=negative
        )
        kwargs.update(prompt_embeds=pos, negative_prompt_embeds=neg if case.uses_cfg else None)
    return kwargs


def _denoise_profile(pipe: Any, case: Case, runs: int) -> dict[str, Any]:
    """Wall time of the denoising loop (median after one warm-up) and the sum of its GPU kernel time
    (one profiled run)."""
    from torch.profiler import ProfilerActivity, profile

    kwargs = _prompt_inputs(pipe, case)
    walls = []
    for _ in range(runs + 1):
        kwargs["generator"] = torch.Generator("cpu").manual_seed(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(**kwargs)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    walls = walls[1:]
    kwargs["generator"] = torch.Generator("cpu").manual_seed(0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipe(**kwargs)
        torch.cuda.synchronize()
    kernel_us = sum(
        e.device_time for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )
    wall = statistics.median(walls)
    return {
        "wall_s": wall,
        "kernel_s": kernel_us / 1e6,
        "wall_over_kernel": wall / (kernel_us / 1e6) if kernel_us else float("nan"),
    }


def run_case(pipe: Any, case: Case, runs: int) -> CaseResult:
    """Time one case eagerly and accelerated, interleaved; no profiler is active (CUPTI, once attached,
    slows every later eager launch, so profiling runs in a separate phase after all timing)."""
    result = CaseResult(case=case.label)
    torch.cuda.reset_peak_memory_stats()
    result.eager_first_s, eager_images = _timed_call(pipe, case)
    result.peak_memory_eager_bytes = torch.cuda.max_memory_allocated()
    accelerate(pipe)
    try:
        torch.cuda.reset_peak_memory_stats()
        result.bcg_first_s, bcg_images = _timed_call(pipe, case)
        for i in range(runs):
            order = ("bcg", "eager") if i % 2 == 0 else ("eager", "bcg")  # A/B/B/A against drift
            for mode in order:
                if mode == "bcg":
                    seconds, images = _timed_call(pipe, case)
                    result.bcg_s.append(seconds)
                else:
                    with eager(pipe):
                        seconds, images = _timed_call(pipe, case)
                    result.eager_s.append(seconds)
        result.peak_memory_bcg_bytes = torch.cuda.max_memory_allocated()
        report = stats(pipe)
        result.captures, result.replays = report["captures"], report["replays"]
        result.eager_fallbacks, result.graph_memory_bytes = report["eager_fallbacks"], report["graph_memory_bytes"]
    finally:
        restore(pipe)
    result.eager_md5, result.bcg_md5 = _md5(eager_images), _md5(bcg_images)
    result.identical = torch.equal(eager_images, bcg_images)
    result.speedup = statistics.median(result.eager_s) / statistics.median(result.bcg_s)
    return result


def profile_case(pipe: Any, case: Case) -> dict[str, Any]:
    """Denoising-loop wall time against GPU kernel time, eager then accelerated."""
    eager = _denoise_profile(pipe, case, PROFILE_RUNS)
    accelerate(pipe)
    try:
        accelerated = _denoise_profile(pipe, case, PROFILE_RUNS)
    finally:
        restore(pipe)
    return {"eager": eager, "bcg": accelerated}


PROFILE_RUNS = 1  # wall-time runs of the denoising loop per mode, besides the warm-up and the profiled one

PRESETS: dict[str, list[Case]] = {
    # The acceptance cases of issue 2 on one H200 (full-size random weights).
    "issue2": [
        Case("qwen-image", 512, 512, 50, 4.0),
        Case("qwen-image", 512, 512, 50, 4.0, (DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[-1]), profile=False),
        Case("qwen-image", 1024, 1024, 10, 4.0),
        Case("z-image", 512, 512, 8, 0.0),
        Case("z-image", 1024, 1024, 8, 0.0),
    ],
}


def environment() -> dict[str, Any]:
    import diffusers
    import transformers

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        except OSError:
            env["driver"] = "unknown"
    return env


def markdown(results: list[CaseResult]) -> str:
    lines = [
        "| case | eager (s, median) | bcg (s, median) | speed-up | first call eager / bcg (s) | identical | "
        "denoise wall/kernel eager → bcg | graph mem (MiB) | captures / replays / fallbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        denoise = ""
        if r.denoise:
            denoise = f"{r.denoise['eager']['wall_over_kernel']:.3f} → {r.denoise['bcg']['wall_over_kernel']:.3f}"
        lines.append(
            f"| {r.case} | {statistics.median(r.eager_s):.3f} | {statistics.median(r.bcg_s):.3f} | "
            f"**{r.speedup:.2f}×** | {r.eager_first_s:.2f} / {r.bcg_first_s:.2f} | {'yes' if r.identical else 'NO'} | "
            f"{denoise} | {r.graph_memory_bytes / 2**20:.0f} | {r.captures} / {r.replays} / {r.eager_fallbacks} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named list of cases (overrides --pipeline...)")
    parser.add_argument("--pipeline", choices=PIPELINE_NAMES, default="z-image")
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (of different lengths)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per mode (median reported)")
    parser.add_argument("--no-profile", action="store_true", help="skip the denoising-loop kernel profile")
    parser.add_argument("--out", help="write the JSON record here (a .md table is written beside it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (CUDA graphs); on CPU use the test suite's debug-mode checks", file=sys.stderr)
        return 2
    if args.preset:
        cases = PRESETS[args.preset]
    else:
        prompts = tuple(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(args.batch))
        cases = [Case(args.pipeline, args.height, args.width, args.steps, args.guidance, prompts)]
    by_pipeline: dict[str, list[Case]] = {}
    for case in cases:
        by_pipeline.setdefault(case.pipeline, []).append(case)
    results: dict[Case, CaseResult] = {}

    def save() -> None:
        table = markdown(list(results.values()))
        if args.out:
            record = {
                "command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
                "weights": args.weights,
                "runs": args.runs,
                "environment": environment(),
                "results": [asdict(r) for r in results.values()],
            }
            with open(args.out, "w") as f:
                json.dump(record, f, indent=2)
            with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
                f.write(f"`{record['command']}`\n\n{json.dumps(record['environment'])}\n\n{table}\n")

    # Phase 1: timing, with no profiler ever attached. Phase 2: the denoising-loop profiles.
    for phase in ("time", "profile"):
        for name, pipeline_cases in by_pipeline.items():
            todo = [c for c in pipeline_cases if phase == "time" or (c.profile and not args.no_profile)]
            if not todo:
                continue
            start = time.perf_counter()
            pipe = build_pipeline(name, args.weights, device="cuda", dtype=torch.bfloat16)
            pipe.set_progress_bar_config(disable=True)
            print(f"[{phase}] built {name} ({args.weights}) in {time.perf_counter() - start:.1f} s", flush=True)
            for case in todo:
                if phase == "time":
                    results[case] = run_case(pipe, case, args.runs)
                else:
                    results[case].denoise = profile_case(pipe, case)
                print(markdown([results[case]]).splitlines()[-1], flush=True)
                save()
            del pipe
            gc.collect()
            torch.cuda.empty_cache()
    results_list = list(results.values())
    print("\n" + markdown(results_list))
    return 0 if all(r.identical and r.eager_fallbacks == 0 for r in results_list) else 1
