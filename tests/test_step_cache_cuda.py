"""Step caching inside real graphs (marker: cuda): each diffusers cache keeps its graphs and gives the
bytes of eager with the same cache; in fast mode, of the compiled blocks without graphs.

A replay runs no Python: these are the tests where a cache decision or a kept tensor that the graphs
did not carry would show (the CPU tests, in debug mode, run the hooks' Python on every call and emulate
replays with ``_caches.ReplayCheck``). The interleaved test calls one pipeline with two resolutions, two
prompts and CFG on and off, and runs MagCache with ratios whose accumulated error decides
(``_caches.MAG_SCHEDULE``), against an eager pipeline built the same way. The captures-per-call tests
(issue 36) count the transformer's graphs a call captures, its branches included: at most two per argument
signature (compute and skip), whatever the step. The CFG-batching tests (issue 36, item 3) run fast mode's
batch of cond and uncond in one joint cache context under MagCache and TaylorSeer, on real graphs.
"""

from __future__ import annotations

import pytest
import torch
from _caches import (
    CACHES,
    COUNT_CASE,
    COUNT_STEPS,
    DIT_CALLS,
    DIT_KINDS,
    OTHER_LENGTH_NEGATIVE,
    SAME_LENGTH_NEGATIVE,
    cache_config,
    cachedit_options,
    cfg_decisions,
    check_cachedit_calls,
    check_captures_per_call,
    check_interleaved_calls,
    counting_config,
    dit_threshold,
    mixed_call,
    mixed_threshold,
    stop_batching_at,
)
from _cases import cuda_pipeline, run_case
from _checks import assert_graphs_ran
from diffusers import MagCacheConfig

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.core.graphs import GraphPool, eager_break
from bcg_diffusion.core.runner import GraphRunner
from bcg_diffusion.features.step_caching import SkipCounter, disable_cache, enable_cache

pytestmark = pytest.mark.cuda

CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}
STEPS = 6
SIZE = (64, 64)
MIXED_SIZES = ((64, 64), (96, 64))  # (height, width): the interleaved test's two resolutions


def test_a_break_that_decides_selects_a_captured_path_of_its_own():
    import threading

    @eager_break
    def decide(x):
        return bool(x.sum().item() > 0)

    def forward(x):
        y = x * 2
        if decide(y):
            return y.sin() + 1
        return y.cos() - 1

    runner = GraphRunner(forward, name="toy", pool=GraphPool("cuda"), lock=threading.RLock())
    inputs = [torch.full((8,), v, device="cuda") for v in (1.0, -1.0, 2.0, -3.0, 1.0, -1.0)]
    with torch.no_grad():
        for x in inputs:
            assert torch.equal(runner(x), forward(x))
    assert runner.counters.captures == 1 and runner.counters.branches == 1, runner.counters
    assert runner.counters.branch_switches >= 3 and runner.counters.eager_fallbacks == 0, runner.counters
    runner.close()


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_cached_pipeline_keeps_graphs_and_eager_bytes(pipeline, cache, mode):
    case = CASE[pipeline]
    with cuda_pipeline(pipeline, "tiny") as pipe:
        threshold = 1.0
        if cache == "first-block":
            threshold = mixed_threshold(pipe, pipeline, case, steps=STEPS, height=SIZE[0], width=SIZE[1])
        config = cache_config(cache, STEPS, threshold)
        enable_cache(pipe, config)
        eager_images = [run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS) for _ in range(2)]
        assert torch.equal(eager_images[0], eager_images[1])
        accelerate(pipe, mode=mode)
        try:
            counter = SkipCounter(pipe.transformer)
            images = [run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS) for _ in range(3)]
            report = assert_graphs_ran(pipe, components=("transformer",))
            assert report["cache_hooks"], report
            assert 0 < counter.skipped < counter.calls, (counter.skipped, counter.calls)
            if mode == "fast":
                with eager(pipe):  # the compiled blocks and the same cache, without graphs
                    reference = run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS)
            else:
                reference = eager_images[0]
            for image in images:
                assert torch.equal(image, reference)
            if cache == "first-block":
                assert report["cache_branches"] > 0, report
            print(
                f"\n{pipeline}/{cache}/{mode}: skipped {counter.skipped}/{counter.calls} "
                f"captures={report['captures']} replays={report['replays']} branches={report['cache_branches']} "
                f"states={report['cache_states']}"
            )
            counter.remove()
        finally:
            restore(pipe)
        # restore leaves the cache on, eager, with diffusers' own methods
        assert torch.equal(run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS), eager_images[0])
        disable_cache(pipe)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_interleaved_sizes_prompts_and_cfg_keep_graphs_eager_bytes_and_decisions(pipeline, cache):
    # _caches.check_interleaved_calls: every call byte-equal to eager with the same cache and decisions; the
    # repeats replay the transformer's own graphs alone (assert_graphs_ran, no capture, no fallback).
    with cuda_pipeline(pipeline, "tiny") as reference, cuda_pipeline(pipeline, "tiny") as pipe:
        print("\n" + check_interleaved_calls(reference, pipe, pipeline, cache, MIXED_SIZES))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_a_call_captures_a_graph_per_decision_not_per_step(pipeline, cache):
    # Issue 36: 10 steps with CFG, decisions that vary, two sizes; every call byte-equal to eager with the same
    # cache; the first call at a size captures at most two transformer graphs per argument signature, branches
    # included (4 on Qwen-Image, 2 on Z-Image), the repeats none. Before: one graph per step's state
    # (20/20/6+branches on Qwen-Image for TaylorSeer/MagCache/FirstBlockCache, 10/10/3+branches on Z-Image).
    with cuda_pipeline(pipeline, "tiny") as reference, cuda_pipeline(pipeline, "tiny") as pipe:
        print("\n" + check_captures_per_call(reference, pipe, pipeline, cache, MIXED_SIZES))


