"""The img2img and inpaint relatives of Qwen-Image and Z-Image on CPU: debug mode gives eager's exact outputs.

Each relative is built from a fresh tiny text-to-image pipeline's components (that pipeline itself is
never accelerated). They encode their input image (and, inpainting, the masked image) with
``vae.encode``, which stays eager; ``strength`` cuts the denoising steps run (with 3 steps: 0.6 runs
2, 1.0 runs 3), which changes no signature.
"""

from __future__ import annotations

import inspect

import _relatives as rel
import pytest
import torch
from _checks import assert_graphs_ran
from _relatives import MASKS, RELATIVES, STEPS_RUN

from bcg_diffusion import accelerate, eager, restore, stats, warm_up
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.pipelines import adapter_for
from bcg_diffusion.warmup import DEFAULT_WARMUP_PROMPT

RESOLUTIONS = ((48, 32), (32, 64))  # (height, width): not the text-to-image test's


def _instance_attributes(pipe):
    return {name: set(vars(getattr(pipe, name))) for name in ("transformer", "vae", "text_encoder")}


@pytest.fixture(scope="module", params=list(RELATIVES))
def relative(request):
    base, cls, _ = RELATIVES[request.param]
    text_to_image = build_pipeline(base, "tiny", device="cpu")  # a fresh one per relative, never accelerated
    pipe = cls(**text_to_image.components)
    pipe.set_progress_bar_config(disable=True)
    return request.param, base, pipe


def test_relatives_take_the_text_to_image_components(relative):
    name, base, pipe = relative
    parameters = set(inspect.signature(type(pipe).__init__).parameters) - {"self"}
    assert parameters == set(pipe.components), name
    assert adapter_for(pipe).name == base


def test_debug_mode_equals_eager_for_every_call(relative):
    name, base, pipe = relative
    calls = rel.calls(name, RESOLUTIONS)
    expected = {call: rel.call(pipe, base, call) for call in calls}
    for call, output in expected.items():
        _, _, height, width, output_type, _ = call
        assert torch.isfinite(output).all() and (output_type != "pt" or output.shape[-2:] == (height, width)), call
    # strength changes the image (an equality across strengths would otherwise prove nothing about it)
    case, strength, *rest = calls[0]
    assert strength != 1.0 and not torch.equal(expected[calls[0]], rel.call(pipe, base, (case, 1.0, *rest)))
    attributes = _instance_attributes(pipe)
    original_class = type(pipe)
    accelerate(pipe, debug=True)
    try:
        assert "encode" not in pipe.vae.__dict__  # only the decode runs through the runner
        for call in calls:
            assert torch.equal(rel.call(pipe, base, call), expected[call]), call
        first = assert_graphs_ran(pipe, captures=True)
        components = {s["component"] for s in first["signatures"]}
        assert {"transformer", "vae"} <= components <= set(adapter_for(pipe).default_components)
        assert all(s["status"] == "debug" for s in first["signatures"])
        if "mask_two_lengths" in RELATIVES[name][2]:  # the masked path (a text mask) ran through the runner
            assert any("bool" in s["signature"] or "int64" in s["signature"] for s in first["signatures"])
    finally:
        restore(pipe)
    assert type(pipe) is original_class
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__
    assert "forward" not in pipe.text_encoder.__dict__ and "patchify_and_embed" not in pipe.transformer.__dict__
    assert _instance_attributes(pipe) == attributes
    report = stats(pipe)
    assert report["active"] is False and "restored" in report["reason"] and report["signatures"] == []
    assert torch.equal(rel.call(pipe, base, calls[1]), expected[calls[1]])


def _transformer_calls(report):
    counters = report["components"]["transformer"]
    return counters["captures"] + counters["replays"]


def test_signatures_follow_resolution_and_cfg_not_strength_or_mask(relative):
    name, base, pipe = relative
    inpaint = name.endswith("inpaint")
    masks = MASKS if inpaint else (None, None)
    cfg_case = RELATIVES[name][2][1]
    # Qwen-Image: the uncond call is a second transformer call per step (its own text length, a new
    # signature); Z-Image: cond and uncond run as one call of batch 2B (a new signature too).
    calls_per_step = 2 if base == "qwen-image" else 1
    first, second = RESOLUTIONS
    accelerate(pipe, debug=True)
    try:
        report = stats(pipe)

        def call(case, strength, height, width, mask):
            nonlocal report
            before = report
            rel.run(pipe, base, case, strength=strength, height=height, width=width, mask_kind=mask)
            report = assert_graphs_ran(pipe, before)
            steps = _transformer_calls(report) - _transformer_calls(before)
            return report["components"]["transformer"]["captures"], report["components"]["vae"]["captures"], steps

        assert call("no_cfg", 0.6, *first, masks[0]) == (1, 1, STEPS_RUN[0.6])
        # another strength (more steps) and another mask: the same signatures, nothing new
        assert call("no_cfg", 1.0, *first, masks[1]) == (1, 1, STEPS_RUN[1.0])
        assert call(cfg_case, 0.6, *first, masks[0]) == (2, 1, STEPS_RUN[0.6] * calls_per_step)
        assert call(cfg_case, 1.0, *first, masks[1]) == (2, 1, STEPS_RUN[1.0] * calls_per_step)
        # a new resolution: a new transformer and a new VAE signature; then the first again replays
        assert call("no_cfg", 1.0, *second, masks[1]) == (3, 2, STEPS_RUN[1.0])
        assert call("no_cfg", 0.6, *first, masks[1]) == (3, 2, STEPS_RUN[0.6])
        if base == "z-image":  # every prompt is padded to 512 tokens for the encoder: one signature
            assert report["components"]["text_encoder"]["captures"] == 1
    finally:
        restore(pipe)


def test_warm_up_supplies_the_image_and_mask_itself(relative):
    """``warm_up`` at a resolution calls the relative with an image (and a mask) of its own; afterwards
    serving calls there, CFG off and on, with another image, mask and strength, capture nothing new."""
    name, base, pipe = relative
    mask = "centre_square" if name.endswith("inpaint") else None
    height, width = RESOLUTIONS[0]
    guidance = "true_cfg_scale" if base == "qwen-image" else "guidance_scale"
    off, on = (1.0, 4.0) if base == "qwen-image" else (0.0, 4.0)

    def serving_call(cfg):
        # the warm-up's prompt (Qwen-Image signatures follow the exact text length) and, with CFG, the
        # negative prompt it warms up with (" ")
        kwargs = {"prompt": DEFAULT_WARMUP_PROMPT, guidance: on if cfg else off}
        if cfg:
            kwargs["negative_prompt"] = " "
        return rel.run(pipe, base, "no_cfg", strength=0.6, height=height, width=width, mask_kind=mask, **kwargs)

    accelerate(pipe, debug=True, lazy_capture=False)
    try:
        result = warm_up(pipe, [(width, height)])  # (width, height) pairs
        assert result["captures"] > 0
        warmed = stats(pipe)
        for cfg in (False, True):
            image = serving_call(cfg)
            with eager(pipe):
                assert torch.equal(image, serving_call(cfg)), cfg
        served = assert_graphs_ran(pipe, warmed, captures=False)
        for component in ("transformer", "vae"):
            assert served["components"][component]["captures"] == warmed["components"][component]["captures"]
            assert served["components"][component]["misses"] == 0, component
    finally:
        restore(pipe)
