"""``torchrun -m bench.parallel``: Qwen-Image on one GPU against N GPUs, split by diffusers' context
parallelism or by true CFG across two GPUs.

    torchrun --nproc_per_node=2 -m bench.parallel --weights random-full
    torchrun --nproc_per_node=2 -m bench.parallel --parallel ring=2 --resolutions 1024x1024 --steps 50
    torchrun --nproc_per_node=2 -m bench.parallel --parallel cfg --single-modes bcg,fast --resolutions 1024x1024

With ``--parallel cfg`` (``accelerate(pipe, cfg_parallel=True)``, two processes), rank 0 computes each
step's cond call and rank 1 its uncond call; the modes are ``bcg`` and ``fast`` (``--cfg-modes``), and
each is checked byte-equal to the same mode on one GPU (there, fast mode runs without its CFG batching,
so both use the same kernels); the forward alone is not timed.

Every rank builds the pipeline. First rank 0 alone measures it without parallelism (the others wait),
then every rank measures a copy split with ``transformer.enable_parallelism`` (``--parallel
ulysses=N`` or ``ring=N``, N = the number of processes). For each, eager and bcg (``accelerate``):

* the transformer forward alone, on the inputs of the pipeline's first denoising step (median of
  ``--forward-runs`` synchronised calls; on N GPUs the slowest rank's time);
* the whole pipeline call (text encoder, ``--steps`` steps with true CFG ``--guidance``, VAE decode),
  median of ``--runs`` calls after a first one.

bcg is checked byte-equal to eager of the same layout (one GPU and N GPUs give different bytes: the
attention is split differently). Rank 0 writes ``parallel.json`` and ``parallel.md`` to ``--out``
(default ``bench-runs/parallel-<UTC timestamp>/`` under the current directory).
Prompts must tokenize to a length that divides by N (diffusers splits text and image tokens evenly).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline

from . import measure, runs
from .modes import pipeline_copy

logger = logging.getLogger("bench.parallel")

MODES = ("eager", "bcg", "fast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked against the number of processes torchrun started (``WORLD_SIZE``), before any
    process group exists: ``--help`` and a mistake (usage, one line, exit status 2) need no rendezvous."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m bench.parallel",
        description=__doc__,
        formatter_class=runs.HelpFormatter,
    )
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument("--parallel", default=None, help="ulysses=N, ring=N or cfg (default: ulysses=WORLD_SIZE)")
    parser.add_argument("--resolutions", type=runs.resolutions, default="512x512,1024x1024", help="WxH,...")
    parser.add_argument("--steps", type=runs.at_least(2), default=50, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=4.0, help="true_cfg_scale (> 1: two forwards per step)")
    parser.add_argument("--prompt", default="a red fox", help="8 tokens with the offline tokenizer")
    parser.add_argument("--negative-prompt", default="blurry, low quality", help="20 tokens, likewise")
    parser.add_argument(
        "--runs", type=runs.at_least(1), default=3, help="timed pipeline calls per mode after the first"
    )
    parser.add_argument(
        "--forward-runs", type=runs.at_least(1), default=20, help="timed transformer forwards per mode"
    )
    parser.add_argument("--single-modes", default="eager,bcg", help="modes measured on one GPU ('' for none)")
    parser.add_argument("--cfg-modes", default="bcg,fast", help="with --parallel cfg: the modes split across GPUs")
    parser.add_argument(
        "--out", type=Path, default=None, help="rank 0's output folder (default: bench-runs/parallel-<UTC timestamp>/)"
    )
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --nproc_per_node=2 -m bench.parallel --weights tiny")
    world = int(os.environ["WORLD_SIZE"])
    kind, _, degree = (args.parallel or f"ulysses={world}").partition("=")
    if kind == "cfg":
        if world != 2 or degree:
            parser.error("--parallel cfg takes no degree and needs exactly 2 processes")
    elif kind not in ("ulysses", "ring") or not degree.isdigit() or int(degree) != world:
        parser.error(f"--parallel must be ulysses={world}, ring={world} or cfg (one split over all {world} processes)")
    args.kind = kind
    args.cfg_modes = [m for m in args.cfg_modes.split(",") if m]
    if any(m not in ("bcg", "fast") for m in args.cfg_modes):
        parser.error("--cfg-modes takes bcg and/or fast")
    if args.out is None:
        args.out = runs.default_out("parallel")
    args.single_modes = [m for m in args.single_modes.split(",") if m]
    if any(m not in MODES for m in args.single_modes):
        parser.error(f"--single-modes takes modes from {MODES}")
    return args


def _max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _call_kwargs(args: argparse.Namespace, width: int, height: int) -> dict[str, Any]:
    cfg = args.guidance > 1
    return {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt if cfg else None,
        "true_cfg_scale": args.guidance,
        "width": width,
        "height": height,
        "num_inference_steps": args.steps,
        "output_type": "pt",
    }


def _first_forward_inputs(pipe: Any, kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The transformer's keyword arguments at the first denoising step of a two-step call (one step
    gives the scheduler's terminal shift a zero division, hence NaN timesteps)."""
    seen: dict[str, Any] = {}

    def record(module: Any, args: Any, call_kwargs: dict[str, Any]) -> None:
        if not seen:
            seen.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call_kwargs.items()})

    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        pipe(**{**kwargs, "num_inference_steps": 2}, generator=torch.Generator(device).manual_seed(0))
    finally:
        handle.remove()
    return seen


