"""Z-Image's and Qwen-Image's block glue in three passes (``kernels/block_glue.py``).

The references are held to each block's own arithmetic and torchao's quantization (byte for byte, on the
CPU); the Triton kernel to the references in Triton's interpreter (a process of its own) and on the GPU
(``tests/test_attention_kernels_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
from _checks import needs_triton, run_interpreted

from bcg_diffusion.kernels import block_glue

FP8 = torch.float8_e4m3fn


def _torchao_rows(activation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row dynamic FP8 of an activation, as its linear quantizes one (torch kernels)."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows import Float8Tensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import KernelPreference

    quantized = Float8Tensor.from_hp(activation, FP8, PerRow(), kernel_preference=KernelPreference.TORCH)
    return quantized.qdata, quantized.scale


def _block_and_inputs(batch: int = 2, tokens: int = 5, width: int = 64):
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    torch.manual_seed(0)
    block = ZImageTransformerBlock(0, width, 2, 2, 1e-5, qk_norm=True).to(torch.bfloat16)
    for norm in (block.attention_norm1, block.attention_norm2, block.ffn_norm1, block.ffn_norm2):
        torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x = (torch.randn(batch, tokens, width) * 2).to(torch.bfloat16)
    branch = (torch.randn(batch, tokens, width) * 3).to(torch.bfloat16)
    modulation = (torch.randn(batch, 4 * width) * 0.5).to(torch.bfloat16)
    return block, x, branch, modulation


def _equal_fp8(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_references_are_the_blocks_own_steps_and_torchaos_quantization():
    pytest.importorskip("torchao")
    block, x, branch, modulation = _block_and_inputs()
    # Z-Image's block, line by line (its forward with modulation and no noise mask)
    scale_msa, gate_msa, scale_mlp, gate_mlp = modulation.unsqueeze(1).chunk(4, dim=2)
    gate_msa, gate_mlp, scale_msa, scale_mlp = gate_msa.tanh(), gate_mlp.tanh(), 1.0 + scale_msa, 1.0 + scale_mlp
    first = _torchao_rows(block.attention_norm1(x) * scale_msa)
    stream = x + gate_msa * block.attention_norm2(branch)
    second = _torchao_rows(block.ffn_norm1(stream) * scale_mlp)
    last = stream + gate_mlp * block.ffn_norm2(branch)

    chunks = modulation.chunk(4, dim=1)
    n1, n2, f1, f2 = block.attention_norm1, block.attention_norm2, block.ffn_norm1, block.ffn_norm2
    assert _equal_fp8(block_glue.modulated_norm_fp8(x, n1.weight, n1.eps, chunks[0]), first)
    got = block_glue.gated_residual_fp8(x, branch, n2.weight, n2.eps, chunks[1], f1.weight, f1.eps, chunks[2])
    assert torch.equal(got[0], stream) and _equal_fp8(got[1:], second)
    assert torch.equal(block_glue.gated_residual(stream, branch, f2.weight, f2.eps, chunks[3]), last)
    assert got[1].dtype == FP8 and got[2].shape == (2, 5, 1) and got[2].dtype == torch.float32


def _qwen_block_and_inputs(batch: int = 2, tokens: int = 5, width: int = 64):
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    block = QwenImageTransformerBlock(width, 2, width // 2).to(torch.bfloat16)
    x = (torch.randn(batch, tokens, width) * 2 + 1).to(torch.bfloat16)
    branch = (torch.randn(batch, tokens, width) * 3).to(torch.bfloat16)
    modulation = (torch.randn(batch, 6 * width) * 0.5).to(torch.bfloat16)
    return block, x, branch, modulation


def test_qwen_references_are_the_blocks_own_steps_and_torchaos_quantization():
    pytest.importorskip("torchao")
    block, x, branch, modulation = _qwen_block_and_inputs()
    # Qwen-Image's block, line by line (one stream, no modulate_index)
    mod1, mod2 = modulation.chunk(2, dim=-1)
    modulated, gate1 = block._modulate(block.img_norm1(x), mod1)
    first = _torchao_rows(modulated)
    stream = x + gate1 * branch
    modulated, gate2 = block._modulate(block.img_norm2(stream), mod2)
    second = _torchao_rows(modulated)
    last = stream + gate2 * branch

    shift1, scale1, g1 = mod1.chunk(3, dim=-1)
    shift2, scale2, g2 = mod2.chunk(3, dim=-1)
    eps = block.img_norm1.eps
    assert _equal_fp8(block_glue.modulated_layer_norm_fp8(x, eps, scale1, shift1), first)
    got = block_glue.gated_add_layer_norm_fp8(x, branch, g1, eps, scale2, shift2)
    assert torch.equal(got[0], stream) and _equal_fp8(got[1:], second)
    assert torch.equal(block_glue.gated_add(stream, branch, g2), last)
    assert got[1].dtype == FP8 and got[2].shape == (2, 5, 1) and got[2].dtype == torch.float32


def test_qwen_per_token_references_are_the_blocks_own_steps():
    """Qwen-Image-Edit-2511's blocks (``zero_cond_t``): twice the modulation rows and an index per token,
    line by line as diffusers' ``_modulate`` selects them."""
    pytest.importorskip("torchao")
    block, x, branch, _ = _qwen_block_and_inputs()
    torch.manual_seed(3)
    modulation = (torch.randn(2 * x.shape[0], 6 * x.shape[-1]) * 0.5).to(x.dtype)  # [2B, 6C]: t, then t = 0
    index = torch.zeros(x.shape[:2], dtype=torch.int32)
    index[:, 2:] = 1  # the reference image's tokens
    mod1, mod2 = modulation.chunk(2, dim=-1)
    modulated, gate1 = block._modulate(block.img_norm1(x), mod1, index)
    first = _torchao_rows(modulated)
    stream = x + gate1 * branch
    modulated, gate2 = block._modulate(block.img_norm2(stream), mod2, index)
    second = _torchao_rows(modulated)
    last = stream + gate2 * branch

    shift1, scale1, g1 = mod1.chunk(3, dim=-1)
    shift2, scale2, g2 = mod2.chunk(3, dim=-1)
    eps = block.img_norm1.eps
    assert _equal_fp8(block_glue.modulated_layer_norm_fp8(x, eps, scale1, shift1, index=index), first)
    got = block_glue.gated_add_layer_norm_fp8(x, branch, g1, eps, scale2, shift2, index=index)
    assert torch.equal(got[0], stream) and _equal_fp8(got[1:], second)
    assert torch.equal(block_glue.gated_add(stream, branch, g2, index), last)
    assert not torch.equal(block_glue.gated_add(stream, branch, g2[: x.shape[0]]), last)  # the index mattered
    with pytest.raises(ValueError, match="per-token index"):
        block_glue.gated_add(stream, branch, g2, index.long())
    with pytest.raises(ValueError, match=r"is not \[4, "):
        block_glue.gated_add(stream, branch, g2[: x.shape[0]], index)


