"""Fast mode's compiled text-encoder layers (``features/compiled_text_encoder.py``), on the CPU in debug mode.

On a GPU fast mode compiles them by default (``tests/test_fast_cuda.py`` checks Z-Image's inside real
graphs); here the device check is patched so that the CPU runs the same path: the runner's warm-up
compiles, the mask break decides outside the layers, each call equals the compiled layers without graphs.
"""

from __future__ import annotations

import pytest
import torch
from _cases import run_case
from _checks import assert_graphs_ran, needs_compiler
from torch._dynamo.utils import counters

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.features import compiled_text_encoder
from bcg_diffusion.features.compiled_text_encoder import (
    COMPILED_TEXT_ENCODER,
    choose,
    decoder_layer_classes,
    layer_parts,
)
from bcg_diffusion.models import build_pipeline


def _parts(pipe) -> list[torch.nn.Module]:
    return [part for _, part in layer_parts(pipe.text_encoder)]


@pytest.fixture
def compiling_on_cpu(monkeypatch):
    monkeypatch.setattr(compiled_text_encoder, "_worth_compiling", lambda model: True)


def _tiny(name: str):
    pipe = build_pipeline(name, "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@needs_compiler
@pytest.mark.heavy
def test_compiled_layers_replay_as_they_run_without_graphs_and_compile_once_per_mask_decision(compiling_on_cpu):
    pipe = _tiny("z-image")
    # all tokens valid once trimmed (no mask), then two prompts of different lengths (a mask)
    cases = ("no_cfg", "two_lengths")
    expected = {case: run_case(pipe, "z-image", case, height=64, width=64) for case in cases}
    accelerate(pipe, mode="fast", debug=True)
    counters["graph_break"].clear()
    try:
        assert decoder_layer_classes(pipe.text_encoder) == ("Qwen3DecoderLayer",)
        names = [name for name, _ in layer_parts(pipe.text_encoder)]
        assert names[:4] == [
            "layers.0.self_attn",
            "layers.0.mlp",
            "layers.0.input_layernorm",
            "layers.0.post_attention_layernorm",
        ]
        assert all("forward" in part.__dict__ for part in _parts(pipe))
        checked, compiled = None, []
        for _ in range(2):  # the first round captures (debug: records), the second replays
            compiled.append(stats(pipe)["text_encoder_compiles"])
            for case in cases:
                image = run_case(pipe, "z-image", case, height=64, width=64)
                checked = assert_graphs_ran(pipe, checked)
                with eager(pipe):  # the compiled layers and blocks without graphs
                    assert torch.equal(image, run_case(pipe, "z-image", case, height=64, width=64)), case
                torch.testing.assert_close(image, expected[case], atol=1e-4, rtol=0)  # float32: rounding only
        report = stats(pipe)
        assert COMPILED_TEXT_ENCODER in report["patches"]
        # Compiled at the warm-up before each signature's capture, once per part class (attention, feed-forward,
        # norm) and variant (one prompt without a mask; two prompts, batch 2, with one): none at a replay, and
        # no graph break.
        assert compiled == [0, 6] and report["text_encoder_compiles"] == 6, (compiled, report)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert report["text_encoder_compile_failure"] is None
        assert report["eager_fallbacks"] == 0
    finally:
        restore(pipe)
    assert not any("forward" in part.__dict__ for part in _parts(pipe))
    assert torch.equal(run_case(pipe, "z-image", "no_cfg", height=64, width=64), expected["no_cfg"])


def test_layers_stay_eager_on_a_cpu_or_when_chosen_and_a_bad_choice_is_refused(monkeypatch):
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    with pytest.raises(TypeError, match="True or False"):
        choose(pipe.text_encoder, "yes")
    for chosen, worth in ((True, False), (False, True)):  # the CPU's default; a GPU with the opt-out
        monkeypatch.setattr(compiled_text_encoder, "_worth_compiling", lambda model, worth=worth: worth)
        choose(pipe.text_encoder, chosen)
        accelerate(pipe, mode="fast", debug=True)
        try:
            report = stats(pipe)
            assert COMPILED_TEXT_ENCODER not in report["patches"] and report["text_encoder_compiles"] == 0
            assert not any("forward" in part.__dict__ for part in _parts(pipe))
        finally:
            restore(pipe)


@needs_compiler
@pytest.mark.heavy
def test_qwen_image_text_encoder_parts_compile_when_it_is_accelerated(compiling_on_cpu):
    # Qwen-Image's Qwen2.5-VL (multimodal RoPE, its vision blocks left alone), accelerated with components=
    pipe = _tiny("qwen-image")
    expected = run_case(pipe, "qwen-image", "mask_two_lengths", height=64, width=64)
    accelerate(pipe, mode="fast", debug=True, components=("transformer", "vae", "text_encoder"))
    try:
        assert {name.rsplit(".", 1)[-1] for name, _ in layer_parts(pipe.text_encoder)} == {
            "self_attn",
            "mlp",
            "input_layernorm",
            "post_attention_layernorm",
        }
        image = run_case(pipe, "qwen-image", "mask_two_lengths", height=64, width=64)
        with eager(pipe):
            assert torch.equal(image, run_case(pipe, "qwen-image", "mask_two_lengths", height=64, width=64))
        torch.testing.assert_close(image, expected, atol=1e-4, rtol=0)
        report = stats(pipe)
        assert report["text_encoder_compiles"] > 0 and report["text_encoder_compile_failure"] is None, report
    finally:
        restore(pipe)