def _time_forward(
    pipe: Any, inputs: dict[str, Any], runs: int, parallel: bool, device: torch.device
) -> dict[str, Any]:
    with torch.no_grad():
        reference = pipe.transformer(**inputs)[0].clone()
        times = []
        for _ in range(runs):
            measure.synchronize(device)
            start = time.perf_counter()
            output = pipe.transformer(**inputs)[0]
            measure.synchronize(device)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "median_s": _max_over_ranks(median, device) if parallel else median,
        "min_s": min(times),
        "output": reference,
        "deterministic": torch.equal(output, reference),
    }


def _time_pipeline(
    pipe: Any, kwargs: dict[str, Any], runs: int, parallel: bool, device: torch.device
) -> dict[str, Any]:
    walls, images = [], None
    for _ in range(runs + 1):
        measure.synchronize(device)
        start = time.perf_counter()
        images = pipe(**kwargs, generator=torch.Generator(device).manual_seed(0)).images
        measure.synchronize(device)
        walls.append(time.perf_counter() - start)
    timed = walls[1:] or walls
    median = statistics.median(timed)
    return {
        "untimed_first_call_s": walls[0],  # the signatures were captured before, when recording inputs
        "median_s": _max_over_ranks(median, device) if parallel else median,
        "min_s": min(timed),
        "max_s": max(timed),
        "images": images,
    }


