"""HunyuanImage's transformer forward with its text tokens joined by a sort (``bcg_diffusion.patches.hunyuanimage``):
byte-identical to diffusers' forward, and captured whatever the prompts' lengths. Before it, diffusers' boolean
selections made eight automatic breaks whose shapes follow each prompt's length: the ninth length gave the
signature up (eager from then on), which the debug-mode test below failed on."""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers import HunyuanImageTransformer2DModel

from bcg_diffusion import BCGWarning, accelerate, restore, stats
from bcg_diffusion.patches import hunyuanimage
from bench.coverage import _call
from bench.coverage_models import TINY, _mask

CPU = torch.device("cpu")


def _tiny(**config):
    torch.manual_seed(0)
    pipe, inputs = TINY["HunyuanImage"]()
    if config:
        pipe.transformer = HunyuanImageTransformer2DModel.from_config({**pipe.transformer.config, **config})
    return pipe, inputs


def _diffusers_order(text, mask, text_2, mask_2):
    """The joint tokens as diffusers' forward builds them, prompt by prompt: valid ByT5, valid Qwen, then the
    padding of each."""
    tokens = [torch.cat([t2[m2], t[m], t2[~m2], t[~m]]) for t, m, t2, m2 in zip(text, mask, text_2, mask_2)]
    masks = [torch.cat([m2[m2], m[m], m2[~m2], m[~m]]) for m, m2 in zip(mask, mask_2)]
    return torch.stack(tokens), torch.stack(masks)


def test_joined_text_is_diffusers_order_for_every_mix_of_valid_and_padding_tokens():
    generator = torch.Generator().manual_seed(0)
    text, text_2 = torch.randn(4, 7, 3, generator=generator), torch.randn(4, 5, 3, generator=generator)
    mask = torch.tensor([[1] * 7, [1, 1, 0, 0, 0, 0, 0], [0] * 7, [1, 0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    mask_2 = torch.tensor([[0] * 5, [1, 1, 1, 0, 0], [1] * 5, [0, 1, 0, 0, 1]], dtype=torch.bool)
    joined, joined_mask = hunyuanimage.joined_text(text, mask, text_2, mask_2)
    expected, expected_mask = _diffusers_order(text, mask, text_2, mask_2)
    assert torch.equal(joined, expected) and torch.equal(joined_mask, expected_mask)


@pytest.mark.parametrize("glyphs", [0, 2], ids=["no glyph tokens", "two glyph tokens"])
def test_the_forward_gives_the_bytes_of_diffusers_forward(glyphs):
    pipe, _ = _tiny()
    model = pipe.transformer
    generator = torch.Generator().manual_seed(1)
    call = {
        "hidden_states": torch.randn(2, 4, 4, 4, generator=generator),
        "timestep": torch.tensor([900.0, 900.0]),
        "encoder_hidden_states": torch.randn(2, 12, 32, generator=generator),
        "encoder_attention_mask": torch.cat([_mask(CPU, 12, 3), _mask(CPU, 12, 9)]),
        "encoder_hidden_states_2": torch.randn(2, 4, 16, generator=generator),
        "encoder_attention_mask_2": torch.cat([_mask(CPU, 4, glyphs), _mask(CPU, 4, 0)]),
        "attention_kwargs": {"scale": 1.0},
    }
    with torch.no_grad():
        expected = model(**call, return_dict=False)[0]
        ours = hunyuanimage.forward(model, **call, return_dict=False)[0]
        as_output = hunyuanimage.forward(model, **call).sample
    assert torch.equal(ours, expected) and torch.equal(as_output, expected)


def test_every_prompt_length_replays_one_capture_with_no_break():
    pipe, inputs = _tiny()
    lengths = range(1, 11)  # ten prompt lengths: more than the paths a signature may take
    calls = [{**inputs, "prompt_embeds_mask": _mask(CPU, 12, n)} for n in lengths]
    with torch.no_grad():
        expected = [_call(pipe, call) for call in calls]
        accelerate(pipe, debug=True)
        try:
            assert all(torch.equal(_call(pipe, call), out) for call, out in zip(calls, expected))
            report = stats(pipe)
        finally:
            restore(pipe)
    [transformer] = [s for s in report["signatures"] if s["component"] == "transformer"]
    assert report["eager_fallbacks"] == 0 and transformer["status"] == "debug", transformer
    assert transformer["paths"] == 1 and transformer["auto_breaks"] == [], transformer
    assert transformer["replays"] > len(lengths), transformer


def test_cache_dit_enabled_after_accelerate_keeps_the_graphs_and_eagers_bytes():
    cache_dit = pytest.importorskip("cache_dit")
    from _caches import cachedit_options

    def cached_pipe(accelerated):
        pipe, inputs = _tiny(num_layers=2, num_single_layers=2)
        if accelerated:
            accelerate(pipe, debug=True)
        cache_dit.enable_cache(pipe, **cachedit_options("static", steps=8))
        return pipe, inputs

    reference, inputs = cached_pipe(accelerated=False)
    with torch.no_grad():
        expected = _call(reference, inputs, steps=8)
    pipe, _ = cached_pipe(accelerated=True)
    try:
        with torch.no_grad():
            assert all(torch.equal(_call(pipe, inputs, steps=8), expected) for _ in range(2))
        report = stats(pipe)
        assert report["eager_fallbacks"] == 0 and report["components"]["transformer"]["replays"] > 0, report
    finally:
        cache_dit.disable_cache(pipe)
        restore(pipe)


def test_only_diffusers_own_forward_is_replaced():
    pipe, _ = _tiny()
    model = pipe.transformer
    assert hunyuanimage.runner_forward(model.forward) is not model.forward  # diffusers' own: ours instead
    wrapped = functools.partial(HunyuanImageTransformer2DModel.forward, model)  # a library's wrapper
    assert hunyuanimage.runner_forward(wrapped) is wrapped
    other = torch.nn.Linear(2, 2).forward
    assert hunyuanimage.runner_forward(other) is other

    class Subclass(HunyuanImageTransformer2DModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    Subclass.__name__ = "HunyuanImageTransformer2DModel"
    subclassed = Subclass.from_config(model.config)
    assert hunyuanimage.runner_forward(subclassed.forward) == subclassed.forward


def test_a_changed_forward_is_left_to_run_with_a_warning_and_the_images_follow_it(monkeypatch):
    original = HunyuanImageTransformer2DModel.forward

    def changed_forward(self, *args, **kwargs):  # another release's forward (here: the same arithmetic)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HunyuanImageTransformer2DModel, "forward", changed_forward)
    pipe, inputs = _tiny()
    with torch.no_grad():
        expected = _call(pipe, inputs)
        with pytest.warns(BCGWarning, match="hunyuanimage joined text"):
            accelerate(pipe, debug=True)
        try:
            assert torch.equal(_call(pipe, inputs), expected)
            [transformer] = [s for s in stats(pipe)["signatures"] if s["component"] == "transformer"]
            assert transformer["auto_breaks"], transformer  # diffusers' selections, as they are
        finally:
            restore(pipe)