@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_magcache_that_starts_over_mid_call_keeps_graphs_and_eager_bytes(pipeline):
    # Configured for 6 steps, called with 10: the state starts over after step 6, dropping the residual a
    # computed step just kept; the graphs of a computed step copy it into its buffer at every step alike.
    with cuda_pipeline(pipeline, "tiny") as reference, cuda_pipeline(pipeline, "tiny") as pipe:
        print("\n" + check_captures_per_call(reference, pipe, pipeline, "magcache", MIXED_SIZES, config_steps=6))


def test_taylorseer_steps_once_when_a_replay_switches_paths():
    # TaylorSeer's eager breaks advance its step and update its factors. A break after them whose Python result
    # changes from one transformer call to the next (here a forward hook on the last layer reading a flag that a
    # pre-hook flips) makes every replay switch paths: the graph runs again from the start, breaks included,
    # after CacheState.restart(). The image must still be eager's (no step taken twice).
    flag = {"value": 0}

    @eager_break
    def current_flag():
        return flag["value"]

    def flip(module, args):
        flag["value"] = 1 - flag["value"]

    def read_flag(module, args, output):
        current_flag()  # its result picks the path; the output stays the layer's (a hook returning None)

    case = COUNT_CASE["z-image"]
    with cuda_pipeline("z-image", "tiny") as reference, cuda_pipeline("z-image", "tiny") as pipe:
        for target in (reference, pipe):
            enable_cache(target, counting_config("taylorseer", COUNT_STEPS))
        expected = run_case(reference, "z-image", case, height=SIZE[0], width=SIZE[1], steps=COUNT_STEPS)
        handles = [
            pipe.transformer.layers[-1].register_forward_hook(read_flag),
            pipe.transformer.register_forward_pre_hook(flip),
        ]
        accelerate(pipe)
        try:
            for _ in range(3):
                image = run_case(pipe, "z-image", case, height=SIZE[0], width=SIZE[1], steps=COUNT_STEPS)
                assert torch.equal(image, expected)
            report = assert_graphs_ran(pipe, components=("transformer",))
            assert report["cache_branch_switches"] > 0, report
        finally:
            restore(pipe)
            for handle in handles:
                handle.remove()


@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_enable_and_disable_the_cache_while_accelerated(pipeline):
    case = CASE[pipeline]
    with cuda_pipeline(pipeline, "tiny") as pipe:
        plain = run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS)
        enable_cache(pipe, cache_config("taylorseer", STEPS))
        cached = run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS)
        disable_cache(pipe)
        accelerate(pipe)
        try:
            sequence = [("plain", plain), ("on", cached), ("plain", plain), ("on", cached), ("off", plain)]
            before = None
            for what, expected in sequence:
                if what == "on":
                    enable_cache(pipe, cache_config("taylorseer", STEPS))
                image = run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS)
                assert torch.equal(image, expected), what
                # a cache's first call captures a graph per decision and replays them at its later steps
                before = assert_graphs_ran(pipe, before, components=("transformer",))
                if what == "on":
                    disable_cache(pipe)
            assert stats(pipe)["invalidations"] == 0
        finally:
            restore(pipe)


# MagCache's accumulators become 0-d CPU tensors once its ratios are a tensor. They were kept in buffers that no graph
# writes and were not part of the key: after replays, a capture later in the same call decided on stale values. Z-Image's
# cfg_truncation makes such a call: its CFG steps (batch 2) replay, the steps after the truncation (batch 1) capture.
# H200, run 76: eager computed steps 0 and 6, the accelerated call steps 0, 5 and 7 (max difference 0.40). Host tensors
# now key the signature by value and a replay leaves the values its capture ended with (step_cache.CacheState).
STALE_RATIOS = [1.0, 1.02, 1.02, 1.02, 1.02, 1.02, 0.7, 1.0]  # steps 1-5 skip, the error passes 0.5 at step 6


