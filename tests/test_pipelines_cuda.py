"""Real graphs on a GPU: accelerated pipelines give eager's bytes (marker: cuda).

Weights come from ``BCG_TEST_WEIGHTS`` (comma-separated, default ``tiny``); ``random-full`` builds the
real architectures with random weights (needs ~60 GB of GPU memory for Qwen-Image).
"""

from __future__ import annotations

import pytest
import torch
from _cases import CASES, GPU_WEIGHTS, cuda_pipeline, run_case
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline

pytestmark = pytest.mark.cuda

RESOLUTIONS = {"tiny": ((64, 64), (48, 96)), "random-full": ((512, 512), (768, 1344))}


@pytest.fixture(scope="module", params=[(p, w) for w in GPU_WEIGHTS for p in ("qwen-image", "z-image")], ids=str)
def pipeline(request):
    name, weights = request.param
    with cuda_pipeline(name, weights) as pipe:
        yield name, weights, pipe


def _calls(name, weights):
    resolutions = RESOLUTIONS.get(weights, RESOLUTIONS["random-full"])
    calls = [(case, h, w, "pt") for case in CASES[name] for h, w in resolutions]
    calls.append((next(iter(CASES[name])), *resolutions[0], "latent"))
    return calls


def _run(pipe, name, call):
    case, height, width, output_type = call
    return run_case(pipe, name, case, height=height, width=width, output_type=output_type)


def test_graphs_equal_eager_bytes(pipeline):
    name, weights, pipe = pipeline
    calls = _calls(name, weights)
    expected = {call: _run(pipe, name, call) for call in calls}
    for call, image in expected.items():
        assert torch.isfinite(image).all(), f"eager output not finite for {call}: the test would prove nothing"
    accelerate(pipe)
    try:
        checked = None
        for call in calls:  # alternates resolutions and CFG modes: capture, then replay across captures
            assert torch.equal(_run(pipe, name, call), expected[call]), call
            checked = assert_graphs_ran(pipe, checked)
        first = stats(pipe)
        assert first["active"] and first["eager_fallbacks"] == 0, first["signatures"]
        assert all(s["status"] == "captured" for s in first["signatures"])
        for call in reversed(calls):
            assert torch.equal(_run(pipe, name, call), expected[call]), call
            checked = assert_graphs_ran(pipe, checked, captures=False)
        second = stats(pipe)
        assert second["captures"] == first["captures"], "a known signature was captured again"
        assert second["replays"] > first["replays"]
        if name == "qwen-image":  # the masked path (prompts of different lengths) must replay, not fall back
            assert any("bool" in s["signature"] or "int64" in s["signature"] for s in second["signatures"])
        print(
            f"\n{name}/{weights}: captures={second['captures']} replays={second['replays']} "
            f"graph memory={second['graph_memory_bytes'] / 2**20:.0f} MiB "
            f"capture time={second['capture_seconds']:.2f} s"
        )
    finally:
        restore(pipe)
    assert "forward" not in pipe.transformer.__dict__
    assert torch.equal(_run(pipe, name, calls[0]), expected[calls[0]])


def test_lora_changes_recapture_and_follow_the_lora():
    """After a LoRA is added or re-weighted, the replayed image equals eager *with* the LoRA."""
    peft = pytest.importorskip("peft")
    from bcg_diffusion import eager

    pipe = build_pipeline("qwen-image", "tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    call = ("no_cfg", 64, 64, "pt")
    accelerate(pipe)
    try:
        plain = _run(pipe, "qwen-image", call)
        checked = assert_graphs_ran(pipe)
        config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
        pipe.transformer.add_adapter(config, adapter_name="style")
        with_lora = _run(pipe, "qwen-image", call)
        checked = assert_graphs_ran(pipe, checked, captures=True)  # captured again, with the LoRA
        with eager(pipe):
            expected = _run(pipe, "qwen-image", call)
        assert torch.equal(with_lora, expected) and not torch.equal(with_lora, plain)
        pipe.transformer.set_adapters(["style"], weights=[0.5])
        half = _run(pipe, "qwen-image", call)
        assert_graphs_ran(pipe, checked, captures=True)
        with eager(pipe):
            assert torch.equal(half, _run(pipe, "qwen-image", call))
        report = stats(pipe)
        assert report["invalidations"] >= 2 and report["eager_fallbacks"] == 0
        assert all(s["status"] == "captured" for s in report["signatures"])
    finally:
        restore(pipe)


@pytest.mark.parametrize("weights", GPU_WEIGHTS)
def test_z_image_text_encoder_graphs_equal_eager(weights):
    """Opt-in text encoder capture: the mask preparation is an eager break, decided as eager decides."""
    prompts = ["a red fox in the snow", "fox " * 600]  # padded to 512 tokens, and filling all 512
    with cuda_pipeline("z-image", weights) as pipe:

        def call(prompt):
            return pipe(
                prompt=prompt,
                height=64 if weights == "tiny" else 512,
                width=64 if weights == "tiny" else 512,
                num_inference_steps=2,
                guidance_scale=0.0,
                output_type="pt",
                generator=torch.Generator("cpu").manual_seed(0),
            ).images.cpu()

        expected = [call(p) for p in prompts]
        accelerate(pipe, components=("transformer", "vae", "text_encoder"))
        try:
            checked = None
            for round_ in range(2):  # capture, then replay
                for prompt, image in zip(prompts, expected):
                    assert torch.equal(call(prompt), image)
                    checked = assert_graphs_ran(pipe, checked, captures=round_ == 0)
            report = stats(pipe)
            encoder = [s for s in report["signatures"] if s["component"] == "text_encoder"]
            assert len(encoder) == 2 and all(s["status"] == "captured" and s["breaks"] == 1 for s in encoder), encoder
            assert report["eager_fallbacks"] == 0
        finally:
            restore(pipe)
