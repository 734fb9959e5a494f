"""What every benchmark entry point shares before it builds anything: where a run writes by default, and
the refusal to build a full-size model on a machine without a GPU.

A run never writes into the checkout by default: its folder is ``bench-runs/<name>-<UTC timestamp>/``
under the current directory (``/bench-runs/`` is in ``.gitignore``), and recorded results are copied to
``bench/results/<date>-<gpu>/`` by hand.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

RUNS_DIR = Path("bench-runs")
SMOKE_WEIGHTS = "tiny"  # the only weights a machine without a GPU is let build
DEFAULT_WEIGHTS = "random-full"  # python -m bench's
DEFAULT_PIPELINE = "z-image"
PIPELINES = ("qwen-image", "z-image")  # bcg_diffusion.models.PIPELINE_NAMES (not imported here: it imports diffusers)


def default_out(name: str, now: datetime.datetime | None = None) -> Path:
    """``bench-runs/<name>-<UTC timestamp>``, relative to the current directory, e.g.
    ``bench-runs/z-image-20261201T213000Z``."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return RUNS_DIR / f"{name}-{now.astimezone(datetime.timezone.utc):%Y%m%dT%H%M%SZ}"


def no_gpu_message(prog: str, weights: str, pipelines: Sequence[str], smoke: str) -> str | None:
    """Why ``weights`` cannot run here, with the CPU smoke command ``smoke`` to run instead; None when they
    can (``tiny`` weights, or a CUDA GPU that torch sees)."""
    import torch

    if weights == SMOKE_WEIGHTS or torch.cuda.is_available():
        return None
    return (
        f"{prog}: --weights {weights} means the full-size {' and '.join(pipelines)} (billions of parameters), "
        "which needs an NVIDIA GPU with CUDA, and this torch sees none (torch.cuda.is_available() is False): "
        "on a CPU it takes minutes to build and far longer per image. Nothing was built.\n"
        f"{prog}: on this machine, run the CPU smoke run instead (tiny random models, bcg in debug mode, "
        "timings not meaningful):\n"
        f"    {smoke}"
    )


def refuse_without_gpu(prog: str, weights: str, pipelines: Sequence[str], smoke: str) -> bool:
    """Print :func:`no_gpu_message` to stderr and return True if ``weights`` need a GPU this machine lacks
    (the caller then exits with status 2); False otherwise."""
    message = no_gpu_message(prog, weights, pipelines, smoke)
    if message is None:
        return False
    print(message, file=sys.stderr)
    return True


def smoke_command(pipelines: Sequence[str]) -> str:
    """``python -m bench``'s CPU smoke run of ``pipelines``."""
    return "python -m bench " + " ".join(f"--pipeline {name}" for name in pipelines) + f" --weights {SMOKE_WEIGHTS}"


class _Quiet(argparse.ArgumentParser):
    def error(self, message: str):  # leave every message about the arguments to the real parser
        raise ValueError(message)


def refuse_early(argv: Sequence[str]) -> bool:
    """``python -m bench``'s first step, before the pipelines' libraries are imported (seconds): True, with
    :func:`refuse_without_gpu`'s message printed, if ``argv`` asks for weights this machine cannot run.
    Anything it cannot tell (help, a preset's pipelines, arguments in error) is left to ``bench.cli``, which
    checks again."""
    parser = _Quiet(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS)
    parser.add_argument("--pipeline", action="append")
    parser.add_argument("--preset")
    try:
        known, _ = parser.parse_known_args(list(argv))
    except ValueError:
        return False
    if known.help or known.preset or not set(known.pipeline or ()) <= set(PIPELINES):
        return False
    pipelines = list(dict.fromkeys(known.pipeline or [DEFAULT_PIPELINE]))
    return refuse_without_gpu("bench", known.weights, pipelines, smoke_command(pipelines))