def test_magcache_captured_after_replays_in_one_call_decides_as_eager():
    steps = len(STALE_RATIOS)

    def config():
        return MagCacheConfig(
            mag_ratios=STALE_RATIOS,
            num_inference_steps=steps,
            threshold=0.5,
            max_skip_steps=steps,
            retention_ratio=0.1,
        )

    def call(pipe, truncation):
        extra = {} if truncation is None else {"cfg_truncation": truncation}
        return pipe(
            prompt="a red fox in the snow", negative_prompt="blurry", guidance_scale=4.0, height=64, width=64,
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(0), output_type="pt", **extra,
        ).images.cpu()  # fmt: skip

    truncations = [None, 0.3]  # 0.3: batch 2 for steps 0-4, batch 1 for steps 5-7
    with cuda_pipeline("z-image", "tiny") as reference, cuda_pipeline("z-image", "tiny") as pipe:
        enable_cache(reference, config())
        counter = SkipCounter(reference.transformer)
        expected = [call(reference, t) for t in truncations]
        counter.remove()
        if not 0 < counter.skipped < counter.calls:  # else the test could not tell a stale decision
            pytest.fail(f"eager MagCache skipped {counter.skipped} of {counter.calls} calls")
        enable_cache(pipe, config())
        accelerate(pipe)
        try:
            images = [call(pipe, t) for t in truncations] + [call(pipe, t) for t in truncations]
            assert_graphs_ran(pipe, components=("transformer",))
            for image, reference_image in zip(images, expected + expected):
                assert torch.equal(image, reference_image), (image - reference_image).abs().max()
        finally:
            restore(pipe)


# ----------------------------------------------------------------------------------------- Cache-DiT
def _cuda_tiny(name):
    from bcg_diffusion.models import build_pipeline

    pipe = build_pipeline(name, "tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    ("pipeline", "kind"),
    [(n, k) for n in ("qwen-image", "z-image") for k in DIT_KINDS if (n, k) != ("z-image", "dynamic")],
)
def test_cache_dit_exact_mode_gives_eager_bytes_with_few_graphs(pipeline, kind):
    # Real graphs: the reuse path is a branch of each signature (at most 4 transformer graphs per new call
    # shape on Qwen-Image with true CFG, 2 on Z-Image), every call byte-equal to eager with the same options.
    pytest.importorskip("cache_dit")
    make = lambda: _cuda_tiny(pipeline)  # noqa: E731
    threshold = dit_threshold(make, pipeline, MIXED_SIZES) if kind == "dynamic" else 1.0
    print("\n" + check_cachedit_calls(make, pipeline, kind, MIXED_SIZES, threshold=threshold))


@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_cache_dit_after_accelerate_keeps_the_graphs_on_a_gpu(pipeline):
    pytest.importorskip("cache_dit")
    with pytest.warns(Warning, match="wrapped again"):
        print("\n" + check_cachedit_calls(lambda: _cuda_tiny(pipeline), pipeline, "static", MIXED_SIZES, when="after"))


@pytest.mark.parametrize("kind", ["static", "taylorseer"])
@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_cache_dit_fast_mode_gives_its_compiled_blocks_bytes(pipeline, kind):
    # Fast mode: byte-equal to the same compiled blocks without graphs (eager(pipe)) with the same Cache-DiT config.
    cache_dit = pytest.importorskip("cache_dit")
    pipe = _cuda_tiny(pipeline)
    cache_dit.enable_cache(pipe, **cachedit_options(kind))
    accelerate(pipe, mode="fast")
    try:
        for size, prompt in DIT_CALLS:
            image = mixed_call(pipe, pipeline, (size, prompt, True), MIXED_SIZES)
            with eager(pipe):
                expected = mixed_call(pipe, pipeline, (size, prompt, True), MIXED_SIZES)
            assert torch.equal(image, expected), (
                f"{MIXED_SIZES[size]}, prompt {prompt}: not its compiled blocks' bytes"
            )
        transformer = stats(pipe)["components"]["transformer"]
        assert transformer["captures"] > 0 and transformer["eager_fallbacks"] == 0
        print(
            f"\n{pipeline}/cache-dit {kind} fast: captures {transformer['captures']}, "
            f"branches {stats(pipe)['cache_branches']}"
        )
    finally:
        restore(pipe)


