"""Step caching inside real graphs (marker: cuda): each diffusers cache keeps its graphs and gives the
bytes of eager with the same cache; in fast mode, of the compiled blocks without graphs.

A replay runs no Python: these are the tests where a cache decision or a kept tensor that the graphs
did not carry would show (the CPU tests, in debug mode, run the hooks' Python on every call).
"""

from __future__ import annotations

import pytest
import torch
from _caches import CACHES, cache_config, mixed_threshold
from _cases import cuda_pipeline, run_case
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.graphs import GraphPool, eager_break
from bcg_diffusion.runner import GraphRunner
from bcg_diffusion.step_cache import SkipCounter, disable_cache, enable_cache

pytestmark = pytest.mark.cuda

CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}
STEPS = 6
SIZE = (64, 64)


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
            report = assert_graphs_ran(pipe)
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
                f"\n{pipeline}/{cache}/{mode}: skipped {counter.skipped}/{counter.calls} captures={report['captures']} "
                f"replays={report['replays']} branches={report['cache_branches']} states={report['cache_states']}"
            )
            counter.remove()
        finally:
            restore(pipe)
        # restore leaves the cache on, eager, with diffusers' own methods
        assert torch.equal(run_case(pipe, pipeline, case, height=SIZE[0], width=SIZE[1], steps=STEPS), eager_images[0])
        disable_cache(pipe)


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
                before = assert_graphs_ran(pipe, before)
                if what == "on":
                    disable_cache(pipe)
            assert stats(pipe)["invalidations"] == 0
        finally:
            restore(pipe)
