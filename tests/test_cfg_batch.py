"""Fast mode's CFG batching (:mod:`bcg_diffusion.features.cfg_batching`) on CPU, against diffusers' own forward.

The batcher is driven by the real tiny Qwen-Image pipeline (float32), so it sees exactly the calls
diffusers makes; speculation that must be refused is driven by direct calls.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from _cases import run_case
from _checks import assert_graphs_ran

from bcg_diffusion import AccelerateConfig, accelerate, restore, stats
from bcg_diffusion.core.runner import BCGWarning
from bcg_diffusion.features.cfg_batching import CfgBatcher, batcher_of
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.pipelines.qwenimage import QwenImageAdapter

SPEC = QwenImageAdapter.cfg_batch


class _CountingForward:
    """The transformer's own forward, counting calls and the batch size of each."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.forward = transformer.forward
        self.batches: list[int] = []

    def __call__(self, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        self.batches.append(hidden_states.shape[0])
        return self.forward(*args, **kwargs)


@pytest.fixture
def qwen():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _with_batcher(pipe) -> tuple[CfgBatcher, _CountingForward]:
    counting = _CountingForward(pipe.transformer)
    batcher = CfgBatcher(counting, inspect.signature(pipe.transformer.forward), SPEC)
    pipe.transformer.forward = batcher
    return batcher, counting


@pytest.mark.parametrize("case", ["true_cfg", "mask_two_lengths"])
def test_pipeline_with_batched_cfg_matches_one_by_one_calls(qwen, case):
    expected = run_case(qwen, "qwen-image", case, height=64, width=64, steps=4)
    batcher, counting = _with_batcher(qwen)
    got = run_case(qwen, "qwen-image", case, height=64, width=64, steps=4)
    batch = 2 if case == "mask_two_lengths" else 1
    # Step 0 runs cond and uncond one by one (learning the negative prompt); steps 1-3 run as one batch.
    assert counting.batches == [batch, batch] + [2 * batch] * 3
    assert (batcher.batched, batcher.dropped) == (3, 0)
    # Other GEMM shapes and the masked path (the prompts differ in length) only round differently.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # A second call learns again: the first call's negative embeddings are gone.
    run_case(qwen, "qwen-image", case, height=64, width=64, steps=2)
    assert counting.batches[5:] == [batch, batch, 2 * batch] and batcher.dropped == 0


def test_without_cfg_nothing_is_batched_or_wasted(qwen):
    batcher, counting = _with_batcher(qwen)
    run_case(qwen, "qwen-image", "no_cfg", height=64, width=64, steps=3)
    assert counting.batches == [1, 1, 1] and (batcher.batched, batcher.dropped) == (0, 0)


def _direct_inputs(transformer, *, text_length: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    config = transformer.config
    return {
        "encoder_hidden_states": torch.randn(1, text_length, config.joint_attention_dim, generator=generator),
        "encoder_hidden_states_mask": None,
        "img_shapes": [[(1, 4, 4)]],
        "return_dict": False,
    }


@pytest.mark.parametrize("change", ["timestep", "latents_in_place", "other_text", "other_argument"])
def test_a_speculated_half_is_used_only_for_the_call_it_was_computed_for(qwen, change):
    transformer = qwen.transformer
    original = transformer.forward
    batcher, counting = _with_batcher(qwen)
    generator = torch.Generator().manual_seed(1)
    cond = _direct_inputs(transformer, text_length=7, seed=2)
    uncond = _direct_inputs(transformer, text_length=3, seed=3)
    with torch.no_grad():
        for step in range(2):  # step 0 teaches the negative prompt, step 1 speculates
            latents = torch.randn(1, 16, transformer.config.in_channels, generator=generator)
            timestep = torch.full((1,), 0.5 - 0.1 * step)
            transformer(hidden_states=latents, timestep=timestep, **cond)
            call = dict(uncond, hidden_states=latents, timestep=timestep / 1)  # equal values, another tensor
            if step == 1:
                if change == "timestep":
                    call["timestep"] = timestep + 0.25
                elif change == "latents_in_place":
                    latents.mul_(0.5)
                elif change == "other_text":
                    call["encoder_hidden_states"] = uncond["encoder_hidden_states"].clone()
                else:
                    call["attention_kwargs"] = {"scale": 0.5}
            got = transformer(**call)[0]
        expected = original(**call)[0]
    assert torch.equal(got, expected)  # computed as called, not taken from the batch
    assert counting.batches == [1, 1, 2, 1] and (batcher.batched, batcher.dropped) == (0, 1)


def test_speculated_half_with_equal_inputs_is_the_batch_computation(qwen):
    transformer = qwen.transformer
    original = transformer.forward
    batcher, _ = _with_batcher(qwen)
    generator = torch.Generator().manual_seed(1)
    cond = _direct_inputs(transformer, text_length=5, seed=2)
    uncond = _direct_inputs(transformer, text_length=5, seed=3)  # same length: no mask needed
    with torch.no_grad():
        for step in range(2):
            latents = torch.randn(1, 16, transformer.config.in_channels, generator=generator)
            timestep = torch.full((1,), 0.5 - 0.1 * step)
            cond_out = transformer(hidden_states=latents, timestep=timestep, **cond)[0]
            uncond_out = transformer(hidden_states=latents, timestep=timestep / 1, **uncond)[0]
        batched = original(
            hidden_states=torch.cat([latents, latents]),
            encoder_hidden_states=torch.cat([cond["encoder_hidden_states"], uncond["encoder_hidden_states"]]),
            encoder_hidden_states_mask=None,
            timestep=torch.cat([timestep, timestep]),
            img_shapes=[[(1, 4, 4)]] * 2,
            return_dict=False,
        )[0]
    assert batcher.batched == 1
    assert torch.equal(cond_out, batched[:1]) and torch.equal(uncond_out, batched[1:])


def test_batch_cfg_option():
    assert AccelerateConfig(mode="fast").batch_cfg is None
    with pytest.raises(ValueError, match="mode='fast' only"):
        AccelerateConfig(batch_cfg=True)
    with pytest.raises(TypeError, match="batch_cfg must be a bool"):
        AccelerateConfig(mode="fast", batch_cfg=1)


def _fast_without_compiling(pipe, **options) -> None:
    """Fast mode on a model with no repeated blocks: exact-mode graphs (debug: eager) plus CFG batching."""
    pipe.transformer._repeated_blocks = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "bcg-diffusion: mode='fast' falls back", BCGWarning)
        accelerate(pipe, mode="fast", debug=True, **options)


def test_fast_mode_batches_cfg_through_the_runner_and_restore_undoes_it(qwen):
    expected = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    _fast_without_compiling(qwen)
    assert "encode_prompt" in vars(qwen)  # the hints' wrapper
    got = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    report = assert_graphs_ran(qwen, captures=True)
    # Every step batched, the first too (its negative prompt hinted by encode_prompt): one signature.
    assert (report["cfg_batched"], report["cfg_batch_dropped"]) == (3, 0)
    assert sum(record["component"] == "transformer" for record in report["signatures"]) == 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    restore(qwen)
    assert "encode_prompt" not in vars(qwen) and batcher_of(qwen.transformer) is None
    assert torch.equal(run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3), expected)


