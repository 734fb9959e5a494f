"""Fast mode's FP8 feed-forward: the activation and the down projection's FP8 input in one kernel (Qwen-Image's
tanh GELU feed-forward, Z-Image's SwiGLU one).

On a CPU the kernel's operator runs its PyTorch reference, so the patched forward must give the bytes of
torchao's own path. torchao refuses to quantize on a CPU, so the weights are made here as its config makes
them (``Float8Tensor.from_hp``, row-wise, activations row-wise); its product runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.patches import fp8_feed_forward as ff

pytest.importorskip("torchao")
from diffusers.models.attention import FeedForward  # noqa: E402
from diffusers.models.transformers.transformer_z_image import FeedForward as ZImageFeedForward  # noqa: E402
from torchao.float8.inference import Float8MMConfig  # noqa: E402
from torchao.quantization import PerRow  # noqa: E402
from torchao.quantization.quantize_.workflows import Float8Tensor, QuantizeTensorToFloat8Kwargs  # noqa: E402


def _fp8(linear: torch.nn.Linear) -> None:
    """``linear``'s weight as torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
    leaves it (its hardware check aside)."""
    weight = Float8Tensor.from_hp(
        linear.weight.detach(),
        torch.float8_e4m3fn,
        PerRow(),
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, PerRow()),
    )
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)


def _feed_forward(dim: int = 64, quantized: bool = True) -> FeedForward:
    torch.manual_seed(0)
    module = FeedForward(dim=dim, dim_out=dim, activation_fn="gelu-approximate").to(torch.bfloat16).eval()
    if quantized:
        _fp8(module.net[0].proj)
        _fp8(module.net[2])
    return module


def _z_image_feed_forward(dim: int = 64, quantized: bool = True) -> ZImageFeedForward:
    torch.manual_seed(0)
    module = ZImageFeedForward(dim, 3 * dim).to(torch.bfloat16).eval()
    if quantized:
        for linear in (module.w1, module.w2, module.w3):
            _fp8(linear)
    return module


@pytest.mark.parametrize("make", [_feed_forward, _z_image_feed_forward], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64)])
def test_fused_forward_gives_torchaos_bytes(shape, make):
    module = make()
    x = torch.randn(shape, dtype=torch.bfloat16) * 4
    expected = module(x)
    patches = MethodPatches()
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fused")
    assert ff.patch_fp8_feed_forwards(torch.nn.Sequential(module), patches) == 1
    try:
        got = module(x)
        assert torch.equal(got, expected)
    finally:
        patches.undo()
    assert "forward" not in module.__dict__  # the class's forward again
    assert torch.equal(module(x), expected)


@pytest.mark.parametrize("make", [_feed_forward, _z_image_feed_forward], ids=["gelu", "swiglu"])
def test_the_fused_forward_is_traced_whole_by_dynamo(make):
    module = make()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    patches = MethodPatches()
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fused")
    ff.patch_fp8_feed_forwards(module, patches)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        with torch.no_grad():  # as pipelines call it (torch has no derivative for _scaled_mm)
            assert torch.equal(compiled(x), module(x))
    finally:
        patches.undo()


def test_on_by_default_a_module_can_opt_out_and_a_bad_choice_is_an_error():
    module = _feed_forward()
    assert ff.FP8_FEED_FORWARD_DEFAULT == "fused"
    assert ff.patch_fp8_feed_forwards(module, MethodPatches()) == 1
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "torchao")
    assert ff.patch_fp8_feed_forwards(module, MethodPatches()) == 0
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fast")
    with pytest.raises(ValueError, match="expected one of"):
        ff.patch_fp8_feed_forwards(module, MethodPatches())
    assert ff.choose(torch.nn.Sequential(module, _z_image_feed_forward()), "torchao") == 2
    assert getattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE) == "torchao"
    with pytest.raises(ValueError, match="expected one of"):
        ff.choose(module, "fast")


def test_modules_that_do_not_fit_are_left_with_the_reason():
    assert "not a torchao Float8Tensor" in ff.unfit(_feed_forward(quantized=False))
    training = _feed_forward()
    training.net[1].p = 0.1
    training.train()
    assert "dropout" in ff.unfit(training)
    assert "FeedForward" in ff.unfit(torch.nn.Linear(4, 4))
    assert ff.unfit(_feed_forward()) is None
    swiglu = FeedForward(dim=64, dim_out=64, activation_fn="swiglu")
    assert "tanh GELU" in ff.unfit(swiglu)
    assert ff.unfit(_z_image_feed_forward()) is None
    assert "not a torchao Float8Tensor" in ff.unfit(_z_image_feed_forward(quantized=False))
    module = _feed_forward(quantized=False)
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fused")
    assert ff.patch_fp8_feed_forwards(module, MethodPatches()) == 0


@pytest.mark.parametrize("pipeline", ["qwen-image", "z-image"])
def test_fast_mode_applies_it_where_not_opted_out_exact_mode_never_and_restore_takes_it_back(pipeline):
    from bcg_diffusion import accelerate, restore, stats
    from bcg_diffusion.models import build_pipeline

    pipe = build_pipeline(pipeline, "tiny", device="cpu")
    feed_forwards = [m for m in pipe.transformer.modules() if type(m).__name__ == "FeedForward"]
    for module in feed_forwards:
        for linear in [m for m in module.modules() if type(m) is torch.nn.Linear]:
            _fp8(linear)
    setattr(
        feed_forwards[0], ff.FP8_FEED_FORWARD_ATTRIBUTE, "torchao"
    )  # one module opts out; the rest take the default
    accelerate(pipe, mode="fast", debug=True)
    try:
        assert ff.FP8_FEED_FORWARD_PATCH in stats(pipe)["patches"]
        assert "forward" not in feed_forwards[0].__dict__
        assert all("forward" in m.__dict__ for m in feed_forwards[1:])
    finally:
        restore(pipe)
    assert all("forward" not in m.__dict__ for m in feed_forwards)
    accelerate(pipe, debug=True)  # exact mode: eager's bytes, so torchao's own path
    try:
        assert ff.FP8_FEED_FORWARD_PATCH not in stats(pipe)["patches"]
        assert all("forward" not in m.__dict__ for m in feed_forwards)
    finally:
        restore(pipe)


@pytest.mark.parametrize("replaced", ["gelu-down", "gelu-activation", "swiglu-up"])
def test_a_projection_replaced_after_patching_runs_the_modules_own_forward(replaced):
    module = _z_image_feed_forward() if replaced == "swiglu-up" else _feed_forward()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fused")
    patches = MethodPatches()
    ff.patch_fp8_feed_forwards(module, patches)
    try:
        # e.g. a LoRA layer, or weights loaded unquantized
        if replaced == "gelu-down":
            module.net[2] = torch.nn.Linear(256, 64).to(torch.bfloat16)
        elif replaced == "gelu-activation":  # another up projection, no GELU module holding it
            module.net[0] = torch.nn.Linear(64, 256).to(torch.bfloat16)
        else:
            module.w3 = torch.nn.Linear(64, 192).to(torch.bfloat16)
        assert torch.equal(module(x), type(module).forward(module, x))
    finally:
        patches.undo()


def test_a_dropout_that_starts_dropping_runs_the_modules_own_forward():
    module = _feed_forward()
    module.net[1].p = 0.5
    setattr(module, ff.FP8_FEED_FORWARD_ATTRIBUTE, "fused")
    patches = MethodPatches()
    assert ff.patch_fp8_feed_forwards(module, patches) == 1  # eval: the dropout drops nothing
    try:
        module.train()
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        torch.manual_seed(1)
        got = module(x)
        torch.manual_seed(1)
        assert torch.equal(got, type(module).forward(module, x))
    finally:
        patches.undo()
