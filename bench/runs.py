"""What every benchmark entry point shares before it builds anything: where a run writes by default, the refusal
to build a full-size model on a machine without a GPU, and the command-line pieces (help layout, resolutions,
devices) whose mistakes argparse reports in one line with exit status 2. Importable without torch.

A run never writes into the checkout by default: its folder is ``bench-runs/<name>-<UTC timestamp>/``
under the current directory (``/bench-runs/`` is in ``.gitignore``), and recorded results are copied to
``bench/results/<date>-<gpu>/`` by hand.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

RUNS_DIR = Path("bench-runs")
SMOKE_WEIGHTS = "tiny"  # the only weights a machine without a GPU is let build
DEFAULT_WEIGHTS = "random-full"  # python -m bench's
DEFAULT_PIPELINE = "z-image"
PIPELINES = ("qwen-image", "z-image")  # bcg_diffusion.models.PIPELINE_NAMES (not imported here: it imports diffusers)
# Pipelines the benchmark builds from the coverage check's configs (bench.published.PUBLISHED, without torch)
PUBLISHED_PIPELINES = ("flux", "flux-controlnet", "flux2-klein", "wan", "qwen-image-edit", "hunyuan-image")


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help (unless the help gives it), the description and epilog as written,
    and no line broken inside a name (``fast-no-auto``, ``bench-runs/<pipeline>-<UTC timestamp>/``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def resolution(text: str) -> tuple[int, int]:
    """An argparse type: ``WIDTHxHEIGHT``, both multiples of 16 (what both pipelines take)."""
    from .cases import check_size

    try:
        width, height = (int(v) for v in text.strip().lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"resolution {text!r} is not WIDTHxHEIGHT, e.g. 512x512") from None
    try:
        check_size(width, height)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return width, height


def resolutions(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated :func:`resolution` values, e.g. ``512x512,1024x1024``."""
    return [resolution(item) for item in text.split(",")]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in some messages
    return parse


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (checked against the machine by :func:`device_problem`)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def default_device() -> str:
    """``cuda`` if torch sees a CUDA GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_problem(name: str) -> str | None:
    """Why ``--device name`` (a :func:`device_name`) cannot run on this machine, in one line; None if it can."""
    import torch

    if not name.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return f"--device {name}: no CUDA GPU here ({build}, torch.cuda.is_available() is False); use --device cpu"
    index, count = torch.device(name).index, torch.cuda.device_count()
    if index is not None and index >= count:
        gpus = f"{count} CUDA GPU{'s' if count > 1 else ''}"
        return f"--device {name}: this machine has {gpus} (cuda:0 to cuda:{count - 1})"
    return None
