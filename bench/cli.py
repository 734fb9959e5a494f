"""``python -m bench``: end-to-end latency of bcg-diffusion against eager and its peers, side by side.

    python -m bench --pipeline z-image --weights random-full --resolutions 512x512,1024x1024 --steps 8
    python -m bench --preset two-sizes --pipeline qwen-image --weights random-full --out bench/results/qwen
    python -m bench --pipeline z-image --weights tiny   # the CPU smoke run (tiny random models)
    python -m bench --pipeline flux --modes eager,fast,fast-fp8   # FLUX.1-dev 1024², 28 steps (bench.published)

This module is the command line: it imports neither torch nor diffusers until the arguments are parsed, so
``--help`` and a mistake in the arguments answer at once. A mistake, including one found after parsing (a
``--device`` this machine lacks, weights that cannot be loaded), is argparse's usage and one line, exit status
2; a crash in the middle of a run keeps its traceback. :mod:`bench.timing` does the timing.

Results go to ``--out``, by default ``bench-runs/<pipeline>-<UTC timestamp>/`` under the current directory
(ignored by git: a run never writes into the checkout unless told to). Weights other than ``tiny`` need a
CUDA GPU: without one the run stops before building anything, says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import shlex
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import runs
from .caching import CACHES
from .cases import PRESET_ALIASES, PRESETS, PROMPT_SET_NAMES, Case
from .catalog import (
    ABLATIONS,
    CACHED,
    CACHEDIT,
    CPU_DEFAULT_MODES,
    DEFAULT_MODES,
    DESCRIPTIONS,
    EXACT,
    FP8_MODES,
    MODES,
    OURS,
    PUBLISHED_DEFAULT_MODES,
    SUMMARIES,
    USER_MODES,
    baseline,
)

logger = logging.getLogger("bench")

DESCRIPTION = (
    "End-to-end latency of bcg-diffusion's modes against eager diffusers and its peers, side by side, on one "
    "device: per mode and case, latency, time per stage, first call, memory, and whether the images are the same."
)
EXAMPLES = [
    ("python -m bench --pipeline z-image --weights tiny", "the CPU smoke run: timings not meaningful"),
    ("python -m bench --pipeline z-image --weights random-full", "every default mode on a GPU, no download"),
    ("python -m bench --preset two-sizes --pipeline qwen-image --weights random-full", ""),
    ("python -m bench --pipeline qwen-image --weights Qwen/Qwen-Image --modes eager,fast", "real weights"),
]


def _modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no mode given; choose from {', '.join(USER_MODES)} (--list-modes: all)")
    unknown = [m for m in names if m not in MODES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], MODES, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(unknown)}{hint} (--list-modes lists them all)")
    return list(dict.fromkeys(names))


def _mask(text: str) -> str:
    if not text or set(text) - {"0", "1"}:
        raise argparse.ArgumentTypeError(f"a Cache-DiT mask is a string of 0s and 1s such as 0101, got {text!r}")
    return text


def _preset(text: str) -> str:
    name = PRESET_ALIASES.get(text, text)
    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose from {', '.join(PRESETS)} (see --help)")
    return name


def _width() -> int:
    """The help's line width: argparse's own (the terminal's, or ``$COLUMNS``, less 2), at least 60."""
    return max(60, shutil.get_terminal_size().columns - 2)


def _listing(title: str, rows: list[tuple[str, str]], width: int) -> list[str]:
    """``title:`` then one entry per row: its name, and its text wrapped under a hanging indent."""
    lines = [f"{title}:"]
    for name, text in rows:
        first = f"  {name:<16} " if len(name) <= 16 else f"  {name} "
        wrapped = textwrap.wrap(text, width, initial_indent=first, subsequent_indent=" " * 19, break_on_hyphens=False)
        lines += wrapped or [first.rstrip()]
    return lines + [""]


def _epilog() -> str:
    """The modes a user picks, one line each, the presets with their cases, and examples: all taken from
    :mod:`bench.catalog` and :mod:`bench.cases`. ``--list-modes`` lists every mode (:func:`mode_listing`)."""
    width = _width()
    lines = _listing("modes (--modes)", [(name, SUMMARIES[name]) for name in USER_MODES], width)
    others = len(MODES) - len(USER_MODES)
    lines += [f"  and {others} more (ablations, kernel variants): --list-modes lists and describes them all", ""]
    presets = [(name, "; ".join(case.label for case in cases)) for name, cases in PRESETS.items()]
    lines += _listing("presets (--preset)", presets, width)
    lines += ["examples:"] + [f"  {command}" + (f"   # {note}" if note else "") for command, note in EXAMPLES]
    return "\n".join(lines)


def mode_listing() -> str:
    """Every mode with its full description, grouped as the defaults group them, each once."""
    width = _width()
    groups = [
        ("modes a GPU run compares by default", DEFAULT_MODES),
        ("modes that leave out one thing our defaults add (ablations)", ABLATIONS),
        ("modes with a step cache (--cache), compared with eager+cache", CACHED),
        ("modes with the transformer's linears in FP8, compared with eager-fp8", FP8_MODES),
        ("modes with Cache-DiT (--cachedit-mask), compared with eager+cachedit", CACHEDIT),
    ]
    lines: list[str] = []
    listed: set[str] = set()
    for title, names in groups:
        fresh = [name for name in names if name not in listed]
        listed.update(fresh)
        lines += _listing(title, [(name, DESCRIPTIONS[name]) for name in fresh], width)
    rest = [name for name in MODES if name not in listed]
    if rest:
        lines += _listing("other modes", [(name, DESCRIPTIONS[name]) for name in rest], width)
    return "\n".join(lines)


class _ListModes(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        print(mode_listing())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench``'s parser; building it imports neither torch nor diffusers."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        usage="%(prog)s [-h] [options]",
        description=textwrap.fill(DESCRIPTION, _width()),
        epilog=_epilog(),
        formatter_class=runs.HelpFormatter,
    )
    parser.add_argument(
        "--preset",
        type=_preset,
        metavar="NAME",
        help="run a preset's cases (listed below) instead of one per --pipeline and --resolutions; it sets the "
        "steps, guidance, batch and prompts; with --pipeline, only that pipeline's cases (default: none)",
    )
    parser.add_argument(
        "--pipeline",
        choices=runs.PIPELINES + runs.PUBLISHED_PIPELINES,
        action="append",
        help=f"repeatable (default: the preset's pipelines, else {runs.DEFAULT_PIPELINE})",
    )
    parser.add_argument(
        "--weights",
        default=runs.DEFAULT_WEIGHTS,
        help=f"{runs.SMOKE_WEIGHTS} (small random models, fine on a CPU), random-full (the real architectures "
        "with random weights, built on the GPU, no download), a hub id or a local path",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="random-full only: keep every width but only this many layers of the transformer and text encoder "
        "(what a CPU can build: the per-call costs of full-width modules, the state check's among them)",
    )
    parser.add_argument(
        "--device",
        type=runs.device_name,
        help="cpu, cuda or cuda:N (default: cuda if torch sees a CUDA GPU, else cpu)",
    )
    parser.add_argument(
        "--resolutions",
        type=runs.resolutions,
        metavar="WxH[,WxH...]",
        help="image sizes, multiples of 16 (default: 512x512; flux, flux-controlnet, flux2-klein, qwen-image-edit "
        "1024x1024; wan 832x480; hunyuan-image 2048x2048)",
    )
    parser.add_argument(
        "--text-encoders",
        action="store_true",
        help="flux, flux2-klein, wan: build the pipeline's text encoders (random weights) and encode a prompt in "
        "every call, as a user's call does, instead of feeding random prompt embeddings",
    )
    parser.add_argument(
        "--frames", type=runs.at_least(1), help="wan: frames per video (default: 81, as published at 480p)"
    )
    parser.add_argument(
        "--steps",
        type=runs.at_least(2),
        help="denoising steps (default: 8; flux and flux-controlnet 28, flux2-klein 4, wan 3 of its 40, "
        "qwen-image-edit 8, hunyuan-image 8 of its 50)",
    )
    parser.add_argument(
        "--guidance",
        type=float,
        help="Qwen-Image's true_cfg_scale (CFG above 1) / Z-Image's guidance_scale (CFG above 0) / the "
        "pipeline's own guidance for the others (default: 0; flux and flux-controlnet 3.5, distilled; flux2-klein "
        "1.0; wan 5.0, CFG; qwen-image-edit 4.0, true CFG; hunyuan-image 3.5, its guider's, fixed)",
    )
    parser.add_argument("--batch", type=runs.at_least(1), default=1, help="prompts per call")
    parser.add_argument(
        "--prompts",
        choices=PROMPT_SET_NAMES,
        default="short",
        help="built-in prompts; mixed: two of different lengths (Qwen-Image's masked path)",
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        metavar="MODE[,MODE...]",
        help="comma-separated, from the modes below or --list-modes (default on a GPU: "
        f"{','.join(DEFAULT_MODES)}; for the published pipelines (flux, wan...): "
        f"{','.join(PUBLISHED_DEFAULT_MODES)}; "
        f"on a CPU: {','.join(CPU_DEFAULT_MODES)})",
    )
    parser.add_argument(
        "--list-modes", nargs=0, action=_ListModes, help="list every mode with what it runs, and exit (default: off)"
    )
    parser.add_argument("--cache", choices=CACHES, default="magcache", help="the step cache of the +cache modes")
    parser.add_argument("--cache-threshold", type=float, default=0.2, help="FirstBlockCache's threshold")
    parser.add_argument(
        "--cache-max-skip",
        type=runs.at_least(0),
        default=2,
        help="MagCache: steps skipped in a row; TaylorSeer: steps between computes - 1",
    )
    parser.add_argument(
        "--cachedit-mask",
        type=_mask,
        metavar="0101...",
        help="the +cachedit modes' static computation mask (1: compute, 0: reuse), repeated to the step count "
        "(default: about half of the steps, the first tenth computed)",
    )
    parser.add_argument(
        "--runs", type=runs.at_least(1), default=5, help="timed runs per mode (median, min, max reported)"
    )
    parser.add_argument(
        "--warmup", type=runs.at_least(0), default=1, help="untimed runs per mode after the first call"
    )
    parser.add_argument(
        "--modes-apart",
        action="store_true",
        help="time each mode in a group of its own beside a fresh eager, the group's graphs and copies freed "
        "before the next: for a model whose modes do not fit the GPU together (hunyuan-image's default); by "
        "default the modes are timed in turns in one group",
    )
    parser.add_argument(
        "--stage-syncs",
        action="store_true",
        help="synchronise the GPU at each stage boundary (encode, denoise, decode) inside the timed calls; by "
        "default the stages are CUDA events and nothing inside a call waits for the GPU",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the denoising loop, after the timed runs (kernel time on a GPU)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FOLDER",
        help="where results.json, results.md and results.png go (default: bench-runs/<pipeline>-<UTC timestamp>/)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The arguments, checked: cases (``args.cases``), a device this machine has (``args.device``, a
    ``torch.device``; torch is imported once parsing is done), the modes and the output folder. A mistake ends
    the process through ``parser.error``: usage, one line, exit status 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        args.cases = _cases(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.cases:
        parser.error(f"--preset {args.preset} has no case for --pipeline {' or '.join(args.pipeline)}")
    if args.layers is not None and (args.weights != "random-full" or args.layers < 1):
        parser.error(f"--layers takes a positive number of layers, with --weights random-full (got {args.layers})")
    args.device = args.device or runs.default_device()
    if (problem := runs.device_problem(args.device)) is not None:
        parser.error(problem)
    import torch

    args.device = torch.device(args.device)
    if args.modes is None:
        published = all(case.published is not None for case in args.cases)
        gpu_modes = PUBLISHED_DEFAULT_MODES if published else DEFAULT_MODES
        args.modes = list(gpu_modes if args.device.type == "cuda" else CPU_DEFAULT_MODES)
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
    return [case for name in args.pipeline or [runs.DEFAULT_PIPELINE] for case in _pipeline_cases(name, args)]


def _pipeline_cases(name: str, args: argparse.Namespace) -> list[Case]:
    """One case per resolution of pipeline ``name``, with the options given, else its defaults."""
    if name not in runs.PUBLISHED_PIPELINES:
        if args.frames is not None:
            raise ValueError(f"--frames is for wan, not {name}")
        if args.text_encoders:
            raise ValueError(f"--text-encoders is for the published pipelines; {name} always encodes its prompts")
        steps, guidance = args.steps or 8, 0.0 if args.guidance is None else args.guidance
        return [
            Case(name, height, width, steps, guidance, args.batch, args.prompts)
            for width, height in args.resolutions or [(512, 512)]
        ]
    from .published import PUBLISHED

    spec = PUBLISHED[name]
    if args.frames is not None and spec.frames is None:
        raise ValueError(f"--frames is for the video pipelines (wan), not {name}")
    frames = args.frames or spec.frames
    if spec.guidance_argument is None and args.guidance not in (None, spec.guidance):
        raise ValueError(f"--guidance: {name}'s guider holds its guidance ({spec.guidance:g}); the call cannot set it")
    steps, guidance = args.steps or spec.steps, spec.guidance if args.guidance is None else args.guidance
    weights = "tiny" if args.weights == runs.SMOKE_WEIGHTS else args.weights
    return [
        Case(
            name,
            height,
            width,
            steps,
            guidance,
            args.batch,
            args.prompts,
            frames=frames,
            weights=weights,
            text_encoders=args.text_encoders,
        )  # fmt: skip
        for width, height in args.resolutions or [(spec.width, spec.height)]
    ]


def _progress(total: int, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="call", disable=disable, file=sys.stderr)


@contextlib.contextmanager
def _logs_above(progress: Any) -> Iterator[None]:
    """Log lines, and warnings (through logging), print above the progress bar: tqdm's handler takes the place
    of the console handlers while the bar is on, clearing the bar, printing the line and drawing the bar again."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    logging.captureWarnings(True)
    try:
        with logging_redirect_tqdm(tqdm_class=type(progress)):
            yield
    finally:
        logging.captureWarnings(False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(argv, parser)
    pipelines = _pipeline_names(args)
    weights = "tiny" if args.layers is not None else args.weights  # reduced depth: a CPU can build it
    if runs.refuse_without_gpu("bench", weights, pipelines, runs.smoke_command(pipelines)):
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    if args.device.type == "cpu":
        print("bench: CPU run: bcg runs in debug mode (no graphs); timings are not meaningful", file=sys.stderr)
    from . import measure, report, timing  # torch, diffusers and bcg_diffusion: seconds, once the arguments are good

    command = "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    record: dict[str, Any] = {
        "command": command,
        "weights": args.weights if args.layers is None else f"{args.weights}, {args.layers} layer(s)",
        "runs": args.runs,
        "stage_syncs": args.stage_syncs,
        "environment": measure.environment(args.device),
        "modes": {name: DESCRIPTIONS[name] for name in args.modes},
        "cases": [],
    }
    total = 0
    for case in args.cases:
        modes_in_groups = timing.groups(args.modes, timing.modes_apart(case, args))
        total += sum(len(group) for group in modes_in_groups) * (1 + args.warmup + args.runs)
    try:
        with _progress(total, args.no_progress) as progress, _logs_above(progress):
            timing.run(args, record, progress)
    except timing.BuildError as exc:  # after the bar is closed: the message starts a line of its own
        parser.error(str(exc))
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
