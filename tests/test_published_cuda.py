"""FP8 attention through diffusers' dispatcher on a GPU (marker: cuda), for the families that get it without a
model patch: FLUX.1, FLUX.2 klein, Wan 2.1 and Qwen-Image-Edit (whose processor is fast mode's own).

Each pipeline is the tiny coverage config with 128-wide attention heads (what the FP8 kernels take), in
bfloat16 on the GPU. In fast mode with ``attention="fp8"``, the graphs give the bytes of the same compiled
blocks without graphs (``eager(pipe)``), the images differ from bf16 fast mode's (the FP8 kernel ran) but
stay near them, and the kernel in ``stats()`` is cuDNN's where ``nvidia-cudnn-frontend`` is installed.
Wan 2.2 with only its second expert runs through real graphs, equal to eager; with both, fast mode compiles
both and replays their compiled bytes. ControlNets' graphs (FLUX.1's alone and in
a wrapper, SD3's two, Qwen-Image's two conditions) serve every conditioning scale with eager's bytes.
"""

from __future__ import annotations

import pytest
import torch
from test_published import _CONTROLNETS, PIPELINES

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.kernels import cudnn_fp8_attention
from bcg_diffusion.patches.wan_attention import WAN_ATTENTION_PATCH
from bench.coverage import _call
from bench.coverage_models import TINY
from bench.measure import psnr

pytestmark = pytest.mark.cuda

# Per family: the transformer config changes that give it 128-wide heads (RoPE axes summing to 128).
HEAD_128 = {
    "FLUX.1": {"attention_head_dim": 128, "axes_dims_rope": [16, 56, 56]},
    "FLUX.2 klein": {"attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32]},
    "Wan 2.1 T2V": {"attention_head_dim": 128},
    "Qwen-Image Edit Plus": {"attention_head_dim": 128, "axes_dims_rope": [16, 56, 56]},
    "HunyuanImage": {"attention_head_dim": 128, "rope_axes_dim": [64, 64]},  # tests/test_key_padding_cuda.py
}


def _on_gpu(value):
    """A tensor argument on the GPU, floating ones in bfloat16 as the pipeline's own embeddings would be."""
    if not torch.is_tensor(value):
        return value
    return value.to("cuda", torch.bfloat16) if value.is_floating_point() else value.to("cuda")


def _pipeline(name):
    pipe, inputs = TINY[name]()
    torch.manual_seed(0)
    config = {**pipe.transformer.config, **HEAD_128[name]}
    pipe.transformer = type(pipe.transformer).from_config(config)
    pipe.to("cuda", torch.bfloat16)
    inputs = {k: _on_gpu(v) for k, v in inputs.items()}
    return pipe, {**inputs, "height": 64, "width": 64}


def replays_compiled_bytes(pipe, inputs):
    """Two calls of ``pipe`` (accelerated in fast mode), each checked to give the bytes of its compiled blocks
    without graphs (``eager(pipe)``), with graphs captured and replayed and no compile failure; returns the
    first call's image."""
    first, second = (_call(pipe, inputs, device="cuda") for _ in range(2))
    with eager(pipe):
        reference = _call(pipe, inputs, device="cuda")
    after = stats(pipe)
    assert after["captures"] > 0 and after["replays"] > 0 and after["compile_failure"] is None, after
    assert torch.equal(first, reference) and torch.equal(second, reference)
    return first


def fast_mode_with(name, **options):
    """Tiny ``name`` in fast mode, then in fast mode with ``options``: checks that the latter's graphs give the
    bytes of its compiled blocks without graphs on two calls. Returns its ``stats()``, its image and fast mode's
    without the options."""
    pipe, inputs = _pipeline(name)
    accelerate(pipe, mode="fast")
    try:
        plain = _call(pipe, inputs, device="cuda")
    finally:
        restore(pipe)
    torch._dynamo.reset()
    accelerate(pipe, mode="fast", **options)
    try:
        report = stats(pipe)
        first = replays_compiled_bytes(pipe, inputs)
    finally:
        restore(pipe)
        torch._dynamo.reset()
    return report, first, plain


@pytest.mark.parametrize("name", PIPELINES)
def test_fp8_attention_graphs_equal_their_compiled_blocks(name):
    report, fp8, bf16 = fast_mode_with(name, attention="fp8")
    kernel = "cudnn" if cudnn_fp8_attention.unavailable(torch.device("cuda")) is None else "triton"
    assert report["fp8_attention_kernels"] == {kernel: report["fp8_attention_modules"]} and report["attention"]
    if name.startswith("Wan") and kernel == "cudnn":  # the query and key quantized at their norms' bounds
        assert WAN_ATTENTION_PATCH.name in report["patches"], report["patches"]
    assert not torch.equal(fp8, bf16)
    assert psnr(fp8.float().cpu(), bf16.float().cpu()) > 25, psnr(fp8.float().cpu(), bf16.float().cpu())


def test_wan22_with_only_its_second_expert_replays_eagers_bytes():
    from diffusers import UniPCMultistepScheduler

    base, inputs = TINY["Wan 2.2 T2V"]()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = type(base)(**{**base.components, "transformer": None, "scheduler": scheduler}, boundary_ratio=1.0)
    pipe.to("cuda")
    inputs = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in inputs.items()}
    expected = _call(pipe, inputs, device="cuda")
    accelerate(pipe)
    try:
        assert torch.equal(_call(pipe, inputs, device="cuda"), expected)
        assert torch.equal(_call(pipe, inputs, device="cuda"), expected)
        report = stats(pipe)
        assert report["components"]["transformer_2"]["replays"] > 0 and report["eager_fallbacks"] == 0, report
    finally:
        restore(pipe)


