"""The feed-forward's activation and the down projection's FP8 input in one pass (``kernels/activation_fp8.py``).

The references are held to torchao's own quantization of the models' activations (byte for byte, on the
CPU); the Triton kernel to the references in Triton's interpreter (a process of its own) and on the GPU
(``tests/test_attention_kernels_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _checks import needs_triton, run_interpreted

from bcg_diffusion.kernels import activation_fp8


def _torchao_rows(activation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row dynamic FP8 of an activation, as its linear quantizes one (torch kernels)."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows import Float8Tensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference

    quantized = Float8Tensor.from_hp(
        activation, torch.float8_e4m3fn, PerRow(), kernel_preference=KernelPreference.TORCH
    )
    return quantized.qdata, quantized.scale


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 300)])
def test_references_are_torchaos_quantization_of_the_models_activations(shape, activation):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    hidden, up = ((torch.randn(shape) * 3).to(torch.bfloat16) for _ in range(2))
    hidden[0] = 0  # a row of zeros: scale 0 and NaN data in both
    if activation == "gelu":
        expected_data, expected_scale = _torchao_rows(F.gelu(hidden, approximate="tanh"))
        data, scale = activation_fp8.gelu_fp8(hidden)
    else:
        expected_data, expected_scale = _torchao_rows(F.silu(hidden) * up)  # Z-Image's _forward_silu_gating
        data, scale = activation_fp8.swiglu_fp8(hidden, up)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == expected_scale.shape == (*shape[:-1], 1)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def test_a_head_joins_the_row_as_flux_single_blocks_join_attention_and_gelu():
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    hidden, head = (torch.randn(3, 5, 96) * 3).to(torch.bfloat16), (torch.randn(3, 5, 32) * 9).to(torch.bfloat16)
    head[0, 0], hidden[0, 0] = 0, 0  # a row of zeros in both: scale 0 and NaN data
    expected_data, expected_scale = _torchao_rows(torch.cat([head, F.gelu(hidden, approximate="tanh")], dim=2))
    data, scale = activation_fp8.gelu_fp8(hidden, head=head)
    assert data.shape == (3, 5, 128) and scale.shape == (3, 5, 1)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def test_unsupported_tensors_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="fewer than two dimensions"):
        activation_fp8.gelu_fp8(torch.randn(8))
    with pytest.raises(ValueError, match="dtype torch.int32"):
        activation_fp8.gelu_fp8(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="float8 dtype"):
        activation_fp8.gelu_fp8(torch.randn(2, 8), torch.float8_e5m2)
    with pytest.raises(ValueError, match="not contiguous"):
        activation_fp8.gelu_fp8(torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="not contiguous"):
        activation_fp8.swiglu_fp8(torch.randn(2, 8), torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="differ in shape, dtype or device"):
        activation_fp8.swiglu_fp8(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="differ in rows, dtype or device"):
        activation_fp8.gelu_fp8(torch.randn(2, 8), head=torch.randn(3, 8))
    with pytest.raises(ValueError, match="head's last dimension is not contiguous"):
        activation_fp8.gelu_fp8(torch.randn(2, 8), head=torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="a head 16385 wide"):
        activation_fp8.gelu_fp8(torch.randn(1, 8), head=torch.randn(1, 16385))


@pytest.mark.parametrize("activation", ["gelu", "gelu-head", "swiglu"])
def test_operators_pass_torchs_checks_and_compile(activation):
    hidden, up = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    if activation == "swiglu":
        operator, args = torch.ops.bcg_diffusion.swiglu_fp8.default, (hidden, up, fp8)
        function, reference = activation_fp8.swiglu_fp8, activation_fp8.reference_swiglu_fp8
    else:
        head = up[:, :16] if activation == "gelu-head" else None
        operator, args = torch.ops.bcg_diffusion.gelu_fp8.default, (hidden, fp8, head)
        function, reference = activation_fp8.gelu_fp8, activation_fp8.reference_gelu_fp8
    torch.library.opcheck(operator, args)
    compiled = torch.compile(lambda: function(*args), backend="aot_eager", fullgraph=True)
    (data, scale), (expected_data, expected_scale) = compiled(), reference(*args)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8)) and torch.equal(scale, expected_scale)


def test_the_kernel_runs_only_where_triton_and_a_gpu_are():
    assert "not a CUDA GPU" in activation_fp8.unavailable(torch.device("cpu"))


@needs_triton
def test_kernel_matches_the_references_in_tritons_interpreter():
    run_interpreted("_activation_fp8_interpret.py")
