"""Fast mode's attention patches (:mod:`bcg_diffusion.patches.attention`) on CPU.

cuDNN itself needs a GPU (``test_fast_cuda.py`` runs it); here the per-group joint attention of a CFG
batch is checked against diffusers' masked processor, and its plumbing (processor arguments, the
batcher passing text lengths, compiled blocks tracing it) through the tiny Qwen-Image pipeline.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _cases import run_case, zimage_block_call
from _checks import assert_graphs_ran, needs_compiler

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features.cfg_batching import CfgBatcher
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches.attention import (
    QWEN_ATTENTION_PATCH,
    TEXT_LENGTHS_KWARG,
    ZIMAGE_ATTENTION_PATCH,
    ZIMAGE_ROPE_PATCH,
    cudnn_attention_unsupported,
    dispatch_attention_fn,
    qwen_joint_attention_per_group,
)
from bcg_diffusion.pipelines.qwenimage import QwenImageAdapter

heavy = pytest.mark.heavy  # compiles with inductor on CPU


@pytest.fixture
def qwen():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _block_inputs(transformer, lengths: tuple[int, ...], rows: int, image: tuple[int, int, int] = (1, 4, 4)):
    """Random block-level inputs for ``len(lengths)`` groups of ``rows`` rows, padded to the longest
    text, with the mask the pipeline would pass and the RoPE tables."""
    generator = torch.Generator().manual_seed(sum(lengths) + rows)
    attn = transformer.transformer_blocks[0].attn
    batch, text_tokens, width = rows * len(lengths), max(lengths), attn.inner_dim
    image_tokens = image[0] * image[1] * image[2]
    hidden_states = torch.randn(batch, image_tokens, width, generator=generator)
    encoder_hidden_states = torch.randn(batch, text_tokens, width, generator=generator)
    mask = torch.zeros(batch, text_tokens, dtype=torch.bool)
    for group, length in enumerate(lengths):
        mask[group * rows : (group + 1) * rows, :length] = True
    rope = transformer.pos_embed([image] * batch, max_txt_seq_len=text_tokens, device="cpu")
    return attn, hidden_states, encoder_hidden_states, mask, rope


@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2), ((5, 5), 1)])
def test_per_group_attention_matches_the_masked_processor(qwen, lengths, rows):
    attn, hidden_states, text, mask, rope = _block_inputs(qwen.transformer, lengths, rows)
    with torch.no_grad():
        expected_image, expected_text = attn.processor(attn, hidden_states, text, mask, None, rope)
        image, text_out = qwen_joint_attention_per_group(attn.processor, attn, hidden_states, text, rope, lengths)
    # float32; only the RoPE (real arithmetic) and the skipped padded keys round differently.
    torch.testing.assert_close(image, expected_image, atol=1e-6, rtol=1e-5)
    for row in range(text.shape[0]):
        valid = lengths[row // rows]
        torch.testing.assert_close(text_out[row, :valid], expected_text[row, :valid], atol=1e-6, rtol=1e-5)
        assert not text_out[row, valid:].sub(attn.to_add_out.bias).any()  # padded positions: zeros projected


def test_per_group_attention_refuses_lengths_that_do_not_fit(qwen):
    attn, hidden_states, text, _, rope = _block_inputs(qwen.transformer, (6, 3), 1)
    with pytest.raises(ValueError, match="equal groups"):
        qwen_joint_attention_per_group(attn.processor, attn, hidden_states, text, rope, (6, 3, 2))
    with pytest.raises(ValueError, match="exceed"):
        qwen_joint_attention_per_group(attn.processor, attn, hidden_states, text, rope, (7, 3))


def test_dispatch_off_cuda_is_diffusers_own():
    from diffusers.models.attention_dispatch import dispatch_attention_fn as original

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 11, 3, 16, generator=generator) for _ in range(3))
    mask = torch.rand(2, 1, 1, 11, generator=generator) > 0.3
    assert torch.equal(dispatch_attention_fn(query, key, value), original(query, key, value))
    assert torch.equal(
        dispatch_attention_fn(query, key, value, attn_mask=mask), original(query, key, value, attn_mask=mask)
    )


def test_cudnn_dispatch_applies_only_where_it_was_measured(qwen):
    z_image = build_pipeline("z-image", "tiny", device="cpu").transformer
    assert cudnn_attention_unsupported(z_image) == "the model is not on a CUDA GPU"
    processors = [type(m.processor) for m in z_image.modules() if "processor" in m.__dict__]
    assert ZIMAGE_ATTENTION_PATCH.apply(z_image, MethodPatches()) == 0
    assert [type(m.processor) for m in z_image.modules() if "processor" in m.__dict__] == processors
    # Qwen-Image's per-prompt attention keeps diffusers' dispatch, and so applies on any device.
    assert QWEN_ATTENTION_PATCH.condition is None


@pytest.mark.parametrize("mask", [False, True])
def test_zimage_processor_without_autocast_equals_diffusers(mask):
    """The Z-Image processor of fast mode (RoPE without diffusers' no-op autocast context) computes
    exactly what diffusers' does, with and without a key mask; on CPU the cuDNN variant stays off."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    transformer = build_pipeline("z-image", "tiny", device="cpu").transformer
    block = transformer.layers[0]
    with torch.no_grad():
        expected = zimage_block_call(block, torch.Generator().manual_seed(0), mask)
        patches = MethodPatches()
        assert ZIMAGE_ATTENTION_PATCH.apply(transformer, patches) == 0  # not on a GPU: the other one
        assert ZIMAGE_ROPE_PATCH.apply(transformer, patches) > 0
        try:
            assert type(block.attention.processor).__call__ is not ZSingleStreamAttnProcessor.__call__
            got = zimage_block_call(block, torch.Generator().manual_seed(0), mask)
        finally:
            patches.undo()
    assert torch.equal(got, expected)
    assert type(block.attention.processor).__call__ is ZSingleStreamAttnProcessor.__call__


def test_patched_processor_takes_text_lengths_and_is_unchanged_without_them(qwen):
    transformer = qwen.transformer
    attn, hidden_states, text, mask, rope = _block_inputs(transformer, (9, 4), 1)
    with torch.no_grad():
        original = attn(
            hidden_states=hidden_states,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            image_rotary_emb=rope,
        )
        patches = MethodPatches()
        assert QWEN_ATTENTION_PATCH.apply(transformer, patches) == len(transformer.transformer_blocks)
        try:
            assert TEXT_LENGTHS_KWARG in inspect.signature(attn.processor.__call__).parameters
            unchanged = attn(
                hidden_states=hidden_states,
                encoder_hidden_states=text,
                encoder_hidden_states_mask=mask,
                image_rotary_emb=rope,
            )
            per_group = attn(
                hidden_states=hidden_states,
                encoder_hidden_states=text,
                encoder_hidden_states_mask=mask,
                image_rotary_emb=rope,
                **{TEXT_LENGTHS_KWARG: (9, 4)},
            )
        finally:
            patches.undo()
    assert all(torch.equal(a, b) for a, b in zip(unchanged, original, strict=True))  # off CUDA: diffusers' code
    torch.testing.assert_close(per_group[0], original[0], atol=1e-6, rtol=1e-5)
    assert TEXT_LENGTHS_KWARG not in inspect.signature(attn.processor.__call__).parameters  # undone


def test_batcher_passes_text_lengths_of_unmasked_prompts(qwen):
    expected = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    seen = []
    forward = qwen.transformer.forward

    def recording(*args, **kwargs):
        seen.append((kwargs["hidden_states"].shape[0], kwargs.get("attention_kwargs")))
        return forward(*args, **kwargs)

    patches = MethodPatches()
    QWEN_ATTENTION_PATCH.apply(qwen.transformer, patches)
    spec = QwenImageAdapter.cfg_batch
    qwen.transformer.forward = CfgBatcher(
        recording, inspect.signature(forward), spec, text_lengths_key=TEXT_LENGTHS_KWARG
    )
    try:
        got = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    finally:
        del qwen.transformer.forward
        patches.undo()
    batched = [kwargs for batch, kwargs in seen if batch == 2]
    assert len(batched) == 2 and all(set(kwargs) == {TEXT_LENGTHS_KWARG} for kwargs in batched)
    cond_length, negative_length = batched[0][TEXT_LENGTHS_KWARG]
    assert cond_length != negative_length  # the case's prompts differ in length: the masked batch
    assert all(not kwargs for batch, kwargs in seen if batch == 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_masked_prompts_get_no_text_lengths(qwen):
    seen = []
    forward = qwen.transformer.forward

    def recording(*args, **kwargs):
        seen.append((kwargs["hidden_states"].shape[0], kwargs.get("attention_kwargs")))
        return forward(*args, **kwargs)

    spec = QwenImageAdapter.cfg_batch
    qwen.transformer.forward = CfgBatcher(
        recording, inspect.signature(forward), spec, text_lengths_key=TEXT_LENGTHS_KWARG
    )
    run_case(qwen, "qwen-image", "mask_two_lengths", height=64, width=64, steps=3)
    assert [batch for batch, _ in seen] == [2, 2, 4, 4]
    assert all(not kwargs for _, kwargs in seen)  # a mask says which tokens are valid, not lengths


@needs_compiler
@heavy
def test_fast_mode_compiles_the_per_group_attention(qwen):
    expected = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64)
    accelerate(qwen, mode="fast", debug=True)
    try:
        first = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64)
        with eager(qwen):
            reference = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64)
        report = stats(qwen)
        assert QWEN_ATTENTION_PATCH.name in report["patches"]
        assert report["compile_failure"] is None and report["eager_fallbacks"] == 0
        assert report["cfg_batched"] > 0 and report["cfg_batch_dropped"] == 0
        assert torch.equal(first, reference)
        torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
        # Other prompt lengths reuse the compiled blocks: the text lengths are symbolic, not constants.
        compiles = report["compiles"]
        qwen(
            prompt="a much longer prompt about a fox in the snow at dawn",
            negative_prompt="ugly",
            true_cfg_scale=4.0,
            height=64,
            width=64,
            num_inference_steps=3,
        )
        # Both calls ran graphs: the compared one captured (two CFG steps, one by one then batched,
        # leave it nothing to replay), this one also replayed its batch.
        assert_graphs_ran(qwen, captures=True)
        assert stats(qwen)["compiles"] == compiles
    finally:
        restore(qwen)
