"""``python -m bench``: end-to-end latency of bcg-diffusion against eager and its peers, side by side.

Every mode runs on its own weight-sharing copy of one pipeline, in one process, on one device; the
timed runs are interleaved A/B/B/A across modes so clock or thermal drift favours none. No profiler is
attached while timing (CUPTI, once attached, slows later eager launches): the optional denoising-loop
profile runs afterwards.

    python -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8
    python -m bench --preset issue3 --pipeline qwen-image --weights random-full --out bench/results/qwen
    python -m bench --pipeline z-image --weights tiny   # the CPU smoke run (tiny random models)

Results go to ``--out``, by default ``bench-runs/<pipeline>-<UTC timestamp>/`` under the current directory
(ignored by git: a run never writes into the checkout unless told to). Weights other than ``tiny`` need a
CUDA GPU: without one the run stops before building anything, says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion.features.step_caching import SkipCounter
from bcg_diffusion.models import PIPELINE_NAMES, build_pipeline

from . import measure, report, runs
from .caching import CACHES, cache_config
from .caching import describe as describe_cache
from .cases import PRESETS, PROMPT_SETS, Case
from .modes import (
    ABLATIONS,
    CACHED,
    DEFAULT_MODES,
    DESCRIPTIONS,
    EXACT,
    MODES,
    OURS,
    SEPARATE,
    PreparedMode,
    baseline,
    prepare,
)

logger = logging.getLogger("bench")


def _resolutions(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        try:
            width, height = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"resolution {item!r} is not WIDTHxHEIGHT") from None
        pairs.append((width, height))
    return pairs


def _modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="named cases (filtered by --pipeline if given)")
    parser.add_argument("--pipeline", choices=PIPELINE_NAMES, action="append", help="repeatable; default z-image")
    parser.add_argument("--weights", default=runs.DEFAULT_WEIGHTS, help="tiny | random-full | hub id | local path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resolutions", type=_resolutions, default=[(512, 512)], help="e.g. 512x512,1024x1024")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=0.0, help="Qwen true_cfg_scale / Z-Image guidance_scale")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="short")
    parser.add_argument(
        "--modes",
        type=_modes,
        help=f"comma-separated from {', '.join(MODES)} (default on GPU: all but the ablations {', '.join(ABLATIONS)})",
    )
    parser.add_argument("--cache", choices=CACHES, default="magcache", help="the step cache of the +cache modes")
    parser.add_argument("--cache-threshold", type=float, default=0.2, help="FirstBlockCache's threshold")
    parser.add_argument(
        "--cache-max-skip",
        type=int,
        default=2,
        help="MagCache: skips in a row; TaylorSeer: steps between computes - 1",
    )
    parser.add_argument("--runs", type=int, default=5, help="timed runs per mode (median, min, max reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per mode after the first call")
    parser.add_argument("--profile", action="store_true", help="also profile the denoising loop (kernel time on GPU)")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: bench-runs/<pipeline>-<UTC timestamp>/)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be >= 1 and --warmup >= 0")
    args.device = torch.device(args.device)
    if args.modes is None:
        args.modes = list(DEFAULT_MODES) if args.device.type == "cuda" else ["eager", "bcg"]
    if args.out is None:
        args.out = runs.default_out("+".join(_pipeline_names(args)))
    return args


def _pipeline_names(args: argparse.Namespace) -> list[str]:
    """The pipelines the run builds, in order: ``--pipeline``, else the preset's, else z-image."""
    if args.pipeline:
        return list(dict.fromkeys(args.pipeline))
    if args.preset:
        return list(dict.fromkeys(case.pipeline for case in PRESETS[args.preset])) or [runs.DEFAULT_PIPELINE]
    return [runs.DEFAULT_PIPELINE]


def _cases(args: argparse.Namespace) -> list[Case]:
    if args.preset:
        cases = PRESETS[args.preset]
        return [c for c in cases if not args.pipeline or c.pipeline in args.pipeline]
    return [
        Case(name, height, width, args.steps, args.guidance, args.batch, args.prompts)
        for name in args.pipeline or [runs.DEFAULT_PIPELINE]
        for width, height in args.resolutions
    ]


def _progress(total: int, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="call", disable=disable, file=sys.stderr)


