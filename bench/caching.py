"""The step cache the ``+cache`` modes of the benchmark run with (``--cache``).

Random weights make data-dependent cache decisions unrepresentative, so speed is measured with a
schedule we control: by default MagCache with magnitude ratios of 1 (``magcache``), which computes the
first fifth of the steps, then skips ``--cache-max-skip`` steps of every ``--cache-max-skip`` + 1.
``first-block`` (FirstBlockCache, ``--cache-threshold``) and ``taylorseer`` (compute every
``--cache-max-skip`` + 1 steps) are there for comparison. Every cached mode reports the fraction of
transformer calls it skipped.
"""

from __future__ import annotations

from typing import Any

CACHES = ("magcache", "first-block", "taylorseer")


def cache_config(kind: str, steps: int, *, threshold: float = 0.2, max_skip: int = 2) -> Any:
    """A fresh diffusers cache config (each mode gets its own). Raises ValueError for an unknown kind."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if kind == "magcache":
        return MagCacheConfig(
            mag_ratios=[1.0] * steps, num_inference_steps=steps, max_skip_steps=max_skip, threshold=1.0
        )
    if kind == "first-block":
        return FirstBlockCacheConfig(threshold=threshold)
    if kind == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=max_skip + 1, disable_cache_before_step=max(2, steps // 5))
    raise ValueError(f"unknown cache {kind!r}; choose from {CACHES}")


def describe(kind: str, steps: int, *, threshold: float, max_skip: int) -> str:
    if kind == "magcache":
        return f"MagCache, ratios 1 over {steps} steps, at most {max_skip} skips in a row (a static schedule)"
    if kind == "first-block":
        return f"FirstBlockCache, threshold {threshold:g} (decided on the data every step)"
    return f"TaylorSeer, computes every {max_skip + 1} steps after the first {max(2, steps // 5)} (a static schedule)"
