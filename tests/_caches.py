"""diffusers' cache configs the step-caching tests run with (CPU and GPU alike)."""

from __future__ import annotations

from typing import Any

import torch
from _cases import LONG, SHORT, run_case
from _checks import assert_graphs_ran
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.features.step_caching import SkipCounter, disable_cache, enable_cache

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
    return _first_mixed_threshold(
        pipe,
        lambda: run_case(pipe, pipeline, case, height=height, width=width, steps=steps),
        f"{pipeline}/{case}",
    )


def _first_mixed_threshold(pipe: Any, run: Any, label: str) -> float:
    """The first threshold of :data:`FBC_THRESHOLDS` under which eager FirstBlockCache both skips and computes
    some of the transformer calls ``run()`` makes."""
    for threshold in FBC_THRESHOLDS:
        enable_cache(pipe, FirstBlockCacheConfig(threshold=threshold))
        counter = SkipCounter(pipe.transformer)
        try:
            run()
        finally:
            counter.remove()
            disable_cache(pipe)
        if 0 < counter.skipped < counter.calls:
            return threshold
    raise AssertionError(f"no threshold in {FBC_THRESHOLDS} gives both decisions on {label}")


# ------------------------------------------------------------------------------ interleaved calls
# One pipeline called with two resolutions, two prompts and CFG on and off, interleaved: each of the first
# four calls is a combination the pipeline has not seen (new graphs, new cache buffers beside the old ones),
# the last four repeat them (replays only). Entries: (size index, prompt index, CFG on).
MIXED_CALLS = ((0, 0, True), (1, 1, False), (0, 1, False), (1, 0, True))
MIXED_SEQUENCE = MIXED_CALLS + MIXED_CALLS
MIXED_PROMPTS = (SHORT, LONG)
MIXED_CFG = {  # pipeline -> (CFG off, CFG on): Qwen-Image's true CFG (two calls per step), Z-Image's batched CFG
    "qwen-image": ({"true_cfg_scale": 1.0}, {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}),
    "z-image": ({"guidance_scale": 0.0}, {"negative_prompt": "blurry", "guidance_scale": 4.0}),
}
MIXED_STEPS = 8

# MagCache with ratios that move: the accumulated error is not 0, and it decides. Step 0 computes (retention);
# after it the ratio's product drifts from 1 and its error accumulates: steps 1-2 skip, step 3 computes (error
# 0.116 > 0.1), 4 skips, 5 computes (0.141), 6-7 skip. max_skip_steps=8 never binds, so every computed step
# after the first is the error's decision (ratios of 1 would skip steps 1-7).
MAG_RATIOS = (1.0, 0.99, 1.08, 0.97, 1.01, 1.12, 0.98, 1.0)
MAG_SCHEDULE = (True, False, False, True, False, True, False, False)  # computed, per step


def varying_magcache_config() -> MagCacheConfig:
    """MagCache over :data:`MIXED_STEPS` steps whose decisions follow :data:`MAG_SCHEDULE` (see above)."""
    return MagCacheConfig(
        mag_ratios=list(MAG_RATIOS),
        num_inference_steps=MIXED_STEPS,
        threshold=0.1,
        max_skip_steps=MIXED_STEPS,
        retention_ratio=0.1,
    )


def mixed_call(pipe: Any, pipeline: str, call: tuple[int, int, bool], sizes: tuple[tuple[int, int], ...]) -> Any:
    """One call of :data:`MIXED_CALLS` (``sizes``: two (height, width)): the image as a CPU tensor."""
    size, prompt, cfg = call
    height, width = sizes[size]
    out = pipe(
        prompt=MIXED_PROMPTS[prompt],
        **MIXED_CFG[pipeline][cfg],
        height=height,
        width=width,
        num_inference_steps=MIXED_STEPS,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
    )
    return out.images.detach().cpu()


class SkipLog(SkipCounter):
    """A :class:`SkipCounter` that also keeps each transformer call's decision, in order (True: computed)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.decisions: list[bool] = []
        super().__init__(module)

    def _count(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        calls, skipped = self.calls, self.skipped
        super()._count(module, args, output)
        if self.calls > calls:
            self.decisions.append(self.skipped == skipped)


class BlockCalls:
    """Counts the calls of the ``to_q`` linear in the transformer's last block (eager only: a replay runs no
    hooks). It runs when a transformer call computes, and not when a cache skips: FirstBlockCache and MagCache
    skip the blocks, TaylorSeer predicts the attention's output. A count of the work really done, beside the
    caches' own state that :class:`SkipLog` reads."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        blocks = getattr(transformer, "transformer_blocks", None) or transformer.layers
        to_q = next(m for name, m in blocks[-1].named_modules() if name.endswith("to_q"))
        self.calls = 0
        self._handle = to_q.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


