"""FP8 attention (``attention="fp8"``) and the GELU epilogue on a CPU: options, the refusal where the
kernels cannot run, the routing of ``patches.attention.attend``, the quantization's contract, our Triton
kernels in Triton's interpreter, and the GELU patch against diffusers' own module. The kernels themselves run on
the GPU (``test_attention_kernels_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from _cases import run_cfg_case, tiny_pipeline
from _checks import run_interpreted

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


def test_our_attention_kernels_match_pytorchs_attention_in_tritons_interpreter():
    """FP8 through both tile readers, fp16 through pointers, a partial last block of keys."""
    run_interpreted("_attention_interpret.py")


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


# -- cuDNN's FP8 attention (kernels/cudnn_fp8_attention.py): on a CPU its operator computes the reference --


@torch.no_grad()
def _normed_rotated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What fast mode's processors hand attention: an RMS norm (diffusers'), then RoPE by random angles."""
    from diffusers.models.normalization import RMSNorm

    from bcg_diffusion.patches.rope import rotate_pairs

    norm = RMSNorm(x.shape[-1], eps=1e-6)
    norm.weight.data.copy_(weight)
    angles = torch.rand(x.shape[1], x.shape[-1] // 2) * 6.28
    frequencies = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    return rotate_pairs(norm(x), frequencies)


def test_rms_norm_bound_bounds_normed_and_rotated_rows():
    from bcg_diffusion.kernels.cudnn_fp8_attention import rms_norm_bound

    torch.manual_seed(0)
    x = torch.randn(1, 64, 2, 128)
    x[0, 3, 1, 7] = 1e4  # one outlier: its row's element nears the bound itself
    weight = torch.rand(128) * 3
    bound = rms_norm_bound([weight, weight / 2], 128)
    assert bound.dtype == torch.float32 and bound.dim() == 0
    torch.testing.assert_close(bound, weight.abs().max() * 128**0.5)
    rotated = _normed_rotated(x, weight)
    assert float(rotated.abs().max()) <= float(bound) * (1 + 2**-7)  # rounding past it saturates
    assert float(rotated.abs().max()) > 0.5 * float(bound)
    with pytest.raises(ValueError, match="at least one"):
        rms_norm_bound([], 128)


def test_cudnn_fp8_attention_reference_is_near_attention_and_saturates():
    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8

    torch.manual_seed(0)
    weight = torch.rand(128) + 0.5
    q, k = (_normed_rotated(torch.randn(2, 75, 3, 128), weight).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 75, 3, 128, dtype=torch.bfloat16) * 5
    bound = cudnn_fp8.rms_norm_bound([weight], 128)
    out = cudnn_fp8.attention(q, k, v, bound, bound)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    error = ((out.float() - expected.transpose(1, 2)).norm() / expected.norm()).item()
    assert error < 0.08, error  # e4m3's 3 mantissa bits, in four places
    # Without bounds each tensor's largest magnitude is reduced instead: close to the same result.
    unbounded = cudnn_fp8.attention(q, k, v)
    assert ((unbounded.float() - out.float()).norm() / out.float().norm()).item() < 0.08
    # A value past a bound (bf16 rounding of a bounded one) saturates rather than becoming NaN.
    too_small = torch.tensor(0.1)
    assert torch.isfinite(cudnn_fp8.attention(q, k, v, too_small, too_small)).all()


def test_cudnn_fp8_attention_on_a_query_and_key_quantized_already():
    """``attention_quantized`` (what attention's prologue kernel feeds) computes ``attention``'s bytes when
    the query and key were quantized as ``attention`` quantizes them, and the value's largest magnitude,
    given or reduced, scales the value alike."""
    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8

    torch.manual_seed(0)
    weight = torch.rand(128) + 0.5
    q, k = (_normed_rotated(torch.randn(2, 40, 3, 128), weight).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 40, 3, 128, dtype=torch.bfloat16) * 3
    bound = cudnn_fp8.rms_norm_bound([weight], 128)
    descale = cudnn_fp8.descale(bound)
    torch.testing.assert_close(descale, bound / 448)
    q8, k8 = cudnn_fp8.quantize(q, descale), cudnn_fp8.quantize(k, descale)
    out = cudnn_fp8.attention_quantized(q8, k8, descale, descale, v)
    assert out.dtype == torch.bfloat16 and torch.equal(out, cudnn_fp8.attention(q, k, v, bound, bound))
    largest = v.abs().amax().float()
    assert torch.equal(cudnn_fp8.attention_quantized(q8, k8, descale, descale, v, largest), out)
    assert "must be float8_e4m3fn, not torch.bfloat16" in cudnn_fp8.unsupported_quantized(q, k8, v)
    assert "value dtype torch.float32" in cudnn_fp8.unsupported_quantized(q8, k8, v.float())
    assert "head size 64" in cudnn_fp8.unsupported_quantized(q8[..., :64], k8[..., :64], v[..., :64])
    with pytest.raises(ValueError, match="cannot take these tensors: .*must be float8_e4m3fn"):
        cudnn_fp8.attention_quantized(q, k, descale, descale, v)


def test_cudnn_fp8_attention_refuses_clearly():
    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    assert "head size 64" in cudnn_fp8.unsupported(q, q, q)
    assert "dtype torch.float32" in cudnn_fp8.unsupported(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="cannot take these tensors: head size 64"):
        cudnn_fp8.attention(q, q, q)
    assert cudnn_fp8.unavailable(torch.device("cpu")) == "the model is on cpu, not a CUDA GPU"


def test_attend_routes_cudnn_fp8_with_the_modules_norm_bounds():
    from diffusers.models.normalization import RMSNorm

    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8
    from bcg_diffusion.patches.attention import _query_key_bounds

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.norm_q, module.norm_k = RMSNorm(128, eps=1e-6), RMSNorm(128, eps=1e-6)
    module.norm_q.weight.data.fill_(2.0)
    setattr(module, KERNEL_ATTRIBUTE, "cudnn-fp8")
    q, k, v = (torch.randn(1, 40, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    bounds = _query_key_bounds(module, 128)
    torch.testing.assert_close(bounds[0], torch.tensor(2.0 * 128**0.5))
    torch.testing.assert_close(bounds[1], torch.tensor(128**0.5))
    out = attend(module, q, k, v, lambda *a, **kw: pytest.fail("dispatched"), backend=None)
    assert torch.equal(out, cudnn_fp8.attention(q, k, v, *bounds))
    # A joint module (Qwen-Image's): the text stream's norms count too; a missing norm: no bound.
    module.add_q_proj = torch.nn.Linear(4, 4)
    module.norm_added_q, module.norm_added_k = RMSNorm(128, eps=1e-6), None
    module.norm_added_q.weight.data.fill_(3.0)
    bounds = _query_key_bounds(module, 128)
    torch.testing.assert_close(bounds[0], torch.tensor(3.0 * 128**0.5))
    assert bounds[1] is None


def test_fp8_attention_kernel_choice():
    from bcg_diffusion.features.fp8_attention import FP8_ATTENTION_KERNEL_ATTRIBUTE, Fp8Attention, choose

    pipe = tiny_pipeline("z-image")
    assert choose(pipe.transformer, "triton") > 0
    with pytest.raises(ValueError, match="expected one of"):
        choose(pipe.transformer, "flash")
    module = next(m for m in pipe.transformer.modules() if hasattr(m, FP8_ATTENTION_KERNEL_ATTRIBUTE))
    assert Fp8Attention(cudnn_reason=None)._kernel(module) == "triton"
    setattr(module, FP8_ATTENTION_KERNEL_ATTRIBUTE, "auto")
    assert Fp8Attention(cudnn_reason=None)._kernel(module) == "cudnn"
    assert Fp8Attention(cudnn_reason="no frontend")._kernel(module) == "triton"
    setattr(module, FP8_ATTENTION_KERNEL_ATTRIBUTE, "fast")
    with pytest.raises(ValueError, match="is 'fast'; expected one of"):
        Fp8Attention(cudnn_reason=None)._kernel(module)


def test_a_shape_cudnn_refuses_is_warned_once_and_recorded(monkeypatch):
    from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8

    def refuse(shape, scale, device_index, padded):
        raise RuntimeError("cudnnGraphNotSupportedError: no engine")

    monkeypatch.setattr(cudnn_fp8, "_graph", refuse)
    monkeypatch.setattr(cudnn_fp8, "_REFUSED", {})
    cudnn_fp8._graph_or_reason.cache_clear()
    try:
        shape = (1, 77, 2, 77, 128)
        with pytest.warns(UserWarning, match=r"cuDNN refuses FP8 attention of shape .*no engine.*float32 reference"):
            assert "no engine" in cudnn_fp8._graph_or_reason(shape, 0.5, 0)
        assert cudnn_fp8._graph_or_reason(shape, 0.5, 0) == cudnn_fp8.refusals()[(shape, 0.5, 0, False)]  # once
        assert list(cudnn_fp8.refusals()) == [(shape, 0.5, 0, False)]
    finally:
        cudnn_fp8._graph_or_reason.cache_clear()
