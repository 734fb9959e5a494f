"""Fast mode: the pipeline's causal text encoder runs on the prompt's tokens, not on its padding.

The trimming itself is :mod:`bcg_diffusion.text_trim`. It applies where the adapter says the pipeline
pads prompts for a causal encoder (Z-Image), on the encoder's forward whether or not it is accelerated
(outside its runner, so each trim bucket is a signature of its own). With the encoder accelerated,
:func:`~bcg_diffusion.warm_up` also calls it once per trim bucket, so every prompt's encoding replays.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import MethodPatches
from ..text_trim import TrimmedTextEncoder
from .base import Feature, Setup

__all__ = ["TextTrimming"]


class TextTrimming(Feature):
    name = "text-encoder trimming"
    component = "text_encoder"
    defaults = {"text_encoder_trimmed": 0}

    def __init__(self, setup: Setup) -> None:
        self.adapter = setup.adapter
        self.multiple: int = setup.adapter.text_trim_multiple
        self.trim: TrimmedTextEncoder | None = None
        self.captured = False  # the encoder has a runner: warm-ups call it per trim bucket

    @classmethod
    def create(cls, setup: Setup) -> TextTrimming | None:
        if setup.config.mode != "fast" or setup.adapter.text_trim_multiple is None:
            return None
        return cls(setup) if setup.adapter.is_tested(setup.pipe) else None

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        encoder = setup.modules["text_encoder"]
        self.trim = TrimmedTextEncoder(encoder.forward, self.multiple)
        patches.replace(encoder, "forward", self.trim)
        self.captured = "text_encoder" in setup.runners

    def warm_up(self, pipe: Any, call_kwargs: dict[str, Any]) -> int:
        if not self.captured:
            return 0
        calls = self.adapter.text_encoder_warmup_calls(pipe, call_kwargs, self.multiple)
        with torch.no_grad():
            for kwargs in calls:
                pipe.text_encoder(**kwargs)
        return len(calls)

    def stats(self) -> dict[str, Any]:
        return {"text_encoder_trimmed": self.trim.trimmed} if self.trim is not None else {}
