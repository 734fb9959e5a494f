"""What the benchmark runs: cases (one pipeline call each) and named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bcg_diffusion.models import DEFAULT_PROMPTS

SHORT_PROMPTS = tuple(p for p in DEFAULT_PROMPTS if len(p.split()) <= 20)
LONG_PROMPTS = tuple(p for p in DEFAULT_PROMPTS if len(p.split()) > 20)
PROMPT_SETS = {"short": SHORT_PROMPTS, "long": LONG_PROMPTS, "mixed": (SHORT_PROMPTS[0], LONG_PROMPTS[0])}
NEGATIVE_PROMPT = "blurry, low quality"


@dataclass(frozen=True)
class Case:
    """One benchmarked pipeline call.

    ``guidance`` is Qwen-Image's ``true_cfg_scale`` (CFG when > 1, with a negative prompt) or
    Z-Image's ``guidance_scale`` (CFG when > 0). ``batch`` prompts are drawn in turn from
    ``prompts`` ("short", "long" or "mixed": prompts of different lengths, Qwen-Image's masked path).
    """

    pipeline: str
    height: int
    width: int
    steps: int
    guidance: float
    batch: int = 1
    prompts: str = "short"
    profile: bool = True  # also profile the denoising loop (wall time against GPU kernel time)

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_SETS:
            raise ValueError(f"prompts must be one of {sorted(PROMPT_SETS)}, got {self.prompts!r}")
        if self.height % 16 or self.width % 16 or min(self.height, self.width) < 16:
            raise ValueError(f"resolution {self.width}x{self.height}: both sides must be multiples of 16")
        if self.steps < 2 or self.batch < 1:
            raise ValueError("steps must be >= 2 and batch >= 1")

    @property
    def uses_cfg(self) -> bool:
        return self.guidance > 1 if self.pipeline == "qwen-image" else self.guidance > 0

    @property
    def label(self) -> str:
        cfg = f"cfg {self.guidance:g}" if self.uses_cfg else "no cfg"
        batch = f", batch {self.batch} ({self.prompts})" if self.batch > 1 else ""
        return f"{self.pipeline} {self.width}x{self.height}, {self.steps} steps, {cfg}{batch}"

    def prompt_list(self) -> list[str]:
        pool = PROMPT_SETS[self.prompts]
        return [pool[i % len(pool)] for i in range(self.batch)]

    def kwargs(self, output_type: str = "pt", seed: int = 0) -> dict[str, Any]:
        """Keyword arguments of one call; fresh lists every time (Z-Image edits its prompt list in place)."""
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
    # The acceptance cases of issue 2 (eager against bcg).
    "issue2": [
        Case("qwen-image", 512, 512, 50, 4.0),
        Case("qwen-image", 512, 512, 50, 4.0, batch=2, prompts="mixed", profile=False),
        Case("qwen-image", 1024, 1024, 10, 4.0),
        Case("z-image", 512, 512, 8, 0.0),
        Case("z-image", 1024, 1024, 8, 0.0),
    ],
    # Issue 3: both pipelines at 512² and 1024² for every mode, as measured on the H200 (run one
    # pipeline per command there: each fits a 10-minute call, except compile-max on Qwen-Image).
    "issue3": [
        Case("z-image", 512, 512, 8, 0.0),
        Case("z-image", 1024, 1024, 8, 0.0),
        Case("qwen-image", 512, 512, 10, 4.0),
        Case("qwen-image", 1024, 1024, 10, 4.0),
    ],
}