def test_wan22_fast_mode_compiles_both_experts_and_replays_their_compiled_bytes():
    base, inputs = TINY["Wan 2.2 T2V"]()
    pipe = base.to("cuda", torch.bfloat16)
    inputs = {k: _on_gpu(v) for k, v in inputs.items()}
    accelerate(pipe, mode="fast")
    try:
        first, second = (_call(pipe, inputs, device="cuda") for _ in range(2))
        with eager(pipe):
            reference = _call(pipe, inputs, device="cuda")
        report = stats(pipe)
        assert torch.equal(first, reference) and torch.equal(second, reference)
        assert report["compiled_blocks"] > 0 and report["experts"]["transformer_2"]["compiled_blocks"] > 0, report
        assert report["components"]["transformer_2"]["replays"] > 0 and report["eager_fallbacks"] == 0
    finally:
        restore(pipe)
        torch._dynamo.reset()


def test_flux_single_block_split_output_stays_near_the_class_forward():
    """A full-width FLUX.1 single block at 1024²'s tokens: the MLP's GELU in its product's epilogue and the
    output projection as two products against diffusers' forward (rounding only), the same bytes twice."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    from bcg_diffusion.core.hooks import MethodPatches
    from bcg_diffusion.patches import flux_block

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(3072, 24, 128).to("cuda", torch.bfloat16).eval()
    image = torch.randn(1, 4096, 3072, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 3072, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    angles = torch.randn(4608, 128, device="cuda")
    rotary = (angles.cos(), angles.sin())
    patches = MethodPatches()
    with torch.no_grad():
        expected = block(image, text, temb, rotary)
        assert flux_block.patch_flux_split_outputs(torch.nn.Sequential(block), patches) == 1
        try:
            first, second = block(image, text, temb, rotary), block(image, text, temb, rotary)
        finally:
            patches.undo()
    for got, again, want in zip(first, second, expected, strict=True):
        assert torch.equal(got, again)
        assert not torch.equal(got, want)  # the patched products ran
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 5e-3, error


def test_flux_bf16_fast_mode_splits_its_single_blocks_and_replays_their_compiled_bytes():
    from bcg_diffusion.patches.flux_block import FLUX_SPLIT_OUTPUT_PATCH

    pipe, inputs = _pipeline("FLUX.1")
    expected = _call(pipe, inputs, device="cuda")
    accelerate(pipe, mode="fast")
    try:
        assert FLUX_SPLIT_OUTPUT_PATCH in stats(pipe)["patches"]
        first = replays_compiled_bytes(pipe, inputs)
        assert psnr(first.float().cpu(), expected.float().cpu()) > 30
    finally:
        restore(pipe)
        torch._dynamo.reset()


def test_flux_fp8_fast_mode_runs_its_block_glue_in_our_kernels_and_replays_their_compiled_bytes():
    """Tiny FLUX.1 under ``quantize="fp8"``: every double block's glue and every single block's norm in the
    block-glue kernels (the image entering attention as FP8 rows), the graphs giving the same compiled blocks'
    bytes without graphs, and the image near the same mode with inductor's glue."""
    from bcg_diffusion.patches import block_glue
    from bcg_diffusion.patches.flux_block import FLUX_DOUBLE_BLOCK_PATCH, FLUX_SINGLE_BLOCK_PATCH

    pipe, inputs = _pipeline("FLUX.1")
    block_glue.choose(pipe.transformer, False)
    accelerate(pipe, mode="fast", quantize="fp8")
    try:
        inductor_glue = _call(pipe, inputs, device="cuda")
    finally:
        restore(pipe)
    torch._dynamo.reset()
    blocks = block_glue.choose(pipe.transformer, True)
    accelerate(pipe, mode="fast", quantize="fp8")
    try:
        report = stats(pipe)
        assert report["fused_blocks"] == blocks, report["fused_blocks"]
        assert {FLUX_DOUBLE_BLOCK_PATCH, FLUX_SINGLE_BLOCK_PATCH} <= set(report["patches"])
        first = replays_compiled_bytes(pipe, inputs)
        assert psnr(first.float().cpu(), inductor_glue.float().cpu()) > 30
    finally:
        restore(pipe)
        torch._dynamo.reset()


