"""Timing every mode on every case: what ``python -m bench`` runs once its arguments are checked.

Every mode runs on its own weight-sharing copy of one pipeline, in one process, on one device; the
timed runs are interleaved A/B/B/A across modes so clock or thermal drift favours none. No profiler is
attached while timing (CUPTI, once attached, slows later eager launches): the optional denoising-loop
profile runs afterwards.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from bcg_diffusion.features.step_caching import SkipCounter
from bcg_diffusion.models import RANDOM_WEIGHTS, build_pipeline

from . import measure, report
from .caching import cache_config, cachedit_options, describe_cachedit
from .caching import describe as describe_cache
from .cases import Case
from .modes import CACHED, CACHEDIT, DESCRIPTIONS, EXACT, SEPARATE, PreparedMode, baseline, parse, prepare
from .published import PUBLISHED
from .published import build as published_build

logger = logging.getLogger("bench")


class BuildError(Exception):
    """A pipeline that cannot be built from the command line's weights (not found, not a pipeline of that kind):
    a mistake on the command line, reported in one line, not a crash."""


def build(name: str, args: argparse.Namespace) -> Any:
    """Pipeline ``name`` with ``args.weights`` on ``args.device`` (bfloat16 on a GPU), its progress bar off.

    Raises BuildError for weights that cannot be loaded: an OSError (a missing path, a hub id that does not
    exist or cannot be downloaded), or a ValueError from loading a hub id or folder (not a pipeline of that
    kind). Any other failure, and any failure to build random weights, is a crash and keeps its traceback."""
    dtype = torch.bfloat16 if args.device.type == "cuda" else None
    started = time.perf_counter()
    try:
        if name in PUBLISHED:
            base = published_build(name, args.weights, args.device, args.text_encoders)
        else:
            layers = getattr(args, "layers", None)
            base = build_pipeline(name, args.weights, device=args.device, dtype=dtype, num_layers=layers)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) and args.weights in RANDOM_WEIGHTS:
            raise
        message = " ".join(str(exc).split())
        raise BuildError(f"cannot build {name} ({args.weights}) on {args.device}: {message}") from exc
    base.set_progress_bar_config(disable=True)
    logger.info("built %s (%s) in %.1f s", name, args.weights, time.perf_counter() - started)
    return base


def run(args: argparse.Namespace, record: dict[str, Any], progress: Any) -> None:
    """Time ``args.cases`` pipeline by pipeline, filling ``record["cases"]`` and writing the report to
    ``args.out`` after every case (a cut-short run keeps what it measured); then, with ``--profile``,
    profile the denoising loop of each case's modes, on a fresh build."""
    by_pipeline: dict[str, list[Case]] = {}
    for case in args.cases:
        by_pipeline.setdefault(case.pipeline, []).append(case)
    for phase in ("time", "profile"):
        if phase == "profile" and not args.profile:
            break
        for name, pipeline_cases in by_pipeline.items():
            base = build(name, args)
            for case in pipeline_cases:
                if phase == "time":
                    record["cases"].append({})
                    run_case(base, case, args, progress, record["cases"][-1], lambda: report.write(record, args.out))
                elif case.profile:
                    result = next(r for r in record["cases"] if r["label"] == case.label)
                    _profile_case(base, case, args, result)
                report.write(record, args.out)  # after every case: a cut-short run keeps what it measured
            del base
            measure.release_memory(args.device)


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
    their speed-up is over that eager, measured side by side with them. With ``--modes-apart`` (or a
    published pipeline whose modes do not fit one GPU together) every mode runs so, each group's graphs
    and copies freed before the next. Fills and returns ``result`` (a new dict if None) group by group and
    calls ``checkpoint`` after each, so a cut-short run keeps every group that finished.
    """
    result = {} if result is None else result
    apart = modes_apart(case, args)
    result.update(label=case.label, case=asdict(case), modes={}, modes_apart=apart)
    for group in groups(args.modes, apart):
        entries = _time_group(base, case, group, args, progress)
        for name, entry in entries.items():
            if name in result["modes"]:  # the second eager of a separate group
                continue
            if _alone(name, apart) and "eager" in entries:
                entry["eager_same_group_s"] = entries["eager"].get("latency_s")
            result["modes"][name] = entry
        del entries
        measure.release_memory(args.device)  # the group's pipeline copies and graphs, before the next group's
        if checkpoint is not None:
            checkpoint()
    return result


def modes_apart(case: Case, args: argparse.Namespace) -> bool:
    """Whether each mode of ``case`` runs in a group of its own beside eager: ``--modes-apart``, or a published
    pipeline that asks for it (:attr:`bench.published.PublishedCase.modes_apart`)."""
    return args.modes_apart or bool(case.published and case.published.modes_apart)


def groups(modes: list[str], apart: bool) -> list[list[str]]:
    """The groups ``modes`` are timed in, in turn: all together but the :data:`modes.SEPARATE` peers, each of
    which gets a group with eager; with ``apart``, every mode but eager a group with eager.

    >>> groups(["eager", "bcg", "compile-max"], apart=False)
    [['eager', 'bcg'], ['eager', 'compile-max']]
    >>> groups(["eager", "fast", "fast-fp8"], apart=True)
    [['eager', 'fast'], ['eager', 'fast-fp8']]
    """
    alone = [name for name in modes if _alone(name, apart)]
    together = [name for name in modes if name not in alone]
    first = [together] if together and (together != ["eager"] or not alone) else []
    return first + [["eager", name] for name in alone]


def _alone(name: str, apart: bool) -> bool:
    """Whether mode ``name`` is timed in a group of its own beside a fresh eager (see :func:`groups`)."""
    return name != "eager" and (apart or name in SEPARATE)


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

    dit_mask = getattr(args, "cachedit_mask", None)  # None: about half of the steps (bench.caching.cachedit_mask)

    def cachedit(pipe: Any) -> dict[str, Any]:
        return cachedit_options(pipe, case.steps, dit_mask)

    checked: dict[str, float | None] = {}  # per mode: the state checks' time before the timed runs
    comparisons: dict[str, list[dict[str, Any]]] = {}  # per mode, per timed run: against the reference
    run_images: dict[str, list[torch.Tensor]] = {}  # per timed run, for modes with a reference of their own
    for name in names:
        progress.set_postfix_str(f"{case.label}: {name} first call")
        entry: dict[str, Any] = {"description": DESCRIPTIONS[name]}
        entries[name] = entry
        try:
            mode = prepare(name, base, device, cache=cache, cachedit=cachedit)
            prepared[name] = mode
            entry["note"] = mode.note
            if name in CACHEDIT:
                entry["cache"] = describe_cachedit(case.steps, dit_mask)
            if name in CACHED:
                entry["cache"] = describe_cache(
                    args.cache, case.steps, threshold=args.cache_threshold, max_skip=args.cache_max_skip
                )
            measure.reset_peak(device)
            logger.info("%s: %s first call", case.label, name)
            first = measure.timed_call(mode.pipe, case, device, stage_syncs=args.stage_syncs)
            entry["first_call_s"] = first.total_s
            if name in ("eager", "eager+cache", "eager-fp8", "eager+cachedit"):
                baselines[name] = first.images
            logger.info("%s: %s first call took %.2f s", case.label, name, first.total_s)
            for _ in range(args.warmup):
                measure.timed_call(mode.pipe, case, device, stage_syncs=args.stage_syncs)
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
                timing = measure.timed_call(prepared[name].pipe, case, device, stage_syncs=args.stage_syncs)
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
    dit_median = (
        statistics.median(t.total_s for t, _ in calls["eager+cachedit"]) if "eager+cachedit" in calls else None
    )
    for name, timings in calls.items():
        entry = entries[name]
        latencies = [t.total_s for t, _ in timings]
        entry["runs_s"] = latencies
        entry["latency_s"] = measure.summary(latencies)
        entry["stages_s"] = {
            stage: statistics.median(getattr(t, f"{stage}_s") for t, _ in timings)
            for stage in ("encode", "denoise", "decode")
        }
        entry["denoise_per_step_s"] = entry["stages_s"]["denoise"] / case.steps
        entry["peak_memory_bytes"] = max(peak for _, peak in timings)
        if checked.get(name) is not None:  # the per-call check of the Python state the graphs read
            per_call = (prepared[name].state_check_seconds() - checked[name]) / len(timings)
            entry["state_check_s_per_call"] = per_call
            entry["state_check_share"] = per_call / entry["latency_s"]["median"]
        entry["speedup"] = eager_median / entry["latency_s"]["median"] if eager_median else None
        if name in CACHEDIT:
            entry["speedup_vs_eager_cache"] = dit_median / entry["latency_s"]["median"] if dit_median else None
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
        if "transformer_captures" in entry["graphs"]:  # per pipeline call: first, warm-ups and timed runs
            made = 1 + args.warmup + len(timings)
            entry["graphs"]["transformer_captures_per_call"] = entry["graphs"]["transformer_captures"] / made
        _compare_with_reference(prepared[name], case, device, entry, run_images.get(name, []))
    _tear_down(prepared, entries, case.label, device)
    return entries


def _tear_down(prepared: dict[str, Any], entries: dict[str, dict[str, Any]], label: str, device: torch.device) -> None:
    """Tear every mode of ``prepared`` down (a failure noted in its entry: the group's timings stand), each
    one's pipeline copy let go, and its memory freed, before the next: a teardown may move weights back to the
    GPU (``restore`` dequantizes an FP8 transformer), and two restored copies of Wan 2.1's 14B transformer
    beside the modes not yet torn down did not fit an 80 GB GPU (runs 230 and 231)."""
    while prepared:
        name = next(iter(prepared))
        mode = prepared.pop(name)
        try:
            mode.teardown()
        except Exception as exc:
            logger.exception("mode %s: tearing it down failed on %s; its timings above stand", name, label)
            entries[name]["teardown_error"] = f"{type(exc).__name__}: {exc}"
        del mode
        measure.release_memory(device)


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


def profiled(name: str) -> bool:
    """Whether ``--profile`` profiles mode ``name``: eager and every mode of ours or a peer's that its name alone sets
    up, but not those with a step cache (its config comes with the timed runs), with text encoders named (``-te``:
    the profile passes prompt embeddings, so it would time nothing of theirs) or in :data:`SEPARATE` (graphs of
    their own, run apart)."""
    options = parse(name)
    return not (options.cache or options.cachedit or options.base in ("bcg-te", "fast-te") or name in SEPARATE)


def _profile_case(base: Any, case: Case, args: argparse.Namespace, result: dict[str, Any]) -> None:
    skipped = [name for name in args.modes if not profiled(name)]
    if skipped:
        logger.info("%s: --profile leaves out %s (see bench.timing.profiled)", case.label, ", ".join(skipped))
    for name in args.modes:
        if not profiled(name) or result["modes"].get(name, {}).get("error"):
            continue
        mode = prepare(name, base, args.device)
        try:
            result["modes"][name]["denoise_profile"] = measure.denoise_profile(mode.pipe, case, args.device)
        finally:
            mode.teardown()
