"""Z-Image caption buckets: the model's own padding done before the call, with device-side pad masks.

The patched path must give the same bytes as the original forward with exact-length captions, for
one caption and for batches whose captions fall into different buckets (CFG), and one captured
signature must then serve every prompt of a bucket.
"""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches.zimage import (
    bucket_captions,
    caption_bucket,
    pad_captions,
    patchify_with_caption_masks,
    using_caption_masks,
    with_caption_masks,
)
from bcg_diffusion.pipelines import adapter_for

# What the caption buckets are about; the text encoder (accelerated by default) adds signatures of its own.
TRANSFORMER_AND_VAE = ("transformer", "vae")


@pytest.fixture(scope="module")
def pipe():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_caption_bucket_is_the_next_multiple_of_32():
    assert [caption_bucket(n) for n in (1, 31, 32, 33, 64, 65, 512)] == [32, 32, 32, 64, 64, 96, 512]


@pytest.mark.parametrize("length", [1, 5, 31, 32, 33, 70, 96])
def test_pad_captions_pads_like_the_model(pipe, length):
    feat = torch.randn(length, 8, generator=torch.Generator().manual_seed(length))
    bucket = caption_bucket(length)
    expected, _, expected_mask, total, _ = pipe.transformer._pad_with_ids(feat, (bucket, 1, 1), (1, 0, 0), "cpu")
    (padded,), (mask,) = pad_captions([feat])
    assert total == bucket and torch.equal(padded, expected) and torch.equal(mask, expected_mask)


@pytest.mark.parametrize("lengths", [(5,), (32,), (33,), (5, 40), (7, 20), (64, 3), (70, 70, 1)])
def test_bucketed_forward_equals_the_original(pipe, lengths):
    transformer = pipe.transformer
    generator = torch.Generator().manual_seed(sum(lengths))
    x = [torch.randn(4, 1, 8, 8, generator=generator) for _ in lengths]
    t = torch.rand(len(lengths), generator=generator)
    caps = [torch.randn(n, transformer.config.cap_feat_dim, generator=generator) for n in lengths]
    with torch.no_grad():
        expected = transformer(x, t, caps, return_dict=False)[0]
        args, kwargs = bucket_captions((x, t, caps), {"return_dict": False})
        assert [len(c) for c in args[2]] == [caption_bucket(n) for n in lengths]
        original = transformer.patchify_and_embed
        transformer.patchify_and_embed = patchify_with_caption_masks(original)
        try:
            got = with_caption_masks(transformer.forward)(*args, **kwargs)[0]
        finally:
            del transformer.patchify_and_embed
    assert len(got) == len(expected)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_masks_that_do_not_match_the_captions_are_refused(pipe):
    transformer = pipe.transformer
    patched = patchify_with_caption_masks(transformer.patchify_and_embed)
    image, caption = torch.randn(4, 1, 8, 8), torch.randn(32, transformer.config.cap_feat_dim)
    with using_caption_masks([torch.zeros(64, dtype=torch.bool)]), pytest.raises(ValueError, match="do not match"):
        patched([image], [caption], 2, 1)


def test_calls_that_are_not_plain_text_to_image_pass_unchanged():
    nested = ([[torch.zeros(4, 1, 8, 8)]], torch.zeros(1), [[torch.zeros(5, 8)]])
    assert bucket_captions(nested, {}) == (nested, {})
    with pytest.raises(ValueError, match="non-empty"):
        pad_captions([torch.zeros(0, 8)])


def _call(pipe, prompt, cfg, size=64, **extra):
    kwargs = adapter_for(pipe).warmup_kwargs(size, size, cfg, prompt)
    kwargs.update(num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(3), **extra)
    return pipe(**kwargs).images


def test_prompts_of_one_bucket_share_one_signature(pipe):
    accelerate(pipe, debug=True, components=TRANSFORMER_AND_VAE)
    try:
        lengths, checked = set(), None
        for index, prompt in enumerate(("a cat", "a lighthouse on a rocky coast at dusk")):  # 10, 17 tokens: bucket 32
            lengths.add(len(pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)[0][0]))
            image = _call(pipe, prompt, cfg=False)
            checked = assert_graphs_ran(pipe, checked, captures=index == 0)  # the second prompt replays the first's
            with eager(pipe):
                assert torch.equal(image, _call(pipe, prompt, cfg=False))
        assert len(lengths) == 2
        assert stats(pipe)["captures"] == 2  # one transformer signature and the VAE decode
    finally:
        restore(pipe)


def test_warm_up_covers_every_prompt_up_to_max_sequence_length(pipe):
    accelerate(pipe, debug=True, lazy_capture=False, components=TRANSFORMER_AND_VAE)
    try:
        result = warm_up(pipe, [(64, 64)], max_sequence_length=96)
        # Per CFG mode: the default prompt's call, then one call per bucket (32, 64, 96); one
        # transformer signature per bucket and CFG mode, and the VAE decode.
        assert result["calls"] == 2 * (1 + 3) and result["captures"] == 2 * 3 + 1
        checked = stats(pipe)
        for words in (1, 4, 9, 15):
            prompt = " ".join(["word"] * words)
            for cfg in (False, True):
                image = _call(pipe, prompt, cfg)
                checked = assert_graphs_ran(pipe, checked, captures=False)
                with eager(pipe):
                    assert torch.equal(image, _call(pipe, prompt, cfg))
        served = stats(pipe)
        assert (served["captures"], served["misses"], served["eager_fallbacks"]) == (7, 0, 0)
    finally:
        restore(pipe)


def test_warm_up_with_the_services_negative_prompt(pipe):
    """With CFG the negative prompt's bucket is part of every signature: a warm-up given the service's
    negative prompt (68 tokens, cut to the service's 64: bucket 64, not the default's 32) covers its calls."""
    negative = " ".join(["word"] * 15)
    accelerate(pipe, debug=True, lazy_capture=False, components=TRANSFORMER_AND_VAE)
    try:
        result = warm_up(pipe, [(64, 64)], cfg=(True,), negative_prompt=negative, max_sequence_length=64)
        assert result["captures"] == 2 + 1  # buckets 32 and 64, each with the negative's 64; the VAE decode
        checked = stats(pipe)
        for words in (1, 9):  # buckets 32 and 64
            prompt = " ".join(["word"] * words)
            service = {"negative_prompt": negative, "max_sequence_length": 64}
            image = _call(pipe, prompt, cfg=True, **service)
            checked = assert_graphs_ran(pipe, checked, captures=False)
            with eager(pipe):
                assert torch.equal(image, _call(pipe, prompt, cfg=True, **service))
        assert (stats(pipe)["captures"], stats(pipe)["misses"]) == (3, 0)
    finally:
        restore(pipe)