@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_cache_dit_static_mask_replays_without_switching_paths(pipeline):
    # A static mask alternates compute and reuse. Each replay starts in the path the same place of the last call
    # took (the runner's PathHints, Cache-DiT's path_hint), so a repeated call switches no path; before, nearly
    # every replay switched and re-ran the graph up to the decision (H200 run 88: 350 switches in 399 replays).
    cache_dit = pytest.importorskip("cache_dit")
    reference = _cuda_tiny(pipeline)
    cache_dit.enable_cache(reference, **cachedit_options("static"))
    expected = mixed_call(reference, pipeline, (0, 0, True), MIXED_SIZES)
    pipe = _cuda_tiny(pipeline)
    cache_dit.enable_cache(pipe, **cachedit_options("static"))
    accelerate(pipe)
    try:
        for _ in range(2):
            mixed_call(pipe, pipeline, (0, 0, True), MIXED_SIZES)
        before = stats(pipe)["cache_branch_switches"]
        image = mixed_call(pipe, pipeline, (0, 0, True), MIXED_SIZES)
        assert torch.equal(image, expected)
        assert stats(pipe)["cache_branch_switches"] == before, stats(pipe)
    finally:
        restore(pipe)


# ------------------------------------------------------------------------------ CFG batching under a cache
CFG_STEPS = 10


@pytest.mark.parametrize(
    ("cache", "negative"),
    [("magcache", SAME_LENGTH_NEGATIVE), ("magcache", OTHER_LENGTH_NEGATIVE), ("taylorseer", SAME_LENGTH_NEGATIVE)],
)
def test_fast_mode_batches_cfg_under_the_cache_with_the_unbatched_decisions(cache, negative):
    # Steps after the first run cond and uncond as one batch in the joint cache context (step_caching.cfg_join),
    # replayed from graphs keyed by it: the decisions are diffusers' one-by-one run's, every image is byte-equal
    # to the compiled blocks without graphs (eager(pipe), which batches the same way), and against diffusers only
    # bf16 rounding differs (batched GEMMs, compiled blocks): the largest difference is printed.
    with cuda_pipeline("qwen-image", "tiny") as pipe:
        enable_cache(pipe, cache_config(cache, CFG_STEPS))
        expected, expected_decisions = cfg_decisions(pipe, negative, steps=CFG_STEPS, size=SIZE)
        assert True in expected_decisions and False in expected_decisions
        accelerate(pipe, mode="fast")
        try:
            for call in range(3):
                before = stats(pipe)["cfg_batched"]
                image, decisions = cfg_decisions(pipe, negative, steps=CFG_STEPS, size=SIZE)
                report = assert_graphs_ran(pipe, components=("transformer",))
                assert (report["cfg_batched"] - before, report["cfg_batch_dropped"]) == (CFG_STEPS - 1, 0), report
                assert decisions == expected_decisions, call
                with eager(pipe):
                    reference, reference_decisions = cfg_decisions(pipe, negative, steps=CFG_STEPS, size=SIZE)
                assert torch.equal(image, reference), call
                assert reference_decisions == expected_decisions
            print(
                f"\n{cache}, negative {negative!r}: captures {report['captures']}, cache states "
                f"{report['cache_states']}, max difference against diffusers {(image - expected).abs().max().item():.3g}"
            )
            torch.testing.assert_close(image, expected, atol=0.1, rtol=0)  # loose: bf16 rounding only
        finally:
            restore(pipe)


@pytest.mark.parametrize("cache", ["magcache", "taylorseer"])
@pytest.mark.parametrize(("how", "call"), [("drop", 8), ("alone", 11)])
def test_cfg_batching_that_stops_mid_call_keeps_graphs_and_decisions(monkeypatch, cache, how, call):
    # The joint state is split back into the cond and uncond contexts (their own buffers) when a call runs alone,
    # from the copy kept before the batch for a dropped half, and joined again later (see the CPU test).
    with cuda_pipeline("qwen-image", "tiny") as pipe:
        enable_cache(pipe, cache_config(cache, CFG_STEPS))
        _, expected_decisions = cfg_decisions(pipe, SAME_LENGTH_NEGATIVE, steps=CFG_STEPS, size=SIZE)
        accelerate(pipe, mode="fast")
        stop_batching_at(monkeypatch, how, call, CFG_STEPS)
        try:
            for _ in range(2):
                image, decisions = cfg_decisions(pipe, SAME_LENGTH_NEGATIVE, steps=CFG_STEPS, size=SIZE)
                assert decisions == expected_decisions
                with eager(pipe):
                    reference, _ = cfg_decisions(pipe, SAME_LENGTH_NEGATIVE, steps=CFG_STEPS, size=SIZE)
                assert torch.equal(image, reference)
            report = assert_graphs_ran(pipe, components=("transformer",))
            assert report["cfg_batched"] > 0 and report["cfg_batch_dropped"] == (4 if how == "drop" else 0), report
        finally:
            restore(pipe)
