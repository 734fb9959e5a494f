"""Fast mode: a causal text encoder runs on a prompt's tokens, not on its padding.

Z-Image's pipeline pads every prompt to ``max_sequence_length`` (512) tokens, runs its Qwen3 text
encoder on all of them and then keeps the valid ones. In a causal model a valid token never attends
to padding that follows it, so running the encoder on the valid tokens only (plus padding up to a
multiple of ``multiple``, which bounds the number of shapes to capture) gives the same embeddings up to
rounding (GEMMs and attention over fewer rows pick other kernels). The outputs are padded back to the
length the caller asked for, with zeros at the padded positions, which the pipeline drops.

Only right padding is trimmed (the tokenizer's default for Qwen3); anything else goes through as
called: no mask, left or gappy masks, position ids or input embeddings given, attentions requested.
Reading the mask costs one host sync per prompt encoding, before any denoising is queued.

The :class:`TextTrimming` feature applies it in fast mode, where the adapter says the pipeline pads
prompts for a causal encoder (Z-Image), on the encoder's forward whether or not it is accelerated
(outside its runner, so each trim bucket is a signature of its own). With the encoder accelerated,
:func:`~bcg_diffusion.warm_up` also calls it once per trim bucket, so every prompt's encoding replays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core.hooks import MethodPatches
from .base import Feature, Setup

__all__ = ["TextTrimming", "TrimmedTextEncoder"]


def _right_padded_length(mask: torch.Tensor) -> int | None:
    """The longest row's valid length when every row is ones then zeros (None: some row is not)."""
    host = mask.detach().to("cpu", torch.bool)
    lengths = host.sum(dim=-1)
    positions = torch.arange(host.shape[-1])
    if not torch.equal(host, positions < lengths[:, None]):
        return None
    return int(lengths.max())


def _pad_sequence(value: Any, trimmed: int, full: int) -> Any:
    """``value`` (a tensor, or a tuple/list of them, or anything else) with every tensor whose dim 1 is
    ``trimmed`` long padded with zeros to ``full``."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[1] == trimmed:
            return F.pad(value, (0, 0) * (value.dim() - 2) + (0, full - trimmed))
        return value
    if isinstance(value, tuple | list):
        return type(value)(_pad_sequence(item, trimmed, full) for item in value)
    return value


@dataclasses.dataclass
class TrimmedTextEncoder:
    """Wraps a text encoder's ``forward`` so that right padding beyond the next multiple of ``multiple``
    tokens is not computed.

    Call it as the forward (``input_ids``, ``attention_mask`` by name or position); it returns the
    forward's output with sequence outputs padded back to the input's length. ``trimmed`` counts the
    calls that ran on fewer tokens than given.
    """

    forward: Callable[..., Any]
    multiple: int = 64
    trimmed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.multiple, int) or self.multiple < 1:
            raise ValueError(f"multiple must be a positive int, got {self.multiple!r}")
        functools.update_wrapper(self, self.forward, updated=())  # not the runner's attributes

    def __call__(self, input_ids: Any = None, attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        length = self._trim_to(input_ids, attention_mask, args, kwargs)
        if length is None:
            return self.forward(input_ids, attention_mask, *args, **kwargs)
        full = input_ids.shape[1]
        output = self.forward(input_ids[:, :length], attention_mask[:, :length], **kwargs)
        self.trimmed += 1
        if isinstance(output, dict):  # transformers' ModelOutput is an ordered dict
            for key, value in list(output.items()):
                output[key] = _pad_sequence(value, length, full)
            return output
        return _pad_sequence(output, length, full)

    def _trim_to(self, input_ids: Any, attention_mask: Any, args: tuple, kwargs: dict) -> int | None:
        """The token count to run on, or None to run the call as it is."""
        if args or not isinstance(input_ids, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
            return None
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            return None
        if any(kwargs.get(name) is not None for name in ("position_ids", "inputs_embeds", "cache_position")):
            return None
        if kwargs.get("output_attentions") or kwargs.get("past_key_values") is not None:
            return None
        valid = _right_padded_length(attention_mask)
        if valid is None:
            return None
        length = max(self.multiple, -(-valid // self.multiple) * self.multiple)
        return length if length < input_ids.shape[1] else None


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
