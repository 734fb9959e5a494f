"""Text encoder as an accelerated component (opt-in), on CPU in debug mode.

The GPU side (real graphs, the mask preparation as an eager break) is in ``test_pipelines_cuda.py``.
"""

from __future__ import annotations

import torch
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches.text_encoder import CAUSAL_MASK_PATCH

COMPONENTS = ("transformer", "vae", "text_encoder")
PROMPTS = ["a fox", "a red fox in the snow at dawn, detailed", "fox " * 600]  # the last fills all 512 tokens


def _call(pipe, prompt):
    return pipe(
        prompt=prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=0.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def test_z_image_text_encoder_one_signature_per_mask_decision():
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    expected = [_call(pipe, p) for p in PROMPTS]
    original = qwen3.create_causal_mask
    accelerate(pipe, debug=True, components=COMPONENTS)
    try:
        assert qwen3.create_causal_mask is CAUSAL_MASK_PATCH.replacement
        checked = None
        for prompt, image in zip(PROMPTS, expected):
            assert torch.equal(_call(pipe, prompt), image)
            checked = assert_graphs_ran(pipe, checked)
        report = stats(pipe)
        encoder = [s for s in report["signatures"] if s["component"] == "text_encoder"]
        # Every prompt is padded to 512 tokens: one signature for the padded prompts, one for the
        # prompt that fills them all (transformers then builds no mask: another code path).
        assert len(encoder) == 2 and report["components"]["text_encoder"]["replays"] == 1, encoder
        assert report["eager_fallbacks"] == 0
    finally:
        restore(pipe)
    assert qwen3.create_causal_mask is original


def test_the_mask_break_is_a_plain_call_outside_a_capture(monkeypatch):
    from transformers import masking_utils

    calls = []

    def fake_create_causal_mask(*args, **kwargs):
        calls.append((args, kwargs))
        return "mask"

    monkeypatch.setattr(masking_utils, "create_causal_mask", fake_create_causal_mask)
    assert CAUSAL_MASK_PATCH.replacement(1, config="c", attention_mask=None) == "mask"
    assert calls == [((1,), {"config": "c", "attention_mask": None})]  # forwarded unchanged
    assert getattr(CAUSAL_MASK_PATCH.replacement, "__bcg_eager_break__", False)
