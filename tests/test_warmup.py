"""Warm-up and serving without lazy capture, in debug mode on CPU (the runner path, no graphs)."""

from __future__ import annotations

import logging
from typing import Any

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


def _with_text_encoders(pipe: Any) -> Any:
    """``pipe`` (a tiny FLUX.1 or Wan pipeline built to take prompt embeddings) with tiny text encoders that take
    prompts, over the package's offline tokenizer: FLUX.1's CLIP and T5, Wan's UMT5; as a warm-up calls it."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5EncoderModel

    from bcg_diffusion.models.tokenizer import build_offline_tokenizer

    tokenizer = build_offline_tokenizer()
    vocabulary = -(-len(tokenizer) // 64) * 64
    t5 = T5Config(vocab_size=vocabulary, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4)
    torch.manual_seed(0)
    # eval(): a model made from its config is in training mode, and T5's dropout would draw every call
    if "text_encoder_2" not in pipe.components:  # Wan
        pipe.register_modules(text_encoder=UMT5EncoderModel(t5).eval(), tokenizer=tokenizer)
    else:
        clip_tokenizer = build_offline_tokenizer()
        clip_tokenizer.model_max_length = 77  # CLIP's positions
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=vocabulary, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=77, bos_token_id=0, eos_token_id=0,
        ))  # fmt: skip
        pipe.register_modules(
            text_encoder=clip.eval(), tokenizer=clip_tokenizer, text_encoder_2=T5EncoderModel(t5).eval(),
            tokenizer_2=tokenizer,
        )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("name", ["FLUX.1", "Wan 2.1 T2V"])
def test_after_warm_up_the_generic_adapters_serving_calls_never_capture(name):
    """``warmup=`` on pipelines of the generic adapter (FLUX.1 with its two text encoders, Wan with UMT5 and 81
    frames, their defaults): serving calls at that size, CFG off and on, replay what it captured."""
    from bench.coverage_models import TINY

    pipe = _with_text_encoders(TINY[name]()[0])
    video = name.startswith("Wan")

    def call(cfg):
        kwargs = adapter_for(pipe).warmup_kwargs(32, 32, cfg, DEFAULT_WARMUP_PROMPT)
        kwargs.update(output_type="pt", generator=torch.Generator().manual_seed(1))
        out = pipe(**kwargs)
        return out.frames if video else out.images

    accelerate(pipe, debug=True, lazy_capture=False, warmup=[(32, 32)])
    try:
        warmed = stats(pipe)
        assert warmed["components"]["transformer"]["captures"] >= 1
        for cfg in (False, True):
            image = call(cfg)
            with eager(pipe):
                assert torch.equal(image, call(cfg))
        assert_graphs_ran(pipe, warmed, captures=False)
        assert stats(pipe)["misses"] == 0
    finally:
        restore(pipe)


def _flux_controlnet(kind: str) -> Any:
    """Tiny FLUX.1 with a ControlNet (``kind``: one, a union one, two in a wrapper) and text encoders that take
    prompts."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxMultiControlNetModel

    from bench.coverage_models import TINY, live_controlnet

    pipe, _ = TINY["FLUX.1 ControlNet"]()
    if kind == "union":
        pipe = FluxControlNetPipeline(**{**pipe.components, "controlnet": live_controlnet(FluxControlNetModel(
            in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6], num_mode=4,
        ))})  # fmt: skip
    elif kind == "two":
        second = TINY["FLUX.1 ControlNet"]()[0].controlnet
        pipe = FluxControlNetPipeline(
            **{**pipe.components, "controlnet": FluxMultiControlNetModel([pipe.controlnet, second])}
        )
    return _with_text_encoders(pipe)


def _served_as_warmed_up(pipe: Any, size: tuple[int, int], call: Any) -> None:
    """``pipe`` accelerated with a warm-up at ``size`` (CFG off, lazy capture off) captured its ControlNet once;
    then ``call()`` replays with no capture and no miss, and gives eager's bytes. Restores ``pipe``."""
    accelerate(pipe, debug=True, lazy_capture=False, warmup=[size], warmup_cfg=(False,))
    try:
        warmed = stats(pipe)
        assert warmed["components"]["controlnet"]["captures"] == 1, warmed["components"]
        image = call()
        assert_graphs_ran(pipe, warmed, captures=False)
        assert stats(pipe)["misses"] == 0
        with eager(pipe):
            assert torch.equal(image, call())
    finally:
        restore(pipe)


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("kind", ["one", "union", "two"])
def test_a_controlnet_pipeline_warms_up_with_a_control_image_of_its_own(kind):
    """``warmup=`` on a ControlNet pipeline: the warm-up calls it with a grey control image of each size (one per
    ControlNet, and mode 0 for a union ControlNet). Before, diffusers refused the call (no control image) and
    ``accelerate`` raised. Serving calls at that size, with another image, mode and scale, capture nothing new and
    give eager's bytes."""
    pipe = _flux_controlnet(kind)
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    several = kind == "two"
    serving = {
        "prompt": DEFAULT_WARMUP_PROMPT,
        "control_image": [control, control.flip(-1)] if several else control,
        "controlnet_conditioning_scale": [1.0, 1.0] if several else 0.6,  # a list of scales keys graphs: the warm-up's
        "control_mode": 2 if kind == "union" else None,
        "height": 32,
        "width": 32,
        "num_inference_steps": 2,
        "output_type": "pt",
    }

    def call():
        return pipe(**serving, generator=torch.Generator().manual_seed(1)).images

    _served_as_warmed_up(pipe, (32, 32), call)


def test_a_controlnet_inpainting_pipeline_warms_up_with_a_control_mask_of_its_own():
    """Qwen-Image's ControlNet inpainting (a ControlNet that also takes the mask): the warm-up brings a control
    mask as well as a control image. Before, diffusers refused the call (no mask) and ``accelerate`` raised.
    Serving calls with another image and mask capture nothing new and give eager's bytes."""
    import inspect

    from diffusers import QwenImageControlNetInpaintPipeline, QwenImageControlNetModel

    from bench.coverage_models import live_controlnet

    base = _pipe("qwen-image")
    config = base.transformer.config
    controlnet = live_controlnet(QwenImageControlNetModel(
        patch_size=config.patch_size, in_channels=config.in_channels, out_channels=config.out_channels,
        num_layers=1, attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim, axes_dims_rope=config.axes_dims_rope,
        extra_condition_channels=4,  # the mask, packed 2x2 with the latents
    ))  # fmt: skip
    parameters = inspect.signature(QwenImageControlNetInpaintPipeline.__init__).parameters
    components = {name: module for name, module in base.components.items() if name in parameters}
    pipe = QwenImageControlNetInpaintPipeline(**components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    control = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 16:48, 16:48] = 1.0

    def call():
        torch.manual_seed(0)  # the pipeline encodes the control image with a sample from the global generator
        return pipe(
            prompt=DEFAULT_WARMUP_PROMPT, control_image=control, control_mask=mask, height=64, width=64,
            num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(1),
        ).images  # fmt: skip

    _served_as_warmed_up(pipe, (64, 64), call)
