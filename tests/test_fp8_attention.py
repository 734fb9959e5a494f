"""FP8 attention (``attention="fp8"``) and the GELU epilogue on a CPU: options, the refusal where the
kernels cannot run, the routing of ``patches.attention.attend``, the quantization's contract, and the
GELU patch against diffusers' own module. The kernels themselves run on the GPU
(``test_attention_kernels_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from _cases import run_cfg_case, tiny_pipeline

from bcg_diffusion import AccelerateConfig, BCGWarning, accelerate, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels.attention import FP8_MAX, quantize_for_fp8_attention, unavailable, unsupported
from bcg_diffusion.patches.attention import KERNEL_ATTRIBUTE, attend
from bcg_diffusion.patches.gelu import patch_gelu_epilogues


def test_attention_option_is_validated():
    assert AccelerateConfig(mode="fast", attention="fp8").attention == "fp8"
    with pytest.raises(ValueError, match="mode='fast' only"):
        AccelerateConfig(attention="fp8")
    with pytest.raises(ValueError, match="attention must be one of"):
        AccelerateConfig(mode="fast", attention="int8")


@pytest.mark.heavy  # compiles with inductor on CPU
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_fp8_attention_where_it_cannot_run_warns_and_keeps_bf16_attention(name):
    pipe = tiny_pipeline(name)
    with torch.no_grad():
        reference_pipe = tiny_pipeline(name)
    accelerate(reference_pipe, mode="fast", debug=True)
    try:
        reference = run_cfg_case(reference_pipe, name)
    finally:
        restore(reference_pipe)
    with pytest.warns(BCGWarning, match=r"attention='fp8' not applied: .*cpu.*attention stays in bf16"):
        accelerate(pipe, mode="fast", debug=True, attention="fp8")
    try:
        report = stats(pipe)
        assert report["attention"] is None and report["fp8_attention_modules"] == 0, report
        assert not any(hasattr(m, KERNEL_ATTRIBUTE) for m in pipe.transformer.modules())
        assert torch.equal(run_cfg_case(pipe, name), reference)
    finally:
        restore(pipe)


def test_kernels_say_why_they_cannot_run():
    assert unavailable(torch.device("cpu")) == "the model is on cpu, not a CUDA GPU"
    q = torch.zeros(1, 8, 2, 64)
    assert "CUDA" in unsupported(q, q, q)


def test_attend_routes_by_the_module_attribute_and_falls_back_on_what_the_kernel_refuses():
    calls = []

    def dispatch(query, key, value, **kwargs):
        calls.append(kwargs)
        return query

    module = torch.nn.Module()
    q = torch.randn(1, 8, 2, 64)
    assert attend(module, q, q, q, dispatch, backend=None) is q  # no attribute: diffusers' dispatch
    setattr(module, KERNEL_ATTRIBUTE, "fp8")
    assert attend(module, q, q, q, dispatch, backend=None) is q  # CPU tensors: refused, dispatch again
    assert len(calls) == 2


def test_fp8_quantization_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, 64, dtype=torch.bfloat16) * 3 for _ in range(3))
    q8, q_scales, k8, k_scales, v8, v_scales = quantize_for_fp8_attention(q, k, v)
    assert q8.dtype == k8.dtype == v8.dtype == torch.float8_e4m3fn
    assert q_scales.shape == (2, 37, 3) and k_scales.shape == (2, 3) and v_scales.shape == (2, 3, 64)
    assert v8.shape == (2, 3, 64, 48) and v8.is_contiguous()  # [B, H, D, S] with S padded to 16 bytes
    assert float(q8.float().abs().max()) <= FP8_MAX
    dequantized = {
        "query": q8.float() * q_scales[..., None],
        "key": k8.float() * k_scales[:, None, :, None],
        "value": (v8[..., :37].float() * v_scales[..., None]).permute(0, 3, 1, 2),
    }
    for name, original in zip(dequantized, (q, k, v)):
        error = (dequantized[name] - original.float()).norm() / original.float().norm()
        assert error < 0.04, (name, error)  # e4m3 keeps 3 mantissa bits: about 2-3% relative error


def test_gelu_epilogue_applies_to_cuda_half_precision_modules_only():
    from diffusers.models.activations import GELU

    module = GELU(16, 64, approximate="tanh")
    # On a CPU PyTorch's ``_addmm_activation`` computes the exact (erf) GELU, on CUDA cuBLASLt's tanh one
    # (checked against diffusers' module in test_attention_kernels_cuda.py): only CUDA modules in half
    # precision are patched.
    assert patch_gelu_epilogues(torch.nn.Sequential(module, module.to(torch.bfloat16)), MethodPatches()) == 0


def test_gelu_epilogue_follows_a_projection_replaced_after_it_was_patched():
    # A LoRA loaded after accelerate wraps the GELU's projection; the patched forward kept calling the
    # projection it was made with, so the LoRA was silently missing from fast mode's feed-forwards.
    peft = pytest.importorskip("peft")
    from diffusers.models.activations import GELU

    from bcg_diffusion.patches.gelu import gelu_in_epilogue

    torch.manual_seed(0)
    module = GELU(16, 64, approximate="tanh")
    forward = gelu_in_epilogue(module)  # on a CPU its product computes the erf GELU: compare the structure
    x = torch.randn(3, 16)
    torch.testing.assert_close(forward(x), torch.nn.functional.gelu(module.proj(x)))
    holder = torch.nn.Module()
    holder.act = module
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["proj"]), holder)
    torch.nn.init.normal_(module.proj.lora_B["default"].weight)
    assert torch.equal(forward(x), module(x))  # the module's own forward, with the LoRA