def _hinting(pipe, batcher: CfgBatcher) -> None:
    """Hand ``batcher`` what the pipeline's ``encode_prompt`` returns, as :class:`CfgBatchHints` does."""
    encode = pipe.encode_prompt

    def encode_and_hint(*args, **kwargs):
        result = encode(*args, **kwargs)
        batcher.hint(*result)
        return result

    pipe.encode_prompt = encode_and_hint


@pytest.mark.parametrize("case", ["true_cfg", "mask_two_lengths"])
def test_hints_batch_the_first_step_too(qwen, case):
    expected = run_case(qwen, "qwen-image", case, height=64, width=64, steps=4)
    batcher, counting = _with_batcher(qwen)
    _hinting(qwen, batcher)
    got = run_case(qwen, "qwen-image", case, height=64, width=64, steps=4)
    batch = 2 if case == "mask_two_lengths" else 1
    assert counting.batches == [2 * batch] * 4 and (batcher.batched, batcher.dropped) == (4, 0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # Without CFG one prompt is encoded: nothing to batch with, nothing wasted.
    run_case(qwen, "qwen-image", "no_cfg", height=64, width=64, steps=2)
    assert counting.batches[4:] == [1, 1] and batcher.dropped == 0


@pytest.mark.parametrize("wrong", ["other_negative", "changed_in_place", "order", "one_hint"])
def test_a_wrong_hint_costs_a_dropped_half_never_a_wrong_result(qwen, wrong):
    transformer = qwen.transformer
    original = transformer.forward
    batcher, counting = _with_batcher(qwen)
    cond = _direct_inputs(transformer, text_length=7, seed=2)
    uncond = _direct_inputs(transformer, text_length=3, seed=3)
    negative = uncond["encoder_hidden_states"]
    latents = torch.randn(1, 16, transformer.config.in_channels, generator=torch.Generator().manual_seed(1))
    timestep = torch.full((1,), 0.5)
    with torch.no_grad():
        hints = {
            "other_negative": [cond, dict(uncond, encoder_hidden_states=negative.clone())],
            "changed_in_place": [cond, uncond],
            "order": [uncond, cond],
            "one_hint": [cond],
        }[wrong]
        for hinted in hints:
            batcher.hint(hinted["encoder_hidden_states"], None)
        if wrong == "changed_in_place":
            negative.mul_(2)
        cond_out = transformer(hidden_states=latents, timestep=timestep, **cond)[0]
        got = transformer(hidden_states=latents, timestep=timestep, **uncond)[0]
        expected = original(hidden_states=latents, timestep=timestep, **uncond)[0]
        cond_expected = original(hidden_states=latents, timestep=timestep, **cond)[0]
    assert torch.equal(got, expected)  # computed as called
    speculated = wrong == "other_negative"  # a live, unchanged hint of another tensor: batched, then dropped
    if speculated:  # the cond half comes from the batch: only rounding differs
        torch.testing.assert_close(cond_out, cond_expected, atol=1e-5, rtol=0)
    else:
        assert torch.equal(cond_out, cond_expected)
    assert counting.batches == ([2, 1] if speculated else [1, 1])
    assert (batcher.batched, batcher.dropped) == (0, int(speculated))


def test_batch_cfg_off_and_unsupported_pipelines_run_cfg_one_by_one(qwen):
    _fast_without_compiling(qwen, batch_cfg=False)
    run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    assert stats(qwen)["cfg_batched"] == 0
    restore(qwen)
    z_image = build_pipeline("z-image", "tiny", device="cpu")
    with pytest.warns(BCGWarning, match="batch_cfg is not supported for ZImagePipeline"):
        _fast_without_compiling(z_image, batch_cfg=True)
    restore(z_image)


def test_a_bucketed_fast_warm_up_covers_the_batched_and_the_single_cfg_calls(qwen, monkeypatch):
    # Warm-up calls run two steps without hints: one by one, then batched, so both signatures are captured.
    _fast_without_compiling(qwen, text_buckets=(32,), warmup=[(64, 64)], warmup_cfg=(True,), lazy_capture=False)
    try:
        warmed = stats(qwen)
        assert warmed["cfg_batched"] == 1, warmed["signatures"]
        assert sum(record["component"] == "transformer" for record in warmed["signatures"]) == 2

        def serve(prompt, negative):
            qwen(
                prompt=prompt, negative_prompt=negative, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=3
            )

        for prompt, negative in (("a fox", "ugly"), ("a red fox in the snow at dawn", " ")):
            serve(prompt, negative)  # hinted: every step batched
        served = stats(qwen)
        assert (served["captures"], served["misses"]) == (warmed["captures"], 0), served["signatures"]
        assert (served["cfg_batched"], served["cfg_batch_dropped"]) == (1 + 2 * 3, 0)
        # A call whose hints fail runs its first step one by one: those signatures were warmed up too.
        monkeypatch.setattr(CfgBatcher, "hint", lambda self, text, mask: None)
        serve("a fox", "ugly")
        unhinted = stats(qwen)
        assert (unhinted["captures"], unhinted["misses"]) == (warmed["captures"], 0), unhinted["signatures"]
        assert unhinted["cfg_batched"] == served["cfg_batched"] + 2
    finally:
        restore(qwen)


def test_inference_mode_calls_run_one_by_one(qwen):
    expected = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    batcher, counting = _with_batcher(qwen)
    with torch.inference_mode():  # inference tensors have no version counter to check changes against
        got = run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=3)
    assert counting.batches == [1] * 6 and (batcher.batched, batcher.dropped) == (0, 0)
    assert torch.equal(got, expected)


