"""Fast mode's text-encoder trimming (:mod:`bcg_diffusion.features.text_trimming`) on CPU, against the untrimmed call."""

from __future__ import annotations

import pytest
import torch
from _cases import run_case
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.features.text_trimming import TrimmedTextEncoder
from bcg_diffusion.models import build_pipeline


@pytest.fixture(scope="module")
def z_image():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tokens(pipe, prompts: list[str], length: int = 512, side: str = "right"):
    tokenizer = pipe.tokenizer
    previous, tokenizer.padding_side = tokenizer.padding_side, side
    try:
        inputs = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = previous
    return inputs.input_ids, inputs.attention_mask.bool()


def test_trimmed_encoder_gives_the_valid_tokens_embeddings(z_image):
    encoder = z_image.text_encoder
    ids, mask = _tokens(z_image, ["a red fox in the snow", "a cat"])
    with torch.no_grad():
        full = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        trimmed = TrimmedTextEncoder(encoder.forward, multiple=64)
        got = trimmed(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert trimmed.trimmed == 1
    assert got.last_hidden_state.shape == full.last_hidden_state.shape
    assert len(got.hidden_states) == len(full.hidden_states)
    for ours, theirs in zip(got.hidden_states, full.hidden_states, strict=True):
        assert ours.shape == theirs.shape
        # Valid tokens: the same causal computation over fewer rows (float32: rounding only).
        torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)
        assert not ours[:, 64:].any()  # beyond the bucket: zeros, which the pipeline drops


def test_padding_that_is_not_on_the_right_is_left_as_called(z_image):
    encoder = z_image.text_encoder
    trimmed = TrimmedTextEncoder(encoder.forward, multiple=64)
    ids, mask = _tokens(z_image, ["a red fox in the snow", "a cat"], side="left")
    with torch.no_grad():
        assert torch.equal(
            trimmed(input_ids=ids, attention_mask=mask)[0], encoder(input_ids=ids, attention_mask=mask)[0]
        )
        gappy = mask.clone()
        gappy[0, 1] = False
        trimmed(input_ids=ids, attention_mask=gappy)
        short_ids, short_mask = _tokens(z_image, ["a cat"], length=64)  # already within one bucket
        trimmed(input_ids=short_ids, attention_mask=short_mask)
        trimmed(input_ids=ids)  # no mask
    assert trimmed.trimmed == 0
    with pytest.raises(ValueError, match="positive int"):
        TrimmedTextEncoder(encoder.forward, multiple=0)


def test_fast_mode_trims_z_image_prompts_and_restore_undoes_it(z_image):
    forward = z_image.text_encoder.forward
    z_image.transformer._repeated_blocks = []  # no compile here: this test is about the text encoder
    try:
        with pytest.warns(UserWarning, match="falls back to graphs of the eager blocks"):
            accelerate(z_image, mode="fast", debug=True)
        first = run_case(z_image, "z-image", "cfg", height=64, width=64)
        assert_graphs_ran(z_image, captures=True)
        with eager(z_image):
            reference = run_case(z_image, "z-image", "cfg", height=64, width=64)
        assert torch.equal(first, reference)
        assert stats(z_image)["text_encoder_trimmed"] == 4  # prompt and negative prompt, twice
    finally:
        restore(z_image)
        del z_image.transformer._repeated_blocks
    assert z_image.text_encoder.forward == forward
    expected = run_case(z_image, "z-image", "cfg", height=64, width=64)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)


def test_warm_up_covers_every_trim_bucket_of_a_captured_encoder(z_image):
    z_image.transformer._repeated_blocks = []
    try:
        with pytest.warns(UserWarning, match="falls back to graphs of the eager blocks"):
            accelerate(
                z_image,
                mode="fast",
                debug=True,
                components=("transformer", "vae", "text_encoder"),
                lazy_capture=False,
            )
        warm_up(z_image, [(64, 64)], cfg=(False,), max_sequence_length=256)
        warmed = stats(z_image)["components"]["text_encoder"]
        for words in (1, 70, 150, 230):  # prompts in each 64-token bucket up to 256 tokens
            z_image(
                prompt=" ".join(["fox"] * words),
                height=64,
                width=64,
                num_inference_steps=2,
                guidance_scale=0.0,
                max_sequence_length=256,
            )
        served = stats(z_image)["components"]["text_encoder"]
        assert (served["captures"], served["misses"]) == (warmed["captures"], 0)
        assert stats(z_image)["text_encoder_trimmed"] > 4
    finally:
        restore(z_image)
        del z_image.transformer._repeated_blocks
