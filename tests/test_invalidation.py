"""What invalidates graphs, in debug mode on CPU: the runner drops its signatures and captures again."""

from __future__ import annotations

import pytest
import torch
from _cases import run_case
from _checks import assert_graphs_ran

from bcg_diffusion import BCGWarning, accelerate, restore, stats
from bcg_diffusion.models import build_pipeline


@pytest.fixture
def pipe():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, debug=True)
    yield pipe
    restore(pipe)


def _call(pipe):
    return run_case(pipe, "qwen-image", "no_cfg", height=32, width=32, output_type="latent")


def _checked_call(pipe, captures=None):
    """``_call`` through the graphs: asserts that it captured (``captures``) and replayed, never ran eagerly."""
    before = stats(pipe)
    result = _call(pipe)
    assert_graphs_ran(pipe, before, captures=captures)
    return result


def _eager(pipe):
    """The eager result of the same call, from a restored (then re-accelerated) pipeline."""
    restore(pipe)
    try:
        return _call(pipe)
    finally:
        accelerate(pipe, debug=True)


def test_moving_or_casting_a_component_drops_its_graphs(pipe):
    _call(pipe)
    before = stats(pipe)
    pipe.transformer.to(torch.float32)  # even a no-op move goes through _apply
    after = stats(pipe)
    assert (
        after["components"]["transformer"]["invalidations"] == before["components"]["transformer"]["invalidations"] + 1
    )
    assert not [s for s in after["signatures"] if s["component"] == "transformer"]
    _call(pipe)
    assert stats(pipe)["components"]["transformer"]["captures"] == before["components"]["transformer"]["captures"] + 1


def test_lora_changes_drop_graphs_and_results_follow_the_lora(pipe):
    peft = pytest.importorskip("peft")
    plain = _call(pipe)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    pipe.transformer.add_adapter(config, adapter_name="style")
    assert stats(pipe)["components"]["transformer"]["invalidations"] >= 1
    with_lora = _checked_call(pipe, captures=True)  # captured again, with the LoRA
    assert not torch.equal(with_lora, plain), "the random LoRA should change the result"
    assert torch.equal(with_lora, _eager(pipe))
    invalidations = stats(pipe)["invalidations"]
    pipe.transformer.set_adapters(["style"], weights=[0.5])
    pipe.transformer.disable_lora()
    pipe.transformer.enable_lora()
    assert stats(pipe)["invalidations"] == invalidations + 3
    assert torch.equal(_checked_call(pipe, captures=True), _eager(pipe))
    pipe.transformer.delete_adapters("style")
    assert torch.equal(_call(pipe), plain)


def test_an_unsupported_cache_runs_eagerly_with_the_reason_until_disabled(pipe):
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    _call(pipe)
    config = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep
    )
    pipe.transformer.enable_cache(config)
    with pytest.warns(BCGWarning, match="pyramid_attention_broadcast.*not supported"):
        cached = _call(pipe)
    report = stats(pipe)["components"]["transformer"]
    assert report["eager_fallbacks"] >= 2 and torch.isfinite(cached).all()
    pipe.transformer.disable_cache()
    replays = stats(pipe)["replays"]
    _call(pipe)
    _call(pipe)
    assert stats(pipe)["replays"] > replays


def test_restore_removes_every_hook(pipe):
    restore(pipe)
    for module in (pipe.transformer, pipe.vae):
        assert not [
            name for name, value in vars(module).items() if callable(value) and not isinstance(value, torch.nn.Module)
        ]
    accelerate(pipe, debug=True)


def test_layerwise_casting_after_accelerate_runs_eagerly(pipe):
    _call(pipe)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with pytest.warns(BCGWarning, match="enable_layerwise_casting"):
        cast = _call(pipe)
    assert stats(pipe)["components"]["transformer"]["eager_fallbacks"] >= 1
    restore(pipe)
    assert torch.equal(cast, _call(pipe))  # eager, with the casting hooks
    with pytest.warns(BCGWarning, match="layerwise_casting"):
        accelerate(pipe, debug=True)  # hooks already there: left eager from the start
    assert not stats(pipe)["active"]


def test_pipelines_with_unsupported_diffusers_hooks_are_left_eager():
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    config = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep
    )
    pipe.transformer.enable_cache(config)
    with pytest.warns(BCGWarning, match="diffusers hooks"):
        accelerate(pipe, debug=True)
    try:
        assert not stats(pipe)["active"] and "pyramid_attention_broadcast" in stats(pipe)["reason"]
    finally:
        restore(pipe)


def _lora_state_dict(pipe, peft):
    """A random LoRA for the pipeline's transformer, in the layout ``load_lora_weights`` reads."""
    donor = build_pipeline("qwen-image", "tiny", device="cpu").transformer
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    donor.add_adapter(config, adapter_name="donor")
    state = peft.get_peft_model_state_dict(donor, adapter_name="donor")
    return {f"transformer.{key}": value.clone() for key, value in state.items()}


def test_pipeline_lora_loading_fusing_and_scale_follow_eager(pipe):
    peft = pytest.importorskip("peft")
    plain = _call(pipe)
    pipe.load_lora_weights(_lora_state_dict(pipe, peft), adapter_name="style")
    with_lora = _checked_call(pipe, captures=True)
    assert not torch.equal(with_lora, plain), "the random LoRA should change the result"
    assert torch.equal(with_lora, _eager(pipe))
    before = stats(pipe)["invalidations"]
    pipe.fuse_lora(lora_scale=0.5)
    assert stats(pipe)["invalidations"] > before
    fused = _checked_call(pipe, captures=True)
    assert torch.equal(fused, _eager(pipe))
    assert not torch.equal(fused, with_lora)
    pipe.unfuse_lora()
    # Unfusing subtracts the delta it added, which rounds: compare with eager after the same steps.
    assert torch.equal(_checked_call(pipe, captures=True), _eager(pipe))
    pipe.unload_lora_weights()
    unloaded = _checked_call(pipe, captures=True)
    assert torch.equal(unloaded, _eager(pipe))
    torch.testing.assert_close(unloaded, plain)  # back to the base weights, up to the unfuse rounding
    assert stats(pipe)["eager_fallbacks"] == 0


def test_lora_scale_per_call_is_part_of_the_signature(pipe):
    peft = pytest.importorskip("peft")
    pipe.load_lora_weights(_lora_state_dict(pipe, peft), adapter_name="style")

    def call(scale):
        return pipe(
            prompt="a red fox",
            height=32,
            width=32,
            num_inference_steps=2,
            output_type="latent",
            attention_kwargs={"scale": scale},
            generator=torch.Generator().manual_seed(0),
        ).images

    half, full = call(0.5), call(1.0)
    assert not torch.equal(half, full)
    signatures = {s["signature"] for s in stats(pipe)["signatures"] if s["component"] == "transformer"}
    assert len(signatures) == 2, signatures
    restore(pipe)
    try:
        assert torch.equal(call(0.5), half) and torch.equal(call(1.0), full)
    finally:
        accelerate(pipe, debug=True)
