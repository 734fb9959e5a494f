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


def cachedit_mask(steps: int, spec: str | None = None) -> list[int]:
    """Cache-DiT's ``steps_computation_mask`` for ``steps`` steps (1: compute, 0: reuse). ``spec``: a string of
    0s and 1s, repeated to the length; by default about half: the first tenth (at least 2) computes, then
    every other step, and the last step computes. Raises ValueError for a spec of other characters."""
    if spec:
        if set(spec) - {"0", "1"}:
            raise ValueError(f"a Cache-DiT mask is a string of 0 and 1, got {spec!r}")
        return [int(c) for c in (spec * (steps // len(spec) + 1))[:steps]]
    head = max(2, steps // 10)
    mask = [1 if i < head or (i - head) % 2 == 1 else 0 for i in range(steps)]
    mask[-1] = 1
    return mask


def cachedit_options(pipe: Any, steps: int, mask: str | None = None) -> dict[str, Any]:
    """``cache_dit.enable_cache`` options: DBCache with a static computation mask (:func:`cachedit_mask`), so that
    random weights give the schedule a trained model would have; up to 8 Fn blocks (fewer on the tiny
    models), no Bn blocks, Cache-DiT's defaults otherwise."""
    import cache_dit

    transformer = pipe.transformer
    blocks = next(
        getattr(transformer, name) for name in ("transformer_blocks", "blocks", "layers") if hasattr(transformer, name)
    )
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=max(1, min(8, len(blocks) - 1)),
        Bn_compute_blocks=0,
        num_inference_steps=steps,
        steps_computation_mask=cachedit_mask(steps, mask),
        steps_computation_policy="static",
    )
    return {"cache_config": config}


def describe_cachedit(steps: int, mask: str | None = None) -> str:
    computed = sum(cachedit_mask(steps, mask))
    return f"Cache-DiT DBCache, static mask computing {computed} of {steps} steps"


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
