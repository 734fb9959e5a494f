"""Warm-up: capture before serving every signature that calls at chosen resolutions will need."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .config import resolution_pairs
from .core.runner import BCGWarning
from .pipelines.base import WarmupRequest
from .state import accelerated_state

__all__ = ["DEFAULT_WARMUP_PROMPT", "warm_up"]

logger = logging.getLogger(__name__)

DEFAULT_WARMUP_PROMPT = "a lighthouse on a rocky coast at dusk"


def warm_up(
    pipe: Any,
    resolutions: Iterable[tuple[int, int]],
    *,
    cfg: Sequence[bool] = (False, True),
    prompts: Sequence[str] = (DEFAULT_WARMUP_PROMPT,),
    **call_kwargs: Any,
) -> dict[str, Any]:
    """Call an accelerated pipeline once per resolution, CFG mode and prompt, capturing what it needs.

    Captures happen even when ``lazy_capture=False`` (they are what a warm-up is for). Signatures
    depend on the prompt's token length too:

    - Qwen-Image with ``text_buckets``: one call per bucket, which covers every prompt up to the
      largest bucket, with or without CFG. Without buckets (exact) every token length is a signature
      of its own, so warm up with ``prompts`` of the lengths you expect.
    - Z-Image: one call per caption bucket (each multiple of 32 tokens) up to ``max_sequence_length``
      (512 unless given in ``call_kwargs``), which covers every prompt, exactly. With CFG the negative
      prompt is ``call_kwargs["negative_prompt"]`` (default ``" "``); its bucket is part of every CFG
      signature, so a service with several negative prompts warms up once with each.
    - Fast mode with the text encoder accelerated and trimmed (Z-Image): also one encoder call per
      64-token bucket up to ``max_sequence_length``, so any prompt's encoding replays.

    Lengths not covered are captured later (lazy capture) or run eagerly (``lazy_capture=False``).
    Img2img, inpaint and ControlNet pipelines are called with grey images of each size that the warm-up makes
    itself (:func:`~bcg_diffusion.pipelines.base.image_inputs`), unless ``call_kwargs`` give them.
    ``call_kwargs`` are passed to every call (e.g. ``cfg_truncation=0.5`` for Z-Image, whose batch
    then drops mid-run: a signature of its own).

    Returns ``{"calls", "captures", "seconds"}``: pipeline (and text encoder) calls made, signatures
    captured, wall time.
    Warns (:class:`BCGWarning`) when ``max_signatures`` evicted signatures during the warm-up: it then
    does not cover what it captured.

    Raises:
        ValueError: the pipeline was never accelerated (or was restored), or a resolution is not a pair of
            positive multiples of 16.
        TypeError: a resolution is not a ``(width, height)`` pair of ints.

    >>> pipe = accelerate(pipe, lazy_capture=False)               # doctest: +SKIP
    >>> warm_up(pipe, [(1024, 1024), (512, 512)], cfg=(True,))     # doctest: +SKIP
    {'calls': 2, 'captures': 6, 'seconds': 3.1}
    """
    state = accelerated_state(pipe, "warm_up")
    pairs = resolution_pairs(list(resolutions))
    if not state.active:
        logger.warning("warm_up(): the pipeline runs eagerly (%s); nothing to capture", state.reason)
        return {"calls": 0, "captures": 0, "seconds": 0.0}
    started = time.perf_counter()
    calls = 0
    group = state.group
    runners = state.runners
    with group.lock:
        captures_before = sum(r.counters.captures for r in runners.values())
        evictions_before = group.budget.evictions if group.budget is not None else 0
        previous = {name: runner.capture_new for name, runner in runners.items()}
        for runner in runners.values():
            runner.capture_new = True
        try:
            with contextlib.ExitStack() as features_warming:
                for feature in state.all_features():
                    features_warming.enter_context(feature.warming_up())
                for width, height in pairs:
                    for use_cfg in dict.fromkeys(cfg):
                        request = WarmupRequest(
                            width, height, bool(use_cfg), prompts, state.config.text_buckets, call_kwargs
                        )
                        for kwargs in state.adapter.warmup_calls(pipe, request):
                            # A call given embeddings takes no prompt text: the adapter encoded it already.
                            kwargs.update(
                                (key, value) for key, value in call_kwargs.items() if f"{key}_embeds" not in kwargs
                            )
                            kwargs.setdefault("generator", torch.Generator("cpu").manual_seed(0))
                            pipe(**kwargs)
                            calls += 1
                for feature in state.all_features():
                    calls += feature.warm_up(pipe, call_kwargs)
        finally:
            for name, runner in runners.items():
                runner.capture_new = previous[name]
        captures = sum(r.counters.captures for r in runners.values()) - captures_before
        evicted = (group.budget.evictions if group.budget is not None else 0) - evictions_before
    seconds = time.perf_counter() - started
    if evicted:
        warnings.warn(
            f"bcg-diffusion: warm_up() captured {captures} signatures but max_signatures="
            f"{state.config.max_signatures} evicted {evicted} of them (or earlier ones) on the way: calls of "
            "those run eagerly or capture again. Raise max_signatures, or warm up less (fewer resolutions, "
            "CFG modes, text buckets, or a smaller max_sequence_length for Z-Image)",
            BCGWarning,
            stacklevel=2,
        )
    logger.info("warm-up: %d calls, %d new captures in %.1f s", calls, captures, seconds)
    return {"calls": calls, "captures": captures, "seconds": seconds}
