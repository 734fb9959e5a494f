"""The pipelines people serve besides Qwen-Image and Z-Image, as ``python -m bench --pipeline NAME`` runs them.

Each is one of the coverage check's pipelines (:mod:`bench.coverage_models`): built from the installed
diffusers' own classes at its published size with random weights (``--weights random-full``) or tiny
(``--weights tiny``, for the CPU), called with random prompt embeddings of its text encoder's width and
length instead of a prompt (no text encoder is built: nothing is downloaded). Each has the defaults of
the case people render: its size, steps and guidance, which ``--resolutions``, ``--frames``, ``--steps``
and ``--guidance`` override.

Names only at import (``python -m bench --help`` reads them without torch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["PUBLISHED", "PublishedCase", "build", "call_inputs", "encoded"]


@dataclass(frozen=True)
class PublishedCase:
    """A published pipeline's benchmark defaults.

    Attributes:
        coverage: its name in :data:`bench.coverage_models.FULL` and ``TINY``.
        width, height, frames: the size people render (``frames`` None: an image pipeline).
        steps: the denoising steps of that case (Wan: 3 of its 40, enough for a per-step time).
        guidance: the guidance of that case, passed as ``guidance_argument``.
        guidance_argument: the pipeline's keyword for it (None: the pipeline's guider holds it, and the benchmark
            cannot change it).
        cfg_above: the guidance above which the pipeline calls the transformer twice a step (None: never, a
            guidance-distilled model).
        text_encoders: whether ``--text-encoders`` can build its text encoders (:mod:`bench.published_text`).
        modes_apart: whether each mode runs in a group of its own beside eager (``--modes-apart``): its modes,
            each holding its graphs and FP8 copy while the group is timed in turns, do not fit an 80 GB GPU
            together at its size.
    """

    coverage: str
    width: int
    height: int
    frames: int | None
    steps: int
    guidance: float
    guidance_argument: str | None = "guidance_scale"
    cfg_above: float | None = None
    text_encoders: bool = True
    modes_apart: bool = False

    def uses_cfg(self, guidance: float) -> bool:
        return self.cfg_above is not None and guidance > self.cfg_above


PUBLISHED: dict[str, PublishedCase] = {
    # FLUX.1-dev: guidance is distilled into the model (an embedding), one transformer call per step.
    "flux": PublishedCase("FLUX.1", 1024, 1024, None, 28, 3.5),
    # FLUX.1-dev with a ControlNet (Shakker-Labs' Union Pro 2.0: six double blocks) called every step beside the
    # transformer; captured by default, left eager by the -no-controlnet modes.
    "flux-controlnet": PublishedCase("FLUX.1 ControlNet", 1024, 1024, None, 28, 3.5, text_encoders=False),
    # FLUX.2 [klein] 4B: step-distilled, 4 steps, no CFG.
    "flux2-klein": PublishedCase("FLUX.2 klein", 1024, 1024, None, 4, 1.0),
    # Wan 2.1 T2V 14B at 480p, 81 frames, CFG 5 (two transformer calls a step).
    "wan": PublishedCase("Wan 2.1 T2V", 832, 480, 81, 3, 5.0, cfg_above=1.0),
    # Qwen-Image-Edit-2511 (zero_cond_t), true CFG 4 (two calls a step), the input image at the output's size.
    "qwen-image-edit": PublishedCase(
        "Qwen-Image Edit Plus", 1024, 1024, None, 8, 4.0, "true_cfg_scale", 1.0, text_encoders=False
    ),
    # HunyuanImage 2.1 (17B) at 2048², 8 of its 50 steps; its guider's CFG 3.5 (two transformer calls a step).
    # Each mode at 2048² holds about 9 GiB of graphs beside 35 GB of weights (and FP8 copies): one at a time on
    # an 80 GB GPU (run 215 ran out of memory with five together).
    "hunyuan-image": PublishedCase(
        "HunyuanImage", 2048, 2048, None, 8, 3.5, None, 1.0, text_encoders=False, modes_apart=True
    ),
}


def encoded() -> list[str]:
    """The pipelines whose text encoders ``--text-encoders`` builds."""
    return [name for name, case in PUBLISHED.items() if case.text_encoders]


def build(name: str, weights: str, device: Any, text_encoders: bool = False) -> Any:
    """Pipeline ``name`` (a key of :data:`PUBLISHED`) with ``weights`` ``"random-full"`` (its published size,
    random bfloat16 weights made on ``device``) or ``"tiny"`` (the tiny CPU config, moved to ``device``); with
    ``text_encoders``, its text encoders too (:mod:`bench.published_text`). Raises ValueError for other weights
    (no checkpoint of these is loaded by the benchmark) or text encoders that are not built here."""
    from .coverage_models import FULL, TINY

    spec = PUBLISHED[name]
    if weights in ("random-full", "tiny"):
        pipe = FULL[spec.coverage].build(device) if weights == "random-full" else TINY[spec.coverage]()[0].to(device)
        if not text_encoders:
            return pipe
        from .published_text import with_text_encoders

        return with_text_encoders(pipe, name, weights, device)
    raise ValueError(
        f"--pipeline {name} runs with --weights random-full or tiny (random weights at its published or a tiny "
        f"size), not {weights!r}: load a checkpoint yourself and call bcg_diffusion.accelerate on it"
    )


def call_inputs(
    name: str, weights: str, device: Any, width: int, height: int, frames: int | None, text_encoders: bool = False
) -> dict[str, Any]:
    """The call arguments of pipeline ``name`` besides its size, steps, guidance, generator and prompts: prompt
    embeddings (random, of its text encoders' widths; the same tensors on every call), or with ``text_encoders``
    what its built encoders need instead (:func:`bench.published_text.encoder_call_inputs`), and, for the edit
    pipelines, their input image at the output's size. A new dict each time."""
    inputs = dict(_inputs(name, weights, device, width, height, frames))
    if not text_encoders:
        return inputs
    from .published_text import encoder_call_inputs

    kept = {key: value for key, value in inputs.items() if "prompt" not in key}  # embeddings, pooled, masks
    return kept | encoder_call_inputs(name, weights)


@functools.lru_cache(maxsize=4)
def _inputs(name: str, weights: str, device: Any, width: int, height: int, frames: int | None) -> dict[str, Any]:
    from .coverage_models import FULL, TINY, Size, _image

    spec = PUBLISHED[name]
    if weights == "tiny":
        _, inputs = TINY[spec.coverage]()
        inputs = {key: value.to(device) if hasattr(value, "to") and not _is_image(value) else value
                  for key, value in inputs.items()}  # fmt: skip
    else:
        inputs = FULL[spec.coverage].inputs(device, Size("bench", width, height, frames))
    for key in ("image", "control_image"):  # the edit pipelines' input, a ControlNet's: the output's size
        if key in inputs and _is_image(inputs[key]):
            inputs[key] = _image(width, height)
    for key in ("width", "height", "num_frames", "guidance_scale", "guidance_scale_2", "true_cfg_scale"):
        inputs.pop(key, None)
    return inputs


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL")