def test_unsupported_tensors_are_refused_with_the_reason():
    _, x, branch, modulation = _block_and_inputs()
    weight, scale = torch.ones(64, dtype=torch.bfloat16), modulation[:, :64]
    with pytest.raises(ValueError, match="not \\[batch, tokens, width\\]"):
        block_glue.modulated_norm_fp8(x[0], weight, 1e-5, scale)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        block_glue.modulated_norm_fp8(x.float(), weight.float(), 1e-5, scale.float())
    with pytest.raises(ValueError, match="float8 dtype"):
        block_glue.modulated_norm_fp8(x, weight, 1e-5, scale, torch.float8_e5m2)
    with pytest.raises(ValueError, match="norm weight"):
        block_glue.modulated_norm_fp8(x, weight[:32], 1e-5, scale)
    with pytest.raises(ValueError, match="modulation"):
        block_glue.modulated_norm_fp8(x, weight, 1e-5, modulation[:1, :64])
    with pytest.raises(ValueError, match="not contiguous"):
        block_glue.modulated_norm_fp8(x.transpose(1, 2).contiguous().transpose(1, 2), weight, 1e-5, scale)
    with pytest.raises(ValueError, match="not shaped like the stream"):
        block_glue.gated_residual(x, branch[:, :3], weight, 1e-5, scale)
    with pytest.raises(ValueError, match="a modulation in torch.float32"):
        block_glue.modulated_layer_norm_fp8(x, 1e-6, scale.float(), scale)
    with pytest.raises(ValueError, match="modulation"):
        block_glue.gated_add(x, branch, modulation[:1, :64])


def test_operators_pass_torchs_checks_and_compile():
    _, x, branch, modulation = _block_and_inputs()
    weight, gate, scale = torch.ones(64, dtype=torch.bfloat16), modulation[:, :64], modulation[:, 128:192]
    ops = torch.ops.bcg_diffusion
    torch.library.opcheck(ops.modulated_norm_fp8.default, (x, weight, 1e-5, scale, FP8))
    torch.library.opcheck(ops.gated_residual_fp8.default, (x, branch, weight, 1e-6, gate, weight, 1e-5, scale, FP8))
    torch.library.opcheck(ops.gated_residual.default, (x, branch, weight, 1e-6, gate))
    torch.library.opcheck(ops.modulated_layer_norm_fp8.default, (x, 1e-6, scale, gate, FP8))
    torch.library.opcheck(ops.gated_add_layer_norm_fp8.default, (x, branch, gate, 1e-6, scale, gate, FP8))
    torch.library.opcheck(ops.gated_add.default, (x, branch, gate))

    def glue(x, branch, modulation):
        gate, scale = modulation[:, :64], modulation[:, 128:192]
        stream, data, scales = block_glue.gated_residual_fp8(x, branch, weight, 1e-6, gate, weight, 1e-5, scale)
        return block_glue.gated_residual(stream, branch, weight, 1e-6, gate), data, scales

    compiled = torch.compile(glue, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, branch, modulation), glue(x, branch, modulation)
    assert torch.equal(got[0], want[0]) and _equal_fp8(got[1:], want[1:])


def test_the_kernel_runs_only_where_triton_and_a_gpu_are():
    assert "not a CUDA GPU" in block_glue.unavailable(torch.device("cpu"))


@needs_triton
def test_kernel_matches_the_references_in_tritons_interpreter():
    run_interpreted("_block_glue_interpret.py")
