"""Warm-up and serving without lazy capture, in debug mode on CPU (the runner path, no graphs)."""

from __future__ import annotations

import logging

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import AccelerateConfig, BCGWarning, accelerate, eager, restore, stats, warm_up
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.pipelines import adapter_for
from bcg_diffusion.warmup import DEFAULT_WARMUP_PROMPT


def _pipe(name):
    pipe = build_pipeline(name, "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, width, height, cfg, steps=3, prompt=DEFAULT_WARMUP_PROMPT):
    kwargs = adapter_for(pipe).warmup_kwargs(width, height, cfg, prompt)
    kwargs.update(num_inference_steps=steps, output_type="pt", generator=torch.Generator().manual_seed(1))
    return pipe(**kwargs).images


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_after_warm_up_serving_calls_never_capture(name):
    pipe = _pipe(name)
    accelerate(pipe, debug=True, lazy_capture=False, warmup=[(64, 64), (48, 96)])
    try:
        warmed = stats(pipe)
        # Per resolution: the VAE decode, and transformer signatures. Qwen-Image (exact): one per text
        # length that runs (true CFG adds the negative prompt's). Z-Image: one per caption bucket up to
        # 512 tokens (16) and CFG mode (CFG doubles the batch); and its text encoder, whose prompts are
        # all padded to 512 tokens: one signature.
        expected = {"qwen-image": 6, "z-image": 2 * (1 + 2 * 16) + 1}[name]
        assert warmed["captures"] == expected and warmed["misses"] == 0, warmed["signatures"]
        checked = warmed
        for width, height in ((64, 64), (48, 96)):
            for cfg in (False, True):
                image = _call(pipe, width, height, cfg)
                checked = assert_graphs_ran(pipe, checked, captures=False)
                with eager(pipe):
                    assert torch.equal(image, _call(pipe, width, height, cfg))
        served = stats(pipe)
        assert (served["captures"], served["misses"]) == (expected, 0)
        assert served["replays"] > warmed["replays"]
    finally:
        restore(pipe)


def test_a_miss_runs_eagerly_is_counted_and_logged_once(caplog):
    pipe = _pipe("qwen-image")
    accelerate(pipe, debug=True, lazy_capture=False, warmup=[(64, 64)], warmup_cfg=(False,))
    try:
        with eager(pipe):
            expected = _call(pipe, 80, 80, cfg=False)
        with caplog.at_level(logging.WARNING, logger="bcg_diffusion.core.runner"):
            first = _call(pipe, 80, 80, cfg=False)
            second = _call(pipe, 80, 80, cfg=False)
        assert torch.equal(first, expected) and torch.equal(second, expected)
        report = stats(pipe)
        assert report["captures"] == 2  # the warm-up's transformer and VAE signatures only
        assert report["misses"] == 2 * (3 + 1)  # two calls, each 3 transformer steps and a decode
        warned = [r.getMessage() for r in caplog.records if "was not warmed up" in r.getMessage()]
        assert len(warned) == 2, warned  # once per missed signature (transformer, VAE), not per call
        result = warm_up(pipe, [(80, 80)], cfg=(False,))
        assert result["calls"] == 1 and result["captures"] == 2
        warmed = stats(pipe)
        replays = warmed["replays"]
        assert torch.equal(_call(pipe, 80, 80, cfg=False), expected)
        assert stats(pipe)["replays"] > replays and stats(pipe)["misses"] == report["misses"]
        assert_graphs_ran(pipe, warmed, captures=False)  # the two misses above ran eagerly: this call did not
    finally:
        restore(pipe)


def test_lazy_capture_is_the_default():
    pipe = _pipe("z-image")
    accelerate(pipe, debug=True)
    try:
        _call(pipe, 64, 64, cfg=False)
        assert stats(pipe)["captures"] == 3 and stats(pipe)["misses"] == 0  # text encoder, transformer, VAE
    finally:
        restore(pipe)


def test_warm_up_refuses_what_it_cannot_warm():
    pipe = _pipe("z-image")
    with pytest.raises(ValueError, match="not accelerated"):
        warm_up(pipe, [(64, 64)])
    with pytest.warns(BCGWarning, match="leaving"):
        accelerate(pipe)  # on CPU without debug: left eager
    try:
        assert warm_up(pipe, [(64, 64)]) == {"calls": 0, "captures": 0, "seconds": 0.0}
    finally:
        restore(pipe)
    accelerate(pipe, debug=True)
    try:
        with pytest.raises(TypeError, match="pairs"):
            warm_up(pipe, [512])
    finally:
        restore(pipe)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"warmup": 512}, TypeError, "list of"),
        ({"warmup": [(512,)]}, TypeError, "pairs of ints"),
        ({"warmup": [(512, 0)]}, ValueError, "positive"),
        ({"warmup_cfg": True}, TypeError, "tuple of bools"),
        ({"warmup_cfg": ()}, ValueError, "at least one"),
        ({"lazy_capture": "no"}, TypeError, "lazy_capture must be a bool"),
    ],
)
def test_warm_up_options_are_validated(options, error, match):
    with pytest.raises(error, match=match):
        AccelerateConfig(**options)


def test_warm_up_options_normalise():
    config = AccelerateConfig(warmup=[[512, 512], (1024, 768), (512, 512)], warmup_cfg=[True, True])
    assert config.warmup == ((512, 512), (1024, 768)) and config.warmup_cfg == (True,)


def test_a_warm_up_larger_than_max_signatures_warns():
    pipe = _pipe("qwen-image")
    accelerate(pipe, debug=True, lazy_capture=False, max_signatures=2)
    try:
        with pytest.warns(BCGWarning, match="max_signatures=2 evicted"):
            result = warm_up(pipe, [(64, 64), (48, 96)], cfg=(False,))
        assert result["captures"] == 4 and stats(pipe)["evictions"] == 2
    finally:
        restore(pipe)