def test_a_model_whose_output_is_not_per_sample_is_never_batched_again(qwen):
    forward = qwen.transformer.forward

    def pooled(*args, **kwargs):  # one row for the whole batch, which cannot be split into halves
        return (forward(*args, **kwargs)[0].sum(0, keepdim=True),)

    counting = _CountingForward(qwen.transformer)
    counting.forward = pooled
    batcher = CfgBatcher(counting, inspect.signature(forward), SPEC)
    qwen.transformer.forward = batcher
    run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=4)
    # Step 0 one by one; step 1 batched once (wasted), then cond and uncond alone; then one by one for good.
    assert counting.batches == [1, 1, 2, 1, 1, 1, 1, 1, 1] and batcher.batched == 0


def test_the_padded_text_batch_is_built_once_per_call(qwen):
    texts = []
    counting = _CountingForward(qwen.transformer)
    forward = counting.forward

    def recording(*args, **kwargs):
        texts.append(kwargs["encoder_hidden_states"])
        return forward(*args, **kwargs)

    counting.forward = recording
    qwen.transformer.forward = CfgBatcher(counting, inspect.signature(forward), SPEC)
    run_case(qwen, "qwen-image", "true_cfg", height=64, width=64, steps=4)
    batched = [text for text, batch in zip(texts, counting.batches, strict=True) if batch == 2]
    assert len(batched) == 3 and all(text is batched[0] for text in batched)  # steps 1-3 share one batch
