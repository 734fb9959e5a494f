"""Record one demo generation to a folder, and serve it again on the demo page.

The GPU machine this project measures on has no browser, so a screenshot of the page "after a
generation on the H200" is taken in two steps: ``python app.py --record DIR ...`` runs the generation
there (the second of two identical requests, so the latencies are replays, not captures) and saves the
images and every number; ``python app.py --replay DIR`` serves the same page anywhere, with a banner
saying where and when the result was recorded, and returns the recorded result when Generate is
pressed. Nothing is recomputed on replay.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

from .session import (
    DEFAULT_ACCELERATION,
    DEFAULT_PROMPT,
    DemoBackend,
    DemoDefaults,
    DemoError,
    GenerationRequest,
    GenerationResult,
    GraphCost,
    ProgressCallback,
    defaults_for,
)

__all__ = ["RecordedBackend", "load_result", "record", "save_result"]

_RESULT_FILE = "result.json"


def _environment(backend: DemoBackend) -> dict[str, Any]:
    import diffusers

    device = backend.device
    env = {
        "weights": backend.weights,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "host": platform.node(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def save_result(result: GenerationResult, folder: Path, environment: dict[str, Any]) -> None:
    """Write ``result`` to ``folder``: ``result.json`` and the images as ``eager.png`` / ``accelerated.png``."""
    folder.mkdir(parents=True, exist_ok=True)
    result.accelerated_image.save(folder / "accelerated.png")
    if result.eager_image is not None:
        result.eager_image.save(folder / "eager.png")
    fields = {
        f.name: getattr(result, f.name)
        for f in dataclasses.fields(result)
        if f.name not in ("request", "cost", "accelerated_image", "eager_image")
    }
    data = {
        "request": dataclasses.asdict(result.request),
        "cost": dataclasses.asdict(result.cost),
        **fields,
        "environment": environment,
    }
    (folder / _RESULT_FILE).write_text(json.dumps(data, indent=2))


def load_result(folder: Path) -> tuple[GenerationResult, dict[str, Any]]:
    """Read what :func:`save_result` wrote. Raises FileNotFoundError or ValueError with the path in the message."""
    path = folder / _RESULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: record one with `python app.py --record {folder}`")
    try:
        data = json.loads(path.read_text())
        environment = data.pop("environment")
        request = GenerationRequest(**data.pop("request"))
        cost = GraphCost(**data.pop("cost"))
        eager_path = folder / "eager.png"
        result = GenerationResult(
            request=request,
            cost=cost,
            accelerated_image=PIL.Image.open(folder / "accelerated.png").convert("RGB"),
            eager_image=PIL.Image.open(eager_path).convert("RGB") if eager_path.is_file() else None,
            **data,
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a recorded demo result: {exc}") from exc
    return result, environment


def record(
    backend: DemoBackend,
    pipeline: str,
    folder: Path,
    *,
    prompt: str = DEFAULT_PROMPT,
    acceleration: str = DEFAULT_ACCELERATION,
    resolution: tuple[int, int] | None = None,
    steps: int | None = None,
) -> GenerationResult:
    """Generate side by side twice with ``pipeline``'s default settings (``resolution`` and ``steps`` if given)
    in mode ``acceleration`` and save the second (replayed) result."""
    chosen = backend.defaults(pipeline)
    width, height = resolution or chosen.resolution
    request = GenerationRequest(
        prompt, pipeline, width, height, steps or chosen.steps, chosen.guidance, seed=0, acceleration=acceleration
    )
    backend.generate(request)  # captures
    result = backend.generate(request)  # replays: the latency a user sees from then on
    save_result(result, folder, _environment(backend))
    return result


class RecordedBackend:
    """Stands in for :class:`DemoBackend` on the page: offers the recorded request and returns its result.

    The page's controls start at the recorded settings; any other settings get a :class:`DemoError`
    explaining that this page replays one recorded result.
    """

    def __init__(self, folder: Path) -> None:
        self.result, self.environment = load_result(Path(folder))
        request = self.result.request
        self.pipelines: Sequence[str] = (request.pipeline,)
        self.accelerations: Sequence[str] = (request.acceleration,)
        self.recorded_weights = str(self.environment.get("weights", "random-full"))
        self.weights = f"{self.recorded_weights} (recorded)"
        where = self.environment.get("gpu") or self.result.device
        self.device = f"{self.result.device}: {where}, recorded {self.environment.get('date', '?')}"
        self.uses_cuda_graphs = self.result.graphs == "cuda graphs"
        self.default_prompt = request.prompt

    def defaults(self, pipeline: str) -> DemoDefaults:
        request = self.result.request
        base = defaults_for(pipeline, self.recorded_weights)
        return dataclasses.replace(
            base, resolution=(request.width, request.height), steps=request.steps, guidance=request.guidance
        )

    def generate(self, request: GenerationRequest, on_progress: ProgressCallback | None = None) -> GenerationResult:
        recorded = self.result.request
        if dataclasses.replace(request, mode=recorded.mode, negative_prompt=recorded.negative_prompt) != recorded:
            raise DemoError(
                "this page replays one result recorded on a GPU; its settings are fixed: "
                f"{recorded.pipeline}, {recorded.width}x{recorded.height}, {recorded.steps} steps, "
                f"guidance {recorded.guidance:g}, seed {recorded.seed}, {recorded.acceleration} mode, and the prompt "
                "it was given"
            )
        if on_progress is not None:
            total = 2 * recorded.steps
            on_progress(total, total, "replaying the recorded result")
        return self.result
