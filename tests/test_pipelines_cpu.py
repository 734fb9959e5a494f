"""Tiny random Qwen-Image and Z-Image pipelines on CPU: debug mode gives eager's exact outputs."""

from __future__ import annotations

import pytest
import torch
from _cases import CASES, run_case
from _checks import assert_graphs_ran

from bcg_diffusion import BCGWarning, accelerate, restore, stats
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.pipelines import adapter_for

RESOLUTIONS = ((32, 32), (32, 48))


@pytest.fixture(scope="module", params=["qwen-image", "z-image"])
def pipeline(request):
    pipe = build_pipeline(request.param, "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe


def test_debug_mode_equals_eager_for_every_case(pipeline):
    name, pipe = pipeline
    calls = [(case, h, w, kind) for case in CASES[name] for h, w in RESOLUTIONS for kind in ("pt", "latent")]
    expected = {
        call: run_case(pipe, name, call[0], height=call[1], width=call[2], output_type=call[3]) for call in calls
    }
    accelerate(pipe, debug=True)
    try:
        checked = None
        for call in calls:
            got = run_case(pipe, name, call[0], height=call[1], width=call[2], output_type=call[3])
            assert torch.equal(got, expected[call]), call
            checked = assert_graphs_ran(pipe, checked)
        first = stats(pipe)
        assert first["captures"] > 0 and first["replays"] > 0 and first["eager_fallbacks"] == 0
        assert {s["component"] for s in first["signatures"]} <= set(adapter_for(pipe).default_components)
        assert {s["component"] for s in first["signatures"]} >= {"transformer", "vae"}
        for call in reversed(calls):  # every signature known: nothing new is captured
            assert torch.equal(
                run_case(pipe, name, call[0], height=call[1], width=call[2], output_type=call[3]), expected[call]
            )
            checked = assert_graphs_ran(pipe, checked, captures=False)
        second = stats(pipe)
        assert second["captures"] == first["captures"] and second["replays"] > first["replays"]
    finally:
        restore(pipe)
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__
    call = calls[0]
    assert torch.equal(
        run_case(pipe, name, call[0], height=call[1], width=call[2], output_type=call[3]), expected[call]
    )


def test_signatures_follow_the_cases(pipeline):
    name, pipe = pipeline
    accelerate(pipe, debug=True)
    try:
        run_case(pipe, name, "no_cfg", height=32, width=32)
        assert stats(pipe)["components"]["transformer"]["captures"] == 1
        cfg_case = "true_cfg" if name == "qwen-image" else "cfg"
        run_case(pipe, name, cfg_case, height=32, width=32)
        # Qwen: the cond call is the no-CFG signature again, the uncond call (its own text length) is new;
        # Z-Image: cond and uncond run as one new call of batch 2B.
        expected = 2
        assert stats(pipe)["components"]["transformer"]["captures"] == expected
        run_case(pipe, name, cfg_case, height=32, width=32, seed=1)  # new noise, same signatures
        assert stats(pipe)["components"]["transformer"]["captures"] == expected
    finally:
        restore(pipe)


def test_cpu_pipeline_without_debug_stays_eager(pipeline):
    name, pipe = pipeline
    expected = run_case(pipe, name, "no_cfg", height=32, width=32)
    with pytest.warns(BCGWarning, match="leaving .* eager"):
        accelerate(pipe)
    try:
        report = stats(pipe)
        assert not report["active"] and "CUDA" in report["reason"]
        assert "forward" not in pipe.transformer.__dict__
        assert torch.equal(run_case(pipe, name, "no_cfg", height=32, width=32), expected)
    finally:
        restore(pipe)