# Per case: the ControlNet pipeline (tests/test_published.py) and its three calls' conditioning scales.
_CONTROLNET_SCALES = {
    "FLUX.1": (0.7, 0.45, 1.0),
    "FLUX.1, one ControlNet in a wrapper": ([0.7], [0.45], [1.0]),
    "SD3, two ControlNets": ([0.7, 0.5], [0.45, 0.2], [1.0, 1.0]),
    "Qwen-Image, two conditions of one ControlNet": ([0.7, 0.5], [0.45, 0.2], [1.0, 1.0]),
}


@pytest.mark.filterwarnings("ignore:.*has no adapter")
@pytest.mark.parametrize("case", list(_CONTROLNET_SCALES))
def test_a_controlnets_graphs_serve_every_scale_with_eagers_bytes(case):
    """A ControlNet pipeline through real graphs in bf16: FLUX.1's ControlNet alone or in ``FluxMultiControlNetModel``
    with one condition (as InstantX's Union ControlNet card loads it), SD3's wrapper of two ControlNets and
    Qwen-Image's of one ControlNet with two conditions. Calls at three sets of scales, one of them 0.0 after
    ``control_guidance_end``, replay one capture of the ControlNet (the scales applied after its graphs) and give
    eager's bytes."""
    pipe, inputs = _CONTROLNETS[case]()
    pipe.to("cuda", torch.bfloat16)
    inputs = {k: [_on_gpu(i) for i in v] if isinstance(v, list) else _on_gpu(v) for k, v in inputs.items()}
    scales = _CONTROLNET_SCALES[case]
    calls = [
        {**inputs, "controlnet_conditioning_scale": scales[0]},
        {**inputs, "controlnet_conditioning_scale": scales[1], "control_guidance_end": 0.5},
        {**inputs, "controlnet_conditioning_scale": scales[2]},
    ]

    def call(inputs):
        torch.manual_seed(0)  # SD3's pipeline encodes the conditioning image with a sample from the global generator
        return _call(pipe, inputs, device="cuda")

    expected = [call(inputs) for inputs in calls]
    assert not torch.equal(expected[0], expected[1])  # the scale reaches the image
    accelerate(pipe)
    try:
        for _ in range(2):
            assert all(torch.equal(call(inputs), want) for inputs, want in zip(calls, expected))
        report = stats(pipe)
        controlnet = report["components"]["controlnet"]
        assert controlnet["captures"] == 1 and controlnet["replays"] > 0 and report["eager_fallbacks"] == 0, report
    finally:
        restore(pipe)