def run_case(
    base: Any,
    case: Case,
    args: argparse.Namespace,
    progress: Any,
    result: dict[str, Any] | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Time every mode on ``case``; a mode that fails is recorded with its error, the others go on.

    Modes run interleaved in one group, except those in ``modes.SEPARATE`` (peers with CUDA graphs
    of their own), which run afterwards, interleaved with a fresh eager, once our graphs are freed:
    their speed-up is over that eager, measured side by side with them. Fills and returns ``result``
    (a new dict if None) group by group and calls ``checkpoint`` after each, so a cut-short run
    keeps every group that finished.
    """
    result = {} if result is None else result
    result.update(label=case.label, case=asdict(case), modes={})
    together = [name for name in args.modes if name not in SEPARATE]
    for group in [together] + [["eager", name] for name in args.modes if name in SEPARATE]:
        entries = _time_group(base, case, group, args, progress)
        for name, entry in entries.items():
            if name in result["modes"]:  # the second eager of a separate peer's group
                continue
            if name in SEPARATE and "eager" in entries:
                entry["eager_same_group_s"] = entries["eager"].get("latency_s")
            result["modes"][name] = entry
        if checkpoint is not None:
            checkpoint()
    return result


def _time_group(
    base: Any, case: Case, names: list[str], args: argparse.Namespace, progress: Any
) -> dict[str, dict[str, Any]]:
    """Prepare, first-call and warm up every mode, then time them interleaved.

    The image every timed run is compared with is eager's first call (untimed, same inputs and seed):
    so eager's own timed runs are compared with an independent eager call, not with themselves, and a
    mode is ``identical`` only if every one of its timed runs is byte-equal to it.
    """
    device = args.device
    entries: dict[str, dict[str, Any]] = {}
    prepared, calls, images = {}, {}, {}
    baselines: dict[str, torch.Tensor] = {}  # eager's and eager+cache's first calls
    counters: dict[str, Any] = {}  # per +cache mode: the calls its cache skipped

    def cache() -> Any:
        return cache_config(args.cache, case.steps, threshold=args.cache_threshold, max_skip=args.cache_max_skip)

    checked: dict[str, float | None] = {}  # per mode: the state checks' time before the timed runs
    comparisons: dict[str, list[dict[str, Any]]] = {}  # per mode, per timed run: against the reference
    run_images: dict[str, list[torch.Tensor]] = {}  # per timed run, for modes with a reference of their own
    for name in names:
        progress.set_postfix_str(f"{case.label}: {name} first call")
        entry: dict[str, Any] = {"description": DESCRIPTIONS[name]}
        entries[name] = entry
        try:
            mode = prepare(name, base, device, cache=cache)
            prepared[name] = mode
            entry["note"] = mode.note
            if name in CACHED:
                entry["cache"] = describe_cache(
                    args.cache, case.steps, threshold=args.cache_threshold, max_skip=args.cache_max_skip
                )
            measure.reset_peak(device)
            logger.info("%s: %s first call", case.label, name)
            first = measure.timed_call(mode.pipe, case, device)
            entry["first_call_s"] = first.total_s
            if name in ("eager", "eager+cache", "eager-fp8"):
                baselines[name] = first.images
            logger.info("%s: %s first call took %.2f s", case.label, name, first.total_s)
            for _ in range(args.warmup):
                measure.timed_call(mode.pipe, case, device)
            progress.update(1 + args.warmup)
            calls[name] = []
            checked[name] = mode.state_check_seconds()
            if name in CACHED:
                counters[name] = SkipCounter(mode.pipe.transformer)
        except Exception as exc:  # a peer that cannot run this case is a result, not a crash
            logger.exception("mode %s failed on %s", name, case.label)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            prepared.pop(name, None)
    order = list(calls)
    for run in range(args.runs):
        for name in order if run % 2 == 0 else order[::-1]:
            if name not in calls:
                continue
            progress.set_postfix_str(f"{case.label}: {name} run {run + 1}")
            try:
                measure.reset_peak(device)
                timing = measure.timed_call(prepared[name].pipe, case, device)
            except Exception as exc:
                logger.exception("mode %s failed on %s", name, case.label)
                entries[name]["error"] = f"{type(exc).__name__}: {exc}"
                del calls[name]
                continue
            calls[name].append((timing, measure.peak_allocated(device)))
            images.setdefault(name, timing.images)
            if baseline(name) in baselines:
                comparisons.setdefault(name, []).append(_compare(timing.images, baselines[baseline(name)]))
            if prepared[name].reference is not None:
                run_images.setdefault(name, []).append(timing.images)
            progress.update(1)
    eager_median = statistics.median(t.total_s for t, _ in calls["eager"]) if "eager" in calls else None
    cached_median = statistics.median(t.total_s for t, _ in calls["eager+cache"]) if "eager+cache" in calls else None
    for name, timings in calls.items():
        entry = entries[name]
        latencies = [t.total_s for t, _ in timings]
        entry["runs_s"] = latencies
        entry["latency_s"] = measure.summary(latencies)
        entry["stages_s"] = {
            stage: statistics.median(getattr(t, f"{stage}_s") for t, _ in timings)
            for stage in ("encode", "denoise", "decode")
        }
        entry["peak_memory_bytes"] = max(peak for _, peak in timings)
        if checked.get(name) is not None:  # the per-call check of the Python state the graphs read
            per_call = (prepared[name].state_check_seconds() - checked[name]) / len(timings)
            entry["state_check_s_per_call"] = per_call
            entry["state_check_share"] = per_call / entry["latency_s"]["median"]
        entry["speedup"] = eager_median / entry["latency_s"]["median"] if eager_median else None
        if name in CACHED:
            entry["speedup_vs_eager_cache"] = cached_median / entry["latency_s"]["median"] if cached_median else None
            counter = counters.pop(name)
            counter.remove()
            entry["cache_skipped"] = {"calls": counter.calls, "skipped": counter.skipped, "fraction": counter.fraction}
        entry["md5"] = measure.image_md5(images[name])
        entry["exact_mode"] = EXACT[name]
        entry["baseline"] = baseline(name)
        if baseline(name) != "eager" and "eager" in baselines:  # what the cache or FP8 costs in quality
            versus = _compare(images[name], baselines["eager"])
            entry["psnr_vs_eager_db"], entry["max_abs_vs_eager"] = versus["psnr_db"], versus["max_abs"]
        if comparisons.get(name):
            runs = comparisons[name]
            # every timed run against its baseline's first call; PSNR and max difference: the worst run
            entry["runs_identical"] = [run["identical"] for run in runs]
            entry["identical"] = all(entry["runs_identical"])
            entry["psnr_db"] = min(run["psnr_db"] for run in runs)
            entry["max_abs"] = max(run["max_abs"] for run in runs)
        else:  # no baseline first call to compare with (not in the group, or it failed): not compared
            entry.update(runs_identical=[], identical=None, psnr_db=float("nan"), max_abs=float("nan"))
        entry["graphs"] = prepared[name].graph_stats()
        _compare_with_reference(prepared[name], case, device, entry, run_images.get(name, []))
    for mode in prepared.values():
        mode.teardown()
    return entries


def _compare(images: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """One run's images against the reference: byte-equality, PSNR and largest difference."""
    return {
        "identical": torch.equal(images, reference),
        "psnr_db": measure.psnr(images, reference),
        "max_abs": (images.float() - reference.float()).abs().max().item(),
    }


def _compare_with_reference(
    mode: PreparedMode, case: Case, device: torch.device, entry: dict[str, Any], runs: list[torch.Tensor]
) -> None:
    """For a mode that names a reference (fast: its compiled blocks without graphs), check that every
    timed run (``runs``: their images) is byte-equal to one call of that reference."""
    if mode.reference is None:
        return
    with mode.reference():
        reference = measure.timed_call(mode.pipe, case, device).images
    entry["reference"] = mode.reference_name
    entry["runs_identical_to_reference"] = [torch.equal(images, reference) for images in runs]
    entry["identical_to_reference"] = bool(runs) and all(entry["runs_identical_to_reference"])


def _profile_case(base: Any, case: Case, args: argparse.Namespace, result: dict[str, Any]) -> None:
    for name in ("eager", "bcg", "fast"):  # the profile's prompt embeddings are precomputed: no "-te" modes
        if name not in args.modes or result["modes"].get(name, {}).get("error"):
            continue
        mode = prepare(name, base, args.device)
        try:
            result["modes"][name]["denoise_profile"] = measure.denoise_profile(mode.pipe, case, args.device)
        finally:
            mode.teardown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    pipelines = _pipeline_names(args)
    if runs.refuse_without_gpu("bench", args.weights, pipelines, runs.smoke_command(pipelines)):
        return 2
    cases = _cases(args)
    if not cases:
        print("bench: no case selected", file=sys.stderr)
        return 2
    if args.device.type == "cpu":
        print("bench: CPU run: bcg runs in debug mode (no graphs); timings are not meaningful", file=sys.stderr)
    dtype = torch.bfloat16 if args.device.type == "cuda" else None
    command = "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    record: dict[str, Any] = {
        "command": command,
        "weights": args.weights,
        "runs": args.runs,
        "environment": measure.environment(args.device),
        "modes": {name: DESCRIPTIONS[name] for name in args.modes},
        "cases": [],
    }
    by_pipeline: dict[str, list[Case]] = {}
    for case in cases:
        by_pipeline.setdefault(case.pipeline, []).append(case)
    calls_per_case = len(args.modes) + sum(1 for m in args.modes if m in SEPARATE)  # a fresh eager with each
    total = len(cases) * calls_per_case * (1 + args.warmup + args.runs)
    with _progress(total, args.no_progress) as progress:
        for phase in ("time", "profile"):
            if phase == "profile" and not args.profile:
                break
            for name, pipeline_cases in by_pipeline.items():
                started = time.perf_counter()
                base = build_pipeline(name, args.weights, device=args.device, dtype=dtype)
                base.set_progress_bar_config(disable=True)
                logger.info("built %s (%s) in %.1f s", name, args.weights, time.perf_counter() - started)
                for case in pipeline_cases:
                    if phase == "time":
                        record["cases"].append({})
                        run_case(
                            base, case, args, progress, record["cases"][-1], lambda: report.write(record, args.out)
                        )
                    elif case.profile:
                        result = next(r for r in record["cases"] if r["label"] == case.label)
                        _profile_case(base, case, args, result)
                    report.write(record, args.out)  # after every case: a cut-short run keeps what it measured
                del base
                gc.collect()
                if args.device.type == "cuda":
                    torch.cuda.empty_cache()
    paths = report.write(record, args.out)
    print(report.markdown(record))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    problems = [
        f"{case['label']}: {name}: {problem}"
        for case in record["cases"]
        for name, mode in case["modes"].items()
        if (problem := _mode_problem(name, mode)) is not None
    ]
    for problem in problems:
        print(f"bench: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _graphs_problem(graphs: dict[str, Any]) -> str | None:
    """Why a mode of ours did not run its graphs (what ``tests/_checks.assert_graphs_ran`` asserts in
    the tests), or None: they must be active, captured and replayed, with no eager fallback and no
    miss. Without that, an equality with eager compares eager with itself."""
    if not graphs.get("active"):
        return "its graphs were not active (the pipeline ran eagerly)"
    if graphs.get("captures", 0) <= 0 or graphs.get("replays", 0) <= 0:
        return (
            f"no graph was captured and replayed (captures {graphs.get('captures')}, replays {graphs.get('replays')})"
        )
    if graphs.get("eager_fallbacks", 0) or graphs.get("misses", 0):
        return f"calls ran eagerly (eager fallbacks {graphs.get('eager_fallbacks')}, misses {graphs.get('misses')})"
    return None


def _mode_problem(name: str, mode: dict[str, Any]) -> str | None:
    """Why ``mode`` fails the run's exit status, or None. Eager and our modes must run; a mode of ours
    must have run its graphs; exact modes must equal eager's first call on every timed run (eager
    too: its timed runs against that independent call), fast modes their reference on every timed
    run. A peer that fails is a result, not a failure of the run."""
    if mode.get("error"):
        return f"failed: {mode['error']}" if EXACT[name] or name in OURS else None
    if name in OURS and (problem := _graphs_problem(mode.get("graphs") or {})) is not None:
        return problem
    if EXACT[name] and mode.get("identical") is not True:
        return f"not byte-identical to {baseline(name)}'s first call on every timed run" + (
            "" if mode.get("identical") is not None else " (not compared: no eager reference)"
        )
    if not EXACT[name] and not mode.get("identical_to_reference", True):
        return f"not byte-identical to {mode.get('reference', 'its reference')} on every timed run"
    return None


def _mode_ok(name: str, mode: dict[str, Any]) -> bool:
    """Whether ``mode`` passes the run's exit status (see :func:`_mode_problem`)."""
    return _mode_problem(name, mode) is None
