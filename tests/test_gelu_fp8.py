"""The feed-forward's GELU and the down projection's FP8 input in one pass (``kernels/gelu_fp8.py``).

The reference is held to torchao's own quantization of diffusers' GELU (byte for byte, on the CPU); the
Triton kernel to the reference in Triton's interpreter (a process of its own) and on the GPU
(``tests/test_attention_kernels_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _checks import needs_triton, run_interpreted

from bcg_diffusion.kernels import gelu_fp8


def _torchao_rows(gelu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row dynamic FP8 of an activation, as its linear quantizes one (torch kernels)."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows import Float8Tensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference

    quantized = Float8Tensor.from_hp(gelu, torch.float8_e4m3fn, PerRow(), kernel_preference=KernelPreference.TORCH)
    return quantized.qdata, quantized.scale


@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 300)])
def test_reference_is_torchaos_quantization_of_diffusers_gelu(shape):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    hidden = (torch.randn(shape) * 3).to(torch.bfloat16)
    hidden[0] = 0  # a row of zeros: scale 0 and NaN data in both
    expected_data, expected_scale = _torchao_rows(F.gelu(hidden, approximate="tanh"))
    data, scale = gelu_fp8.gelu_fp8(hidden)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == expected_scale.shape == (*shape[:-1], 1)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def test_unsupported_tensors_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="fewer than two dimensions"):
        gelu_fp8.gelu_fp8(torch.randn(8))
    with pytest.raises(ValueError, match="dtype torch.int32"):
        gelu_fp8.gelu_fp8(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="float8 dtype"):
        gelu_fp8.gelu_fp8(torch.randn(2, 8), torch.float8_e5m2)
    with pytest.raises(ValueError, match="not contiguous"):
        gelu_fp8.gelu_fp8(torch.randn(8, 2).t())


def test_operator_passes_torchs_checks_and_compiles():
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.bcg_diffusion.gelu_fp8.default, (hidden, torch.float8_e4m3fn))
    compiled = torch.compile(lambda h: gelu_fp8.gelu_fp8(h), backend="aot_eager", fullgraph=True)
    (data, scale), (expected_data, expected_scale) = compiled(hidden), gelu_fp8.reference_gelu_fp8(hidden)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8)) and torch.equal(scale, expected_scale)


def test_the_kernel_runs_only_where_triton_and_a_gpu_are():
    assert "not a CUDA GPU" in gelu_fp8.unavailable(torch.device("cpu"))


@needs_triton
def test_kernel_matches_the_reference_in_tritons_interpreter():
    run_interpreted("_gelu_fp8_interpret.py")
