"""Text-length buckets (Qwen-Image): choice, padding, equivalence with the unpadded call (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import AccelerateConfig, BCGWarning, accelerate, restore, stats
from bcg_diffusion.config import validate_buckets
from bcg_diffusion.features.text_buckets import bucket_for, pad_to_bucket
from bcg_diffusion.models import build_pipeline

PROMPTS = [
    "a fox",
    "a red fox in the snow at dawn",
    "a detailed oil painting of an old lighthouse on a rocky coast at sunset, waves and seagulls",
]


def test_bucket_choice():
    buckets = validate_buckets([256, 64, 128, 64])
    assert buckets == (64, 128, 256)
    assert [bucket_for(n, buckets) for n in (1, 64, 65, 256, 257)] == [64, 64, 128, 256, None]


@pytest.mark.parametrize(
    ("value", "error"),
    [(64, TypeError), ("64", TypeError), ([], ValueError), ([0, 64], ValueError), ([1.5], TypeError)],
)
def test_bad_buckets_are_refused(value, error):
    with pytest.raises(error):
        AccelerateConfig(text_buckets=value)


def test_padding_adds_zero_tokens_and_masks_them():
    embeds = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    padded, padded_mask = pad_to_bucket(embeds, mask, (4, 8))
    assert padded.shape == (2, 8, 8) and torch.equal(padded[:, :5], embeds) and not padded[:, 5:].any()
    assert padded_mask.dtype == torch.long and torch.equal(padded_mask[:, :5], mask) and not padded_mask[:, 5:].any()
    _, full_mask = pad_to_bucket(embeds, None, (8,))  # no mask: every real token valid
    assert full_mask[:, :5].all() and not full_mask[:, 5:].any()
    unchanged, none_mask = pad_to_bucket(embeds, None, (4,))  # longer than every bucket
    assert unchanged is embeds and none_mask is None


def _call(pipe, prompt, negative="ugly"):
    return pipe(
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=3,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def test_bucketed_calls_share_signatures_and_match_the_unpadded_images():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    lengths = [pipe.encode_prompt(p, device="cpu")[0].shape[1] for p in PROMPTS]
    assert len(set(lengths)) == len(PROMPTS), lengths  # without buckets: one signature per length
    expected = {p: _call(pipe, p) for p in PROMPTS}
    accelerate(pipe, debug=True, text_buckets=(16, 32), warmup=[(64, 64)], lazy_capture=False)
    try:
        checked = stats(pipe)
        warmed = checked["captures"]
        assert warmed == 3  # a transformer signature per bucket, and the VAE
        for prompt in PROMPTS:
            # fp32 on CPU: the masked path only sums extra exact zeros; measured max 1e-6 here.
            torch.testing.assert_close(_call(pipe, prompt), expected[prompt], atol=1e-5, rtol=0)
            checked = assert_graphs_ran(pipe, checked, captures=False)
        report = stats(pipe)
        assert report["captures"] == warmed and report["misses"] == 0 and report["eager_fallbacks"] == 0
    finally:
        restore(pipe)
    assert "encode_prompt" not in pipe.__dict__  # the padding wrapper is gone
    assert pipe.encode_prompt(PROMPTS[0], device="cpu")[1] is None


def test_buckets_are_refused_for_z_image():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    with pytest.warns(BCGWarning, match="text_buckets ignored"):
        accelerate(pipe, debug=True, text_buckets=(64,))
    try:
        assert "encode_prompt" not in pipe.__dict__
    finally:
        restore(pipe)


def test_a_bucketed_warm_up_with_cfg_also_covers_calls_without():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, debug=True, text_buckets=(32,), warmup=[(64, 64)], warmup_cfg=(True,), lazy_capture=False)
    try:
        for prompt in PROMPTS:
            pipe(prompt=prompt, height=64, width=64, num_inference_steps=2, output_type="pt")
        report = stats(pipe)
        assert report["captures"] == 2 and report["misses"] == 0, report["signatures"]
    finally:
        restore(pipe)
