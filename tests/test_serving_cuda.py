"""Serving on a GPU: warm-up, no capture afterwards, text buckets, eviction (marker: cuda).

Weights from ``BCG_TEST_WEIGHTS`` (default ``tiny``), as in ``test_pipelines_cuda.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from _cases import GPU_WEIGHTS, cuda_pipeline
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.pipelines import adapter_for
from bench.serving import without_buckets

pytestmark = pytest.mark.cuda

RESOLUTIONS = {"tiny": [(64, 64), (48, 96)], "random-full": [(512, 512), (768, 1344)]}
WORDS = [
    "a",
    "red",
    "fox",
    "lighthouse",
    "coast",
    "dusk",
    "painting",
    "snow",
    "river",
    "mountain",
    "old",
    "city",
    "night",
    "rain",
    "cat",
]


def _random_prompt(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


@pytest.fixture(params=GPU_WEIGHTS)
def qwen(request):
    with cuda_pipeline("qwen-image", request.param) as pipe:
        yield request.param, pipe


def _call(pipe, prompt, size, cfg, **extra):
    """Two steps at ``size`` with CFG on or off, the adapter's own switch (Qwen's true CFG, Z-Image's
    guidance), as a tensor."""
    kwargs = adapter_for(pipe).warmup_kwargs(*size, cfg=cfg, prompt=prompt)
    kwargs.update(num_inference_steps=2, output_type="pt", generator=torch.Generator("cpu").manual_seed(0))
    return pipe(**kwargs, **extra).images


def test_bucketed_serving_never_captures_after_warm_up(qwen):
    weights, pipe = qwen
    resolutions = RESOLUTIONS[weights]
    accelerate(pipe, text_buckets=(64, 128), warmup=resolutions, lazy_capture=False)
    try:
        warmed = checked = stats(pipe)
        rng = random.Random(0)
        worst = 0.0
        for _ in range(20):
            prompt, size, cfg = _random_prompt(rng), rng.choice(resolutions), rng.random() < 0.5
            image = _call(pipe, prompt, size, cfg)
            checked = assert_graphs_ran(pipe, checked, captures=False)  # replayed what the warm-up captured
            with eager(pipe):  # eager with the same padding: the graphs must match it exactly
                assert torch.equal(image, _call(pipe, prompt, size, cfg))
            with without_buckets(pipe):
                plain = _call(pipe, prompt, size, cfg)
            worst = max(worst, (image.float() - plain.float()).abs().max().item())
        served = stats(pipe)
        assert served["captures"] == warmed["captures"] and served["misses"] == 0, served
        print(f"\nbuckets vs unpadded, {weights}: max abs difference {worst:.4g} over 20 calls")
        assert worst < 0.1, worst  # bf16 masked vs unmasked attention; recorded under bench/results
    finally:
        restore(pipe)


def test_eviction_returns_pool_memory_for_reuse(qwen):
    weights, pipe = qwen
    sizes = RESOLUTIONS[weights]
    accelerate(pipe, max_signatures=2)
    try:
        pool, checked = [], None
        for _ in range(3):
            for size in sizes:
                image = _call(pipe, "a red fox", size, cfg=False)
                checked = assert_graphs_ran(pipe, checked)  # (re)captured after an eviction, and replayed
                with eager(pipe):
                    assert torch.equal(image, _call(pipe, "a red fox", size, cfg=False))
            pool.append(stats(pipe)["graph_memory_bytes"])
        report = stats(pipe)
        assert report["evictions"] > 0 and len(report["signatures"]) <= 2
        print(f"\npool with max_signatures=2 after each cycle over {sizes}: {[p / 2**20 for p in pool]} MiB")
        assert pool[-1] <= pool[0] * 1.1, pool  # evicted blocks are reused by the next captures
    finally:
        restore(pipe)


@pytest.fixture(params=GPU_WEIGHTS)
def zimage(request):
    with cuda_pipeline("z-image", request.param) as pipe:
        yield request.param, pipe


def test_zimage_caption_buckets_serve_every_prompt_exactly(zimage):
    """Z-Image needs no text buckets: its own caption buckets (multiples of 32) are exact, and a warm-up
    covers all of them up to max_sequence_length."""
    weights, pipe = zimage
    resolutions = RESOLUTIONS[weights]
    accelerate(pipe, lazy_capture=False)
    try:
        warm_up(pipe, resolutions, max_sequence_length=128)
        warmed = checked = stats(pipe)
        rng = random.Random(1)
        for _ in range(20):
            prompt, size, cfg = _random_prompt(rng), rng.choice(resolutions), rng.random() < 0.5
            image = _call(pipe, prompt, size, cfg, max_sequence_length=128)
            checked = assert_graphs_ran(pipe, checked, captures=False)
            with eager(pipe):
                assert torch.equal(image, _call(pipe, prompt, size, cfg, max_sequence_length=128))
        served = stats(pipe)
        assert served["captures"] == warmed["captures"] and served["misses"] == 0, served
        assert served["eager_fallbacks"] == 0, served
    finally:
        restore(pipe)