def _mixed_config(kind: str, threshold: float) -> Any:
    return varying_magcache_config() if kind == "magcache" else cache_config(kind, MIXED_STEPS, threshold)


def check_interleaved_calls(
    reference: Any,
    pipe: Any,
    pipeline: str,
    kind: str,
    sizes: tuple[tuple[int, int], ...],
    **accelerate_kwargs: Any,
) -> str:
    """:data:`MIXED_SEQUENCE` on ``reference`` (eager) and on ``pipe`` (built the same way, accelerated with
    ``accelerate_kwargs``), both with the same cache ``kind``; asserts:

    - eager: the cache skipped some transformer calls and computed others, by its own state and by the work
      done (:class:`BlockCalls`); a repeated call gives the same bytes (the cache resets between calls); for
      MagCache, each call's decisions follow :data:`MAG_SCHEDULE`;
    - accelerated: each call byte-equal to eager's, with eager's decisions; the first four calls captured
      with nothing run eagerly, and each repeat ran on replays of the transformer's own graphs alone (no
      capture, no fallback, no miss: ``assert_graphs_ran``).

    Returns a line for the log.
    """
    threshold = 1.0
    if kind == "first-block":
        threshold = _threshold_for_calls(reference, pipeline, sizes)
    enable_cache(reference, _mixed_config(kind, threshold))
    log, blocks = SkipLog(reference.transformer), BlockCalls(reference.transformer)
    expected, decisions = [], []
    try:
        for call in MIXED_SEQUENCE:
            start = len(log.decisions)
            expected.append(mixed_call(reference, pipeline, call, sizes))
            decisions.append(log.decisions[start:])
    finally:
        log.remove()
        blocks.remove()
        disable_cache(reference)
    computed = sum(map(sum, decisions))
    assert 0 < log.skipped < log.calls, f"eager: skipped {log.skipped} of {log.calls} transformer calls"
    assert blocks.calls == computed, f"eager: the last block ran {blocks.calls} times, the cache computed {computed}"
    half = len(MIXED_CALLS)
    for i in range(half):
        assert torch.equal(expected[i], expected[i + half]), f"eager: call {i + half} differs from call {i}"
    if kind == "magcache":
        for call, made in zip(MIXED_SEQUENCE, decisions):
            per_step = len(made) // MIXED_STEPS  # Qwen-Image's true CFG: cond and uncond, each with its own state
            assert per_step * MIXED_STEPS == len(made), (call, made)
            assert made == [d for d in MAG_SCHEDULE for _ in range(per_step)], (call, made)

    enable_cache(pipe, _mixed_config(kind, threshold))
    accelerate(pipe, **accelerate_kwargs)
    log = SkipLog(pipe.transformer)
    try:
        for i, call in enumerate(MIXED_SEQUENCE):
            start = len(log.decisions)
            image = mixed_call(pipe, pipeline, call, sizes)
            assert torch.equal(image, expected[i]), f"call {i} {call}: not eager's bytes"
            assert log.decisions[start:] == decisions[i], f"call {i} {call}: {log.decisions[start:]} != {decisions[i]}"
            if i == half - 1:
                # Every combination seen. A cache state keys its own graphs, so a first call may capture every
                # step and replay none: the warm-up calls must have captured, with nothing run eagerly.
                report = stats(pipe)
                transformer = report["components"]["transformer"]
                assert transformer["captures"] > 0 and transformer["eager_fallbacks"] == 0, transformer
                assert not [s for s in report["signatures"] if s["status"] == "failed"], report["signatures"]
            elif i >= half:  # a repeat: replays alone, the transformer's own, no capture, no fallback
                report = assert_graphs_ran(pipe, report, captures=False, components=("transformer",))
        assert report["cache_hooks"] and report["cache_states"] > 0, report
    finally:
        log.remove()
        restore(pipe)
        disable_cache(pipe)
    return (
        f"{pipeline}/{kind}: skipped {log.skipped}/{log.calls} (threshold {threshold}), "
        f"captures {report['captures']}, replays {report['replays']}, states {report['cache_states']}, "
        f"branches {report['cache_branches']}"
    )


def _threshold_for_calls(pipe: Any, pipeline: str, sizes: tuple[tuple[int, int], ...]) -> float:
    """The first threshold of :data:`FBC_THRESHOLDS` under which eager FirstBlockCache both skips and computes
    some transformer calls over :data:`MIXED_CALLS`."""

    def run() -> None:
        for call in MIXED_CALLS:
            mixed_call(pipe, pipeline, call, sizes)

    return _first_mixed_threshold(pipe, run, f"{pipeline}'s mixed calls")
