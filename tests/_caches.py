"""diffusers' cache configs the step-caching tests run with (CPU and GPU alike)."""

from __future__ import annotations

from typing import Any

import torch
from _cases import run_case
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from bcg_diffusion.step_cache import SkipCounter, disable_cache, enable_cache

CACHES = ("first-block", "taylorseer", "magcache")
# FirstBlockCache's threshold compares relative residual changes, near 1 with random weights: the
# first of these that gives both decisions on a pipeline is used, so that every test sees both paths.
FBC_THRESHOLDS = (1.0, 1.2, 1.5, 2.0, 3.0)


def cache_config(kind: str, steps: int, threshold: float = 1.0) -> Any:
    """A config whose schedule skips some steps and computes others over ``steps`` steps."""
    if kind == "first-block":
        return FirstBlockCacheConfig(threshold=threshold)
    if kind == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)
    if kind == "magcache":
        # Ratios of 1 keep the accumulated error at 0: a static schedule of up to 2 skips in a row.
        return MagCacheConfig(mag_ratios=[1.0] * steps, num_inference_steps=steps, max_skip_steps=2, threshold=0.5)
    raise ValueError(kind)


def mixed_threshold(pipe: Any, pipeline: str, case: str, *, steps: int, height: int, width: int) -> float:
    """The first FirstBlockCache threshold of :data:`FBC_THRESHOLDS` under which eager both skips and
    computes some calls of this case."""
    for threshold in FBC_THRESHOLDS:
        enable_cache(pipe, FirstBlockCacheConfig(threshold=threshold))
        counter = SkipCounter(pipe.transformer)
        try:
            run_case(pipe, pipeline, case, height=height, width=width, steps=steps)
        finally:
            counter.remove()
            disable_cache(pipe)
        if 0 < counter.skipped < counter.calls:
            return threshold
    raise AssertionError(f"no threshold in {FBC_THRESHOLDS} gives both decisions on {pipeline}/{case}")
