"""max_signatures: least-recently-used eviction across a pipeline's components (CPU, debug mode)."""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import AccelerateConfig, accelerate, eager, restore, stats
from bcg_diffusion.core.budget import SignatureBudget
from bcg_diffusion.models import build_pipeline


class _FakeRunner:
    def __init__(self, name):
        self.name, self.evicted = name, []

    def evict(self, key):
        self.evicted.append(key)


def test_least_recently_used_signature_goes_first():
    budget = SignatureBudget(2)
    transformer, vae = _FakeRunner("transformer"), _FakeRunner("vae")
    budget.admit(transformer, "a")
    budget.admit(vae, "a")
    budget.touch(transformer, "a")  # the VAE's "a" is now the oldest
    budget.admit(transformer, "b")
    assert vae.evicted == ["a"] and transformer.evicted == [] and len(budget) == 2
    budget.forget(transformer)
    assert len(budget) == 0 and budget.evictions == 1


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_limits_are_refused(value, error):
    with pytest.raises(error, match="max_signatures"):
        AccelerateConfig(max_signatures=value)


def _call(pipe, size):
    return pipe(
        prompt="a red fox",
        height=size,
        width=size,
        num_inference_steps=2,
        guidance_scale=0.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def test_pipeline_stays_within_the_limit_and_stays_exact():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    with_eager = {size: _call(pipe, size) for size in (64, 48, 80)}
    # One resolution: a transformer and a VAE signature (the text encoder, which would take a third, kept eager).
    accelerate(pipe, debug=True, max_signatures=2, components=("transformer", "vae"))
    try:
        checked = None
        for size in (64, 48, 64, 80, 80):
            assert torch.equal(_call(pipe, size), with_eager[size]), size
            assert len(stats(pipe)["signatures"]) <= 2
            checked = assert_graphs_ran(pipe, checked)  # (re)captured after an eviction, and replayed
        report = stats(pipe)
        # 64, 48 (evicts 64), 64 again (evicts 48), 80 (evicts 64), 80 replays.
        assert report["captures"] == 8 and report["evictions"] == 6, report
        assert report["replays"] > 0 and report["eager_fallbacks"] == 0
        with eager(pipe):
            assert torch.equal(_call(pipe, 48), with_eager[48])
    finally:
        restore(pipe)
