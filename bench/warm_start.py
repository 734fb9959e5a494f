"""Cold and warm start of fast mode: time to the first image in a fresh process.

    python -m bench.warm_start --pipeline z-image --weights random-full --out bench-runs/warm-start

Runs three child processes one after another, each building the pipeline, calling
``accelerate(pipe, mode="fast", compile_cache_dir=...)`` and generating one image:

* ``cold``: an empty compile cache directory (everything is compiled);
* ``warm``: the same directory again (PyTorch's on-disk caches hit);
* ``portable``: a new directory holding only the portable files the cold run wrote (PyTorch's
  artifacts, and the zip of our Triton kernels), as when the cache is shipped to another machine.

Each child's Triton cache (``TRITON_CACHE_DIR``, where the kernels of ``bcg_diffusion.kernels`` are
kept) is a folder of its compile cache directory: the children inherit no ``TRITON_CACHE_DIR``, and
``compile_cache_dir`` sets it there, as for a user who set none. So the cold child compiles those kernels
too (since run 134; before, it could find them in the machine's default Triton cache), and the portable
child finds them only through the zip.

Each child reports its time from process start to the first image, split into start-up (imports,
building the pipeline) and the first call (compiles or cache loads, warm-up, capture, the call), and
of that first call the block calls that compiled (``compile_s``) and the captures (``capture_s``,
which include the warm-up runs before each capture, so they overlap), with PyTorch's cache counters
(FX graph and AOT autograd hits, misses and bypasses), the reason of each AOT autograd bypass, and
dynamo's compile phase times. ``--profile`` also writes each
child's first call as a ``cProfile`` summary, with dynamo's compile phase times, next to the report;
the profiler slows compiling down (about 2× on the H200, run 45), so a profiled run's times are not
a warm-start measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_STARTED = time.perf_counter()


def _child(args: argparse.Namespace) -> None:
    import torch

    from bcg_diffusion import accelerate, stats
    from bcg_diffusion.models import build_pipeline

    from .cases import Case
    from .measure import synchronize

    bypasses = _record_cache_bypasses()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    pipe = build_pipeline(args.pipeline, args.weights, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    _enable_cache(pipe, args.cache, args.steps)
    accelerate(
        pipe, mode="fast", compile_cache_dir=args.cache_dir, debug=device.type != "cuda", quantize=args.quantize
    )
    ready = time.perf_counter()
    profiler = cProfile.Profile() if args.profile_to else None
    if profiler is not None:
        profiler.enable()
    pipe(**Case(args.pipeline, args.size, args.size, args.steps, guidance=args.guidance).kwargs())
    synchronize(device)
    done = time.perf_counter()
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, Path(args.profile_to))
    report = stats(pipe)
    from torch._dynamo.utils import compile_times, counters

    caches = {f"{group}.{key}": n for group in ("aot_autograd", "inductor") for key, n in counters[group].items()}
    print(
        "WARM_START "
        + json.dumps(
            {
                "startup_s": ready - _STARTED,
                "first_call_s": done - ready,
                "to_first_image_s": done - _STARTED,
                "compiles": report["compiles"],
                "compile_s": report["compile_seconds"],
                "captures": report["captures"],
                "capture_s": report["capture_seconds"],
                # which of PyTorch's caches hit, why AOT autograd's refused a graph, and where
                # dynamo's compile time went: what a warm start still pays, and why
                "cache_counters": {k: n for k, n in caches.items() if "cache" in k},
                "aot_cache_bypass_reasons": sorted(set(bypasses)),
                "dynamo_phases_s": compile_times(repr="str"),
            }
        )
    )


def _enable_cache(pipe: Any, cache: str | None, steps: int) -> None:
    """The benchmark's step cache on ``pipe`` before ``accelerate`` (its static schedules, :mod:`.caching`):
    ``"magcache"``, ``"cachedit"`` (Cache-DiT's DBCache with a static mask), or None."""
    if cache is None:
        return
    from bcg_diffusion import enable_cache

    from . import caching

    if cache == "cachedit":
        import cache_dit

        cache_dit.enable_cache(pipe, **caching.cachedit_options(pipe, steps))
    else:
        enable_cache(pipe, caching.cache_config(cache, steps))


def _record_cache_bypasses() -> list[str]:
    """A list that fills, as this process compiles, with the reason of each AOT autograd cache
    bypass (PyTorch logs one at INFO level per compile that bypasses; whitespace folded, 400
    characters at most)."""
    import logging

    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Bypassing autograd cache"):
                reasons.append(" ".join(message.split())[:400])

    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect(logging.INFO))
    return reasons


