"""Coverage of diffusers transformer pipelines beyond the two we tune: does ``accelerate`` hold them?

The pipelines are :mod:`bench.coverage_models`'s, built with random weights from the installed
diffusers' own classes. ``TINY`` configs run on a CPU in debug mode (:func:`check_tiny`): the runner path,
equality with eager, what a capture would meet outside the eager breaks (``hostile_ops``,
:mod:`bcg_diffusion.core.hostile`) and the models no runner holds. ``FULL`` gives the same pipelines at
their published sizes (each config written from its checkpoint's config.json, random bfloat16 weights
made on the device) for the GPU columns: :func:`check` times eager, exact and fast at a launch-bound
and a GPU-bound size and reports what was captured, its segments and breaks, and equality.

    python -m bench.coverage                                    # tiny, CPU, debug mode: a Markdown table
    python -m bench.coverage --size full --device meta          # published configs: parameter counts
    python -m bench.coverage --size full --device cuda --out DIR  # published sizes on a GPU: timings
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats

from .coverage_models import FULL, TINY, Size
from .measure import environment, synchronize
from .runs import HelpFormatter, at_least, default_out, device_name

logger = logging.getLogger(__name__)


# Checks.


def _call(pipe: Any, inputs: dict[str, Any], steps: int = 2, device: torch.device | str = "cpu") -> torch.Tensor:
    """One call at ``inputs`` (32x32 unless they name a size), ``steps`` steps, seed 0: the output tensor
    (images, or frames for video pipelines). Tensors in ``inputs`` are cloned, so a pipeline that writes
    into one cannot change the next call."""
    kwargs = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    out = pipe(
        **{"height": 32, "width": 32, **kwargs},
        num_inference_steps=steps,
        output_type="pt",
        generator=torch.Generator(device).manual_seed(0),
    )
    return out.images if hasattr(out, "images") else out.frames  # video pipelines return frames


@contextlib.contextmanager
def _quiet_generic_adapter() -> Iterator[None]:
    """``accelerate``'s "no adapter for ...: using the generic one" warning: the generic adapter is what is tested."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has no adapter", category=BCGWarning)
        yield


def _not_accelerated(pipe: Any, report: dict[str, Any]) -> list[str]:
    """The pipeline's models that no runner holds, the eager text encoders aside (none are built here)."""
    return [
        name
        for name, component in pipe.components.items()
        if isinstance(component, nn.Module) and name not in report["components"] and not name.startswith("text_")
    ]


def check_tiny(name: str) -> dict[str, Any]:
    """Build ``name``'s tiny pipeline on the CPU, compare debug mode with eager over two calls, and
    report the runner's state, what a capture would meet, and the models left eager."""
    torch.manual_seed(0)
    pipe, embeds = TINY[name]()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        reference = _call(pipe, embeds)
        with _quiet_generic_adapter():
            accelerate(pipe, debug=True)
        try:
            images = [_call(pipe, embeds) for _ in range(2)]
            report = stats(pipe)
        finally:
            restore(pipe)
    hostile = sorted({op for s in report["signatures"] for op in s["hostile_ops"] or []})
    return {
        "pipeline": name,
        "class": type(pipe).__name__,
        "adapter": report["adapter"],
        "active": report["active"],
        "reason": report["reason"],
        "identical": all(torch.equal(image, reference) for image in images),
        "signatures": len(report["signatures"]),
        "replays": report["replays"],
        "hostile_ops": hostile,
        "not_accelerated": _not_accelerated(pipe, report),
    }


def parameter_counts(pipe: Any) -> dict[str, int]:
    """Parameters per model component of ``pipe`` (shared tensors counted once per component)."""
    return {
        name: sum(p.numel() for p in component.parameters())
        for name, component in pipe.components.items()
        if isinstance(component, nn.Module)
    }


