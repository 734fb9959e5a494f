"""What the benchmark runs: cases (one pipeline call each) and named presets.

Importable without torch or diffusers (``python -m bench --help`` lists the presets): the prompts are read from
``bcg_diffusion.models`` on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

PROMPT_SET_NAMES = ("short", "long", "mixed")
NEGATIVE_PROMPT = "blurry, low quality"


@functools.cache
def prompt_sets() -> dict[str, tuple[str, ...]]:
    """The built-in prompts by set: ``short`` (20 words at most), ``long``, and ``mixed`` (one of each)."""
    from bcg_diffusion.models import DEFAULT_PROMPTS

    short = tuple(p for p in DEFAULT_PROMPTS if len(p.split()) <= 20)
    long = tuple(p for p in DEFAULT_PROMPTS if len(p.split()) > 20)
    return {"short": short, "long": long, "mixed": (short[0], long[0])}


def check_size(width: int, height: int) -> None:
    """Raise ValueError unless every pipeline can make a ``width`` x ``height`` image (multiples of 16)."""
    if height % 16 or width % 16 or min(height, width) < 16:
        raise ValueError(f"resolution {width}x{height}: both sides must be multiples of 16")


@dataclass(frozen=True)
class Case:
    """One benchmarked pipeline call.

    ``guidance`` is Qwen-Image's ``true_cfg_scale`` (CFG when > 1, with a negative prompt) or
    Z-Image's ``guidance_scale`` (CFG when > 0). ``batch`` prompts are drawn in turn from
    ``prompts`` ("short", "long" or "mixed": prompts of different lengths, Qwen-Image's masked path).

    The pipelines of :mod:`bench.published` (FLUX.1, FLUX.2 klein, Wan, Qwen-Image-Edit) take random prompt
    embeddings instead of prompts (batch 1; ``weights`` says which, and ``frames`` is a video's length), or with
    ``text_encoders`` the prompt (and with CFG the negative prompt) for the encoders built with them
    (:mod:`bench.published_text`); ``guidance`` is the pipeline's own argument
    (:class:`bench.published.PublishedCase`).
    """

    pipeline: str
    height: int
    width: int
    steps: int
    guidance: float
    batch: int = 1
    prompts: str = "short"
    profile: bool = True  # also profile the denoising loop (wall time against GPU kernel time)
    frames: int | None = None  # a video's frames (bench.published's video pipelines)
    weights: str = "random-full"  # bench.published's pipelines: which random weights their embeddings fit
    text_encoders: bool = False  # bench.published's pipelines: encode the prompt with their built text encoders

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_SET_NAMES:
            raise ValueError(f"prompts must be one of {', '.join(PROMPT_SET_NAMES)}, got {self.prompts!r}")
        check_size(self.width, self.height)
        if self.steps < 2 or self.batch < 1:
            raise ValueError(f"steps must be >= 2 and batch >= 1, got steps {self.steps} and batch {self.batch}")
        if self.published is not None and self.batch != 1:
            raise ValueError(f"--pipeline {self.pipeline} runs one video or image per call (batch 1)")
        if (self.frames is not None) != (self.published is not None and self.published.frames is not None):
            raise ValueError(f"frames are for the video pipelines only, got {self.frames} for {self.pipeline}")
        if self.text_encoders and (self.published is None or not self.published.text_encoders):
            from .published import encoded

            raise ValueError(f"--text-encoders is for {', '.join(encoded())}, not {self.pipeline}")

    @property
    def published(self) -> Any:
        """This pipeline's :class:`bench.published.PublishedCase`, or None for Qwen-Image and Z-Image."""
        from .published import PUBLISHED

        return PUBLISHED.get(self.pipeline)

    @property
    def uses_cfg(self) -> bool:
        if self.published is not None:
            return self.published.uses_cfg(self.guidance)
        return self.guidance > 1 if self.pipeline == "qwen-image" else self.guidance > 0

    @property
    def label(self) -> str:
        cfg = f"cfg {self.guidance:g}" if self.uses_cfg else "no cfg"
        batch = f", batch {self.batch} ({self.prompts})" if self.batch > 1 else ""
        frames = f"x{self.frames}" if self.frames else ""
        text = ", text encoders" if self.text_encoders else ""
        return f"{self.pipeline} {self.width}x{self.height}{frames}, {self.steps} steps, {cfg}{batch}{text}"

    def prompt_list(self) -> list[str]:
        pool = prompt_sets()[self.prompts]
        return [pool[i % len(pool)] for i in range(self.batch)]

    def kwargs(self, output_type: str = "pt", seed: int = 0, device: Any = "cpu") -> dict[str, Any]:
        """Keyword arguments of one call; fresh lists every time (Z-Image edits its prompt list in place).
        ``device``: where :mod:`bench.published`'s prompt embeddings are made."""
        import torch

        if self.published is not None:
            from .published import call_inputs

            kwargs = call_inputs(
                self.pipeline, self.weights, device, self.width, self.height, self.frames, self.text_encoders
            )
            if self.text_encoders:
                kwargs["prompt"] = self.prompt_list()[0]
                if self.uses_cfg:
                    kwargs["negative_prompt"] = NEGATIVE_PROMPT
            kwargs.update(
                height=self.height, width=self.width, num_inference_steps=self.steps, output_type=output_type
            )
            if self.published.guidance_argument is not None:
                kwargs[self.published.guidance_argument] = self.guidance
            kwargs["generator"] = torch.Generator("cpu").manual_seed(seed)
            return kwargs | ({"num_frames": self.frames} if self.frames else {})
        prompts = self.prompt_list()
        kwargs: dict[str, Any] = {
            "prompt": prompts if len(prompts) > 1 else prompts[0],
            "height": self.height,
            "width": self.width,
            "num_inference_steps": self.steps,
            "output_type": output_type,
            "generator": torch.Generator("cpu").manual_seed(seed),
        }
        scale_name = "true_cfg_scale" if self.pipeline == "qwen-image" else "guidance_scale"
        kwargs[scale_name] = self.guidance
        if self.uses_cfg:
            kwargs["negative_prompt"] = [NEGATIVE_PROMPT] * len(prompts) if len(prompts) > 1 else NEGATIVE_PROMPT
        return kwargs


PRESETS: dict[str, list[Case]] = {
    # Both pipelines at 512x512 and 1024x1024, every mode (issue 3, as measured on the H200: run one pipeline
    # per command there; each fits a 10-minute call, except compile-max on Qwen-Image).
    "two-sizes": [
        Case("z-image", 512, 512, 8, 0.0),
        Case("z-image", 1024, 1024, 8, 0.0),
        Case("qwen-image", 512, 512, 10, 4.0),
        Case("qwen-image", 1024, 1024, 10, 4.0),
    ],
    # Qwen-Image with true CFG at 50 steps, a batch of two prompts of different lengths (the masked path) and
    # 1024x1024 at 10 steps; Z-Image at both sizes (issue 2's acceptance cases, eager against bcg).
    "cfg-steps-batch": [
        Case("qwen-image", 512, 512, 50, 4.0),
        Case("qwen-image", 512, 512, 50, 4.0, batch=2, prompts="mixed", profile=False),
        Case("qwen-image", 1024, 1024, 10, 4.0),
        Case("z-image", 512, 512, 8, 0.0),
        Case("z-image", 1024, 1024, 8, 0.0),
    ],
}
# Old names that recorded commands still use (docs/results.md and run 6 in bench/results/2026-11-29-h200/):
# accepted by --preset, not listed by --help.
PRESET_ALIASES = {"issue2": "cfg-steps-batch"}