def _write_profile(profiler: cProfile.Profile, file: Path) -> None:
    """The first call's 60 costliest functions (cumulative time), then dynamo's compile phase times."""
    from torch._dynamo.utils import compile_times

    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    text.write("\ndynamo compile phases (s):\n" + str(compile_times(repr="str")) + "\n")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text.getvalue())


def _run_child(args: argparse.Namespace, cache_dir: Path, label: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.warm_start", "--child", "--cache-dir", str(cache_dir)]
    command += ["--pipeline", args.pipeline, "--weights", args.weights, "--device", args.device]
    command += ["--size", str(args.size), "--steps", str(args.steps), "--guidance", str(args.guidance)]
    if args.cache:
        command += ["--cache", args.cache]
    if args.quantize:
        command += ["--quantize", args.quantize]
    if args.profile:
        command += ["--profile-to", str(args.out / f"first-call-{label}.txt")]
    # Neither cache directory inherited: compile_cache_dir sets both, as for a user who set neither (Triton's
    # cache, with our kernels, then a folder of it), so cold compiles our kernels too, warm finds them, and a
    # portable start finds them only through the zip, as on a new machine.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("WARM_START ")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}", "process_wall_s": wall}
    result = json.loads(lines[-1].removeprefix("WARM_START "))
    result["process_wall_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    from . import runs

    parser = argparse.ArgumentParser(
        prog="python -m bench.warm_start", description=__doc__.split("\n\n")[0], formatter_class=runs.HelpFormatter
    )
    parser.add_argument(
        "--pipeline", default="z-image", choices=("z-image", "qwen-image"), help="the pipeline to build"
    )
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument("--device", type=runs.device_name, default="cuda", help="cpu, cuda or cuda:N")
    parser.add_argument("--size", type=runs.at_least(16), default=512, help="width and height, a multiple of 16")
    parser.add_argument("--steps", type=runs.at_least(2), default=8, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=0.0, help="true CFG scale (Qwen-Image; 0: no CFG)")
    parser.add_argument(
        "--cache",
        choices=("magcache", "cachedit"),
        help="a step cache enabled before accelerate in every child, on the benchmark's static schedule "
        "(MagCache's ratios, Cache-DiT's mask): the first call with a cache against one without (default: none)",
    )
    parser.add_argument("--out", type=Path, help="folder for warm-start.json (default: print only)")
    parser.add_argument(
        "--quantize", choices=("fp8",), help='accelerate(..., quantize="fp8") in every child (default: none)'
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write each first call's cProfile summary to --out (default with --profile: "
        "bench-runs/warm-start-<pipeline>-<UTC timestamp>/)",
    )
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size % 16:
        parser.error(f"argument --size: {args.size} is not a multiple of 16")
    if args.child:
        _child(args)
        return 0
    smoke = f"python -m bench.warm_start --pipeline {args.pipeline} --weights tiny --device cpu"
    if runs.refuse_without_gpu("bench.warm_start", args.weights, [args.pipeline], smoke):
        return 2
    if (problem := runs.device_problem(args.device)) is not None:  # before the children: each would fail alike
        parser.error(problem)
    if args.profile and args.out is None:  # the profiles need a folder: never the current directory
        args.out = runs.default_out(f"warm-start-{args.pipeline}")
    from bcg_diffusion.features.compiled_blocks import ARTIFACTS_FILE, TRITON_KERNELS_FILE

    results: dict[str, Any] = {
        "command": "python -m bench.warm_start " + " ".join(sys.argv[1:] if argv is None else argv)
    }

    def save() -> str:  # after every child: a run cut short keeps what it measured
        text = json.dumps(results, indent=2)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "warm-start.json").write_text(text + "\n")
        return text

    with tempfile.TemporaryDirectory(prefix="bcg-warm-start-") as root:
        first, second = Path(root, "cache"), Path(root, "portable")
        results["cold"] = _run_child(args, first, "cold")
        save()
        results["warm"] = _run_child(args, first, "warm")
        save()
        second.mkdir()
        artifacts, kernels = first / ARTIFACTS_FILE, first / TRITON_KERNELS_FILE
        if kernels.is_file():
            shutil.copy(kernels, second / TRITON_KERNELS_FILE)
            results["portable_triton_kernels_bytes"] = kernels.stat().st_size
        if artifacts.is_file():
            shutil.copy(artifacts, second / ARTIFACTS_FILE)
            results["portable_artifacts_bytes"] = artifacts.stat().st_size
            results["portable"] = _run_child(args, second, "portable")
        else:
            results["portable"] = {"error": f"the cold run wrote no {ARTIFACTS_FILE} (torch without the API?)"}
    print(save())
    return 0 if all("error" not in results[k] for k in ("cold", "warm", "portable")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