def _timed(pipe: Any, inputs: dict[str, Any], steps: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """One call with the device synchronised on both sides: its output, on the CPU, and its wall time."""
    synchronize(device)
    start = time.perf_counter()
    output = _call(pipe, inputs, steps, device)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return output.cpu(), elapsed


def _measure(pipe: Any, inputs: dict[str, Any], steps: int, device: torch.device, runs: int) -> dict[str, Any]:
    """A first call, then ``runs`` timed ones: their latencies (``latency_s``: the median) and outputs."""
    first, first_s = _timed(pipe, inputs, steps, device)
    outputs, times = zip(*(_timed(pipe, inputs, steps, device) for _ in range(runs)))
    return {
        "first_call_s": first_s,
        "latency_s": statistics.median(times),
        "runs_s": list(times),
        "outputs": [first, *outputs],
    }


def _graphs(report: dict[str, Any]) -> dict[str, Any]:
    """What ``stats`` says about the captures: counters and, per signature, its status, segments and breaks
    (``auto_breaks``: those the capture made by itself, :mod:`bcg_diffusion.core.auto_breaks`; ``constants``: tensors
    from Python data it holds, :mod:`bcg_diffusion.core.python_data`)."""
    keys = ("component", "status", "segments", "breaks", "auto_breaks", "constants", "reason", "hostile_ops")
    keys += ("replays",)
    signatures = [{key: record.get(key) for key in (*keys, "signature")} for record in report["signatures"]]
    counters = ("active", "reason", "captures", "replays", "eager_fallbacks", "graph_memory_bytes", "capture_seconds")
    counters += ("compiled_blocks", "compile_failure")
    return {key: report[key] for key in counters} | {"signatures": signatures}


def _exact(pipe: Any, inputs: dict[str, Any], steps: int, device: torch.device, runs: int) -> dict[str, Any]:
    """``accelerate(pipe)`` (debug mode off CUDA): its timings, stats, and the models it leaves eager."""
    with _quiet_generic_adapter():
        accelerate(pipe, debug=device.type != "cuda")
    try:
        result = _measure(pipe, inputs, steps, device, runs)
        report = stats(pipe)
        return result | {"graphs": _graphs(report), "not_accelerated": _not_accelerated(pipe, report)}
    finally:
        restore(pipe)


def _fast(pipe: Any, inputs: dict[str, Any], steps: int, device: torch.device, runs: int) -> dict[str, Any]:
    """``accelerate(pipe, mode="fast")``: its timings and stats, and under ``bcg_diffusion.eager(pipe)``
    (its compiled blocks without graphs, what fast mode must equal) the same calls again (``reference``)."""
    with _quiet_generic_adapter():
        accelerate(pipe, mode="fast", debug=device.type != "cuda")
    try:
        result = _measure(pipe, inputs, steps, device, runs)
        result["graphs"] = _graphs(stats(pipe))
        with eager(pipe):
            result["reference"] = _measure(pipe, inputs, steps, device, runs)
        return result
    finally:
        restore(pipe)
        torch._dynamo.reset()


def _same(outputs: list[torch.Tensor], reference: torch.Tensor) -> bool:
    return all(torch.equal(output, reference) for output in outputs)


def _check_case(
    pipe: Any, inputs: dict[str, Any], steps: int, device: torch.device, runs: int, modes: tuple[str, ...]
) -> dict[str, Any]:
    """Eager, then each of ``modes`` ("exact", "fast") on one size; a mode that fails is recorded with its error.

    Exact is ``identical`` when its every call equals eager's first; fast when its every call equals its
    reference's first (its compiled blocks without graphs). ``deterministic``: eager's calls equal each other.
    """
    case: dict[str, Any] = {"eager": _measure(pipe, inputs, steps, device, runs)}
    baseline = case["eager"]["outputs"][0]
    case["eager"]["deterministic"] = _same(case["eager"]["outputs"], baseline)
    for mode, run in (("exact", _exact), ("fast", _fast)):
        if mode not in modes:
            continue
        logger.info("%s mode", mode)
        try:
            result = run(pipe, inputs, steps, device, runs)
        except Exception as exc:  # a pipeline a mode cannot run is a result, not a crash
            logger.exception("%s mode failed", mode)
            case[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if mode == "fast":
            reference = result["reference"]["outputs"][0]
            result["reference"]["deterministic"] = _same(result["reference"]["outputs"], reference)
        else:
            reference = baseline
        result["identical"] = _same(result["outputs"], reference)
        result["speedup"] = case["eager"]["latency_s"] / result["latency_s"]
        case[mode] = result
    for result in case.values():  # outputs are compared: not written out
        result.pop("outputs", None)
        result.get("reference", {}).pop("outputs", None)
    return case


def _build(name: str, size: str, device: torch.device) -> tuple[Any, list[tuple[str, dict[str, Any]]]]:
    """``name``'s pipeline at ``size`` on ``device``, and its calls: one per call size, labelled.

    Tiny pipelines are built on the CPU in float32 and moved to ``device``, with their one 32x32 call.
    """
    if size == "full":
        spec = FULL[name]
        pipe = spec.build(device)
        cases = [(f"{s.label} {_label(s)}", spec.inputs(device, s)) for s in spec.sizes]
        return pipe, cases
    torch.manual_seed(0)
    pipe, inputs = TINY[name]()
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    return pipe.to(device), [("tiny 32x32", inputs)]


def _label(size: Size) -> str:
    return f"{size.width}x{size.height}" + (f"x{size.frames}" if size.frames else "")


def check(
    name: str,
    size: str = "tiny",
    device: str | torch.device = "cpu",
    *,
    steps: int | None = None,
    runs: int = 3,
    modes: tuple[str, ...] = ("exact", "fast"),
) -> dict[str, Any]:
    """Build ``name`` at ``size`` ("tiny" or "full", the published configs) on ``device`` and, at each of
    its call sizes, time eager and each of ``modes``: ``runs`` calls after a first one, each synchronised.

    Returns the pipeline's class, checkpoint, parameter counts and build time, and per call size each
    mode's first-call and median latency, its speed-up over eager, whether it is ``identical`` (exact:
    to eager; fast: to its compiled blocks without graphs), its graphs (``stats``: captured or not,
    segments and breaks per signature, hostile ops) and the models it left eager. Off CUDA the runner
    is in debug mode (no graphs; timings not meaningful). The pipeline is freed before returning.
    """
    device = torch.device(device)
    steps = steps or (4 if size == "full" else 2)
    start = time.perf_counter()
    pipe, cases = _build(name, size, device)
    pipe.set_progress_bar_config(disable=True)
    synchronize(device)
    result: dict[str, Any] = {
        "pipeline": name,
        "class": type(pipe).__name__,
        "size": size,
        "checkpoint": FULL[name].checkpoint if size == "full" else None,
        "parameters": parameter_counts(pipe),
        "build_s": time.perf_counter() - start,
        "steps": steps,
        "runs": runs,
        "cases": {},
    }
    try:
        with torch.no_grad():
            for label, inputs in cases:
                logger.info("%s, %s", name, label)
                result["cases"][label] = _check_case(pipe, inputs, steps, device, runs, modes)
    finally:
        del pipe, cases
        _free(device)
    return result


def _free(device: torch.device) -> None:
    """Release what the last pipeline held before the next is built (one 20-30B model at a time)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# Tables and the command line.


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def debug_table(rows: list[dict[str, Any]]) -> str:
    """:func:`check_tiny` rows as the Markdown table of ``docs/coverage.md``'s CPU section."""
    lines = [
        "| pipeline | class | runner active | identical to eager (debug) | a capture would meet | left eager |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = "; ".join(row["hostile_ops"]) or "nothing outside the breaks"
        active = "yes" if row["active"] else f"no: {row['reason']}"
        identical = "yes" if row["identical"] else "**no**"
        eager_models = ", ".join(row["not_accelerated"]) or "nothing"
        lines.append(f"| {row['pipeline']} | {row['class']} | {active} | {identical} | {met} | {eager_models} |")
    return "\n".join(lines)


def parameter_table(names: list[str]) -> str:
    """Each published config built on ``meta``: its checkpoint and parameter counts."""
    lines = ["| pipeline | checkpoint | class | transformer(s) | VAE | all models |", "|---|---|---|---|---|---|"]
    for name in names:
        pipe = FULL[name].build(torch.device("meta"))
        counts = parameter_counts(pipe)
        transformers = " + ".join(_count(n) for key, n in counts.items() if key.startswith("transformer"))
        lines.append(
            f"| {name} | {FULL[name].checkpoint} | {type(pipe).__name__} | {transformers} | "
            f"{_count(counts.get('vae', 0))} | {_count(sum(counts.values()))} |"
        )
    return "\n".join(lines)


def _captured(graphs: dict[str, Any]) -> str:
    if not graphs["active"]:
        return f"no: {graphs['reason']}"
    signatures = graphs["signatures"]
    failed = [s for s in signatures if s["status"] == "failed"]
    if not failed:
        return "debug (no graphs)" if any(s["status"] == "debug" for s in signatures) else "yes"
    reasons = "; ".join(sorted({f"{s['component']}: {s['reason']}" for s in failed}))
    return f"{len(signatures) - len(failed)} of {len(signatures)} signatures ({reasons})"


def _mode_cells(mode: dict[str, Any] | None) -> tuple[str, str]:
    """(identical, latency with speed-up) of one mode's result; dashes if it did not run."""
    if mode is None:
        return "-", "-"
    if "error" in mode:
        return "error", f"error: {mode['error']}"
    return ("yes" if mode["identical"] else "**no**"), f"{mode['latency_s']:.3f} ({mode['speedup']:.2f}x)"


def timing_table(results: list[dict[str, Any]]) -> str:
    """:func:`check` results as the Markdown table of ``docs/coverage.md``'s GPU section."""
    lines = [
        "| pipeline | size | captured (exact) | segments/breaks per signature | exact = eager | "
        "fast = its compiled blocks | eager s | exact s | fast s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['pipeline']} | - | error: {result['error']} |" + " - |" * 7)
        for label, case in result["cases"].items():
            exact, fast = case.get("exact"), case.get("fast")
            graphs = exact.get("graphs") if exact else None
            captured = _captured(graphs) if graphs else "-"
            layout = (
                ", ".join(f"{s['component']} {s['segments']}/{s['breaks']}" for s in graphs["signatures"])
                if graphs
                else "-"
            )
            notes = sorted({op for s in graphs["signatures"] for op in s["hostile_ops"] or []}) if graphs else []
            made = sorted({b for s in graphs["signatures"] for b in s["auto_breaks"] or []}) if graphs else []
            if made:
                notes.append("automatic breaks: " + ", ".join(made))
            held = sorted({c for s in graphs["signatures"] for c in s.get("constants") or []}) if graphs else []
            if held:
                notes.append("graph constants: " + ", ".join(held))
            if exact and exact.get("not_accelerated"):
                notes.append("left eager: " + ", ".join(exact["not_accelerated"]))
            if fast and fast.get("graphs", {}).get("compile_failure"):
                notes.append(f"fast: {fast['graphs']['compile_failure']}")
            (exact_same, exact_s), (fast_same, fast_s) = _mode_cells(exact), _mode_cells(fast)
            lines.append(
                f"| {result['pipeline']} | {label} | {captured} | {layout} | {exact_same} | {fast_same} | "
                f"{case['eager']['latency_s']:.3f} | {exact_s} | {fast_s} | {'; '.join(notes) or '-'} |"
            )
    return "\n".join(lines)


def _problem(result: dict[str, Any]) -> bool:
    """Whether a :func:`check` result has a mode that failed or is not identical to what it must equal."""
    modes = [case[mode] for case in result["cases"].values() for mode in ("exact", "fast") if mode in case]
    return "error" in result or any("error" in mode or not mode["identical"] for mode in modes)


def _write(out: Path, record: dict[str, Any], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / "coverage.md").write_text(table + "\n")


def _device(text: str) -> str:
    return text if text == "meta" else device_name(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.coverage", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--pipelines", default=",".join(TINY), help="comma-separated, from " + ", ".join(TINY))
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="tiny configs or published ones")
    parser.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="cpu (tiny: the debug-mode table), cuda or cuda:N (timings) or meta (published sizes)",
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=None, help="denoising steps per call (default: 2 tiny, 4 full)"
    )
    parser.add_argument("--runs", type=at_least(1), default=3, help="timed calls per mode, after a first one")
    parser.add_argument("--modes", default="exact,fast", help="comma-separated, from exact, fast (eager always runs)")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for coverage.json and coverage.md (default: none for the tiny CPU table and --device meta, "
        "which only print; else bench-runs/coverage-<size>-<UTC timestamp>/)",
    )
    args = parser.parse_args(argv)
    args.pipelines = args.pipelines.split(",")
    args.modes = tuple(args.modes.split(",")) if args.modes else ()
    unknown = [name for name in args.pipelines if name not in TINY] + [
        m for m in args.modes if m not in ("exact", "fast")
    ]
    if unknown:
        parser.error(f"unknown pipelines or modes: {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "meta":
        print(parameter_table(args.pipelines))
        return 0
    if args.size == "tiny" and device.type == "cpu":
        rows = [check_tiny(name) for name in args.pipelines]
        table = debug_table(rows)
        print(table)
        if args.out is not None:
            _write(args.out, {"environment": environment(device), "rows": rows}, table)
        return 0 if all(row["identical"] for row in rows) else 1
    if args.size == "full" and device.type != "cuda":
        print("bench.coverage: --size full needs --device cuda (or meta, for parameter counts only)", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.coverage: --device cuda, but this torch sees no CUDA GPU; nothing was built", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # a long run's progress
    out = args.out or default_out(f"coverage-{args.size}")
    record: dict[str, Any] = {"environment": environment(device), "results": []}
    for name in args.pipelines:
        try:
            result = check(name, args.size, device, steps=args.steps, runs=args.runs, modes=args.modes)
        except Exception as exc:  # one pipeline that cannot be built or run eagerly (out of memory) is a result
            logger.exception("%s failed", name)
            result = {"pipeline": name, "size": args.size, "error": f"{type(exc).__name__}: {exc}", "cases": {}}
            _free(device)
        record["results"].append(result)
        _write(out, record, timing_table(record["results"]))  # after each pipeline: a cut-short run keeps them
    print(timing_table(record["results"]))
    print(f"written to {out}", file=sys.stderr)
    return 1 if any(_problem(result) for result in record["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