def measure_layout(
    base: Any,
    args: argparse.Namespace,
    device: torch.device,
    parallel: bool,
    results: dict[str, Any],
    on_case: Callable[[], None],
    modes: tuple[str, ...] = MODES,
    images: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """``modes`` on a copy of ``base`` (split over every rank when ``parallel``), every resolution, into
    ``results`` (one entry per resolution); ``on_case()`` after each, so a cut-short run keeps its figures.

    ``images``: one GPU's images per resolution and mode; filled when not ``parallel``, compared
    with under ``--parallel cfg`` (where one GPU's rounding is the reference)."""
    for width, height in args.resolutions:
        label = f"{width}x{height}"
        kwargs = _call_kwargs(args, width, height)
        case: dict[str, Any] = {}
        split_cfg = parallel and args.kind == "cfg"
        for mode in modes:
            pipe = pipeline_copy(base)
            if parallel and not split_cfg:
                from diffusers import ContextParallelConfig

                degree = dist.get_world_size()
                config = ContextParallelConfig(**{f"{args.kind}_degree": degree})
                pipe.transformer.enable_parallelism(config=config)
            if mode != "eager":
                options: dict[str, Any] = {"cfg_parallel": True} if split_cfg else {}
                if mode == "fast":
                    options["mode"] = "fast"
                    if not split_cfg:  # one GPU without CFG batching: the kernels of the split calls
                        options["batch_cfg"] = False
                accelerate(pipe, debug=device.type != "cuda", **options)
            if split_cfg:  # each rank runs half the calls: the forward alone says nothing
                forward = {"median_s": float("nan"), "output": None}
            else:
                inputs = _first_forward_inputs(pipe, kwargs, device)
                forward = _time_forward(pipe, inputs, args.forward_runs, parallel, device)
            call = _time_pipeline(pipe, kwargs, args.runs, parallel, device)
            entry = {k: v for k, v in forward.items() if k != "output"}
            case[mode] = {"forward": entry, "pipeline": {k: v for k, v in call.items() if k != "images"}}
            case[mode]["_forward_output"], case[mode]["_images"] = forward["output"], call["images"]
            if mode != "eager":
                report = stats(pipe)
                case[mode]["graphs"] = {k: report[k] for k in ("captures", "replays", "eager_fallbacks")}
                restore(pipe)
            del pipe
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            logger.info(
                "%s %s %s: forward %.4f s, pipeline %.3f s",
                "parallel" if parallel else "single",
                label,
                mode,
                case[mode]["forward"]["median_s"],
                case[mode]["pipeline"]["median_s"],
            )
        if "eager" in case and "bcg" in case:
            case["bcg"]["forward_equal"] = torch.equal(
                case["bcg"]["_forward_output"], case["eager"]["_forward_output"]
            )
            case["bcg"]["images_equal"] = torch.equal(case["bcg"]["_images"], case["eager"]["_images"])
        if split_cfg and images is not None:  # byte-equal to the same mode on one GPU (rank 0 has it)
            for mode in case:
                if mode in images.get(label, {}):
                    case[mode]["images_equal_to_one_gpu"] = torch.equal(case[mode]["_images"], images[label][mode])
        if not parallel and images is not None:
            images[label] = {mode: entry["_images"] for mode, entry in case.items()}
        for entry in case.values():
            del entry["_forward_output"], entry["_images"]
        results[label] = case
        on_case()


def markdown(record: dict[str, Any]) -> str:
    world = record["world_size"]
    lines = [
        f"`{record['command']}`",
        "",
        f"Environment: {json.dumps(record['environment'])}",
        "",
        f"Qwen-Image ({record['weights']}), {record['steps']} steps, true CFG {record['guidance']}, "
        f"{'CFG across GPUs' if record['layout'] == 'cfg' else 'context parallelism ' + record['layout']} "
        "against one GPU.",
        "",
        "| resolution | GPUs | mode | transformer forward (ms) | pipeline median (s) | same as eager |",
        "|---|---|---|---|---|---|",
    ]
    for layout, gpus in (("single", 1), ("parallel", world)):
        for label, case in record.get(layout, {}).items():
            for mode, entry in case.items():
                if "images_equal_to_one_gpu" in entry:
                    same = "as one GPU: " + ("yes" if entry["images_equal_to_one_gpu"] else "**no**")
                elif "images_equal" in entry:
                    same = "yes" if entry["images_equal"] and entry["forward_equal"] else "**no**"
                else:
                    same = "–" if mode == "eager" else "not compared (no eager run)"
                forward_ms = entry["forward"]["median_s"] * 1e3
                forward = f"{forward_ms:.1f}" if forward_ms == forward_ms else "–"  # NaN: not timed (cfg)
                lines.append(
                    f"| {label} | {gpus} | {mode} | {forward} | {entry['pipeline']['median_s']:.3f} | {same} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    # Rank 0 measures one GPU alone for minutes while the others wait in a barrier.
    timeout = datetime.timedelta(minutes=30)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:  # a smoke run of the bookkeeping (tests): gloo, runner in debug mode, timings meaningless
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        torch.accelerator.device_count = lambda: 1  # diffusers divides by it to pick a device per rank
    try:
        rank = dist.get_rank()
        smoke = "torchrun --nproc_per_node=2 -m bench.parallel --weights tiny --resolutions 64x64 --steps 2"
        if runs.no_gpu_message("bench.parallel", args.weights, ["qwen-image"], smoke) is not None:
            if rank == 0:
                runs.refuse_without_gpu("bench.parallel", args.weights, ["qwen-image"], smoke)
            return 2
        dtype = torch.bfloat16 if device.type == "cuda" else None
        base = build_pipeline("qwen-image", args.weights, device=device, dtype=dtype)
        base.set_progress_bar_config(disable=True)
        record: dict[str, Any] = {
            "command": "torchrun -m bench.parallel " + shlex.join(sys.argv[1:] if argv is None else argv),
            "world_size": dist.get_world_size(),
            "layout": "cfg" if args.kind == "cfg" else f"{args.kind}={dist.get_world_size()}",
            "steps": args.steps,
            "guidance": args.guidance,
            "weights": args.weights,
            "environment": measure.environment(device),
        }

        def write() -> None:
            if rank == 0:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "parallel.json").write_text(json.dumps(record, indent=1))
                (args.out / "parallel.md").write_text(markdown(record) + "\n")

        one_gpu: dict[str, dict[str, torch.Tensor]] = {}
        if args.single_modes and rank == 0:
            record["single"] = {}
            measure_layout(base, args, device, False, record["single"], write, tuple(args.single_modes), one_gpu)
        dist.barrier()
        record["parallel"] = {}
        split_modes = tuple(args.cfg_modes) if args.kind == "cfg" else MODES[:2]
        measure_layout(base, args, device, True, record["parallel"], write, split_modes, one_gpu)
        if rank == 0:
            print(markdown(record))
        dist.barrier()
        cases = [case for layout in ("single", "parallel") for case in record.get(layout, {}).values()]
        ok = all(
            entry.get("images_equal", True)
            and entry.get("forward_equal", True)
            and entry.get("images_equal_to_one_gpu", True)
            for case in cases
            for entry in case.values()
        )
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
