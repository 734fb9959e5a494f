"""Our attention kernels and fast mode's FP8 attention on a GPU (marker: cuda).

* The Triton kernels (bf16 and FP8, both tile readers) against float32 attention at the shapes fast
  mode meets (odd token counts included), and deterministic: the same bytes on every call.
* The GELU epilogue computes diffusers' tanh GELU.
* ``accelerate(pipe, mode="fast", attention="fp8")`` on full-size Z-Image (tiny models have heads of
  16, which the kernels do not take): the attention modules use the FP8 kernel, the graphs give the same
  bytes as the compiled blocks without graphs, and the image stays near bf16 fast mode's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import cuda_pipeline, run_case

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.kernels import attention as kernels
from bcg_diffusion.patches.attention import KERNEL_ATTRIBUTE
from bcg_diffusion.patches.gelu import gelu_in_epilogue

pytestmark = pytest.mark.cuda

needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs compute capability 8.9+",
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


@needs_fp8
@pytest.mark.parametrize("reader", ["tma", "pointers"])
@pytest.mark.parametrize("shape", [(1, 1000, 3, 128), (2, 4136, 2, 128), (1, 333, 4, 64)], ids=str)
def test_kernels_match_float32_attention_and_are_deterministic(shape, reader, monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for kind in ("bf16", "fp8"):
        monkeypatch.setitem(kernels._CONFIGS, kind, (reader, *kernels._CONFIGS[kind][1:]))
    reference = _reference(q, k, v)
    for fn, bound in ((kernels.attention, 0.01), (kernels.fp8_attention, 0.08)):
        out = fn(q, k, v)
        assert out.shape == shape and out.dtype == torch.bfloat16 and out.is_contiguous()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        assert error < bound, (fn.__name__, error)
        assert torch.equal(fn(q, k, v), out), f"{fn.__name__} is not deterministic"
    # Strided inputs (a slice of a wider tensor) read in place.
    wide = torch.randn(shape[0], shape[1], shape[2], 2 * shape[3], device="cuda", dtype=torch.bfloat16)
    sliced = wide[..., : shape[3]]
    error = (kernels.attention(sliced, k, v).float() - _reference(sliced, k, v)).norm() / reference.norm()
    assert error < 0.01


def test_gelu_epilogue_is_diffusers_tanh_gelu():
    from diffusers.models.activations import GELU

    torch.manual_seed(0)
    module = GELU(64, 256, approximate="tanh").cuda()
    x = torch.randn(3, 50, 64, device="cuda")
    tanh, exact = module(x), F.gelu(module.proj(x))
    ours = gelu_in_epilogue(module)(x)
    assert (ours - tanh).abs().max() < 1e-5 < (ours - exact).abs().max()


@needs_fp8
def test_fast_mode_fp8_attention_equals_its_compiled_blocks_and_stays_near_bf16():
    with cuda_pipeline("z-image", "random-full") as pipe:
        fast_bf16 = None
        accelerate(pipe, mode="fast")
        try:
            fast_bf16 = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
        finally:
            restore(pipe)
        accelerate(pipe, mode="fast", attention="fp8")
        try:
            report = stats(pipe)
            assert report["attention"] == "fp8" and report["fp8_attention_modules"] > 0, report
            assert sum(getattr(m, KERNEL_ATTRIBUTE, None) == "fp8" for m in pipe.transformer.modules()) > 0
            image = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
            with eager(pipe):
                reference = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
            assert torch.equal(image, reference)
            assert torch.equal(run_case(pipe, "z-image", "no_cfg", height=512, width=512), image)
            mse = (image.float() - fast_bf16.float()).pow(2).mean().item()
            psnr = 10 * torch.log10(torch.tensor(1.0 / max(mse, 1e-12))).item()
            print(f"\nZ-Image 512², FP8 attention against bf16 fast mode: PSNR {psnr:.1f} dB")
            assert psnr > 15, psnr  # a wrong kernel gives noise (under 10 dB); the figure is reported
        finally:
            restore(pipe)
        assert not any(hasattr(m, KERNEL_ATTRIBUTE) for m in pipe.transformer.modules())
