"""Masks that hide keys only, on a GPU (marker: cuda): cuDNN's FP8 attention and FlashAttention-4 with key
lengths (``kernels.key_padding``), each skipped where its package or GPU is missing.

Each kernel with key lengths at HunyuanImage 2.1's 2048² sequence (4,096 image and 1,128 text tokens, a few of
them visible): near float32 attention with the same mask (FP8: as near as its kernel without a mask; FA4: as
near as PyTorch's SDPA with the mask), the hidden keys without effect on the bytes, the same bytes on every call
and from a CUDA graph. Then tiny HunyuanImage with 128-wide heads in fast mode with each option: its masked joint
attention on the kernel, the graphs giving the bytes of the compiled blocks without graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_published_cuda import fast_mode_with

from bcg_diffusion.kernels import cudnn_fp8_attention, fa4_attention, key_padding
from bcg_diffusion.patches import dispatched_attention
from bench.measure import psnr

pytestmark = pytest.mark.cuda

TOKENS = 4096 + 1128
LENGTHS = (4096 + 83, 4096 + 8)  # HunyuanImage's random prompts: 83 and 8 visible text tokens


def _skip_unless(kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    module = cudnn_fp8_attention if kernel == "cudnn-fp8" else fa4_attention
    reason = module.unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


def _inputs(heads: int = 4):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, TOKENS, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")


def _masked(q, k, v, mask=None, dtype=torch.float32):
    out = F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return out.transpose(1, 2).float()


def _error(out, reference):
    return ((out.float() - reference).norm() / reference.norm()).item()


def _attend(kernel, q, k, v, lengths=None):
    if kernel == "cudnn-fp8":
        return cudnn_fp8_attention.attention(q, k, v, key_lengths=lengths)
    return fa4_attention.attention(q, k, v, key_lengths=lengths)


@pytest.mark.parametrize("kernel", ["cudnn-fp8", "fa4"])
def test_key_lengths_hide_keys_as_a_mask_does_repeat_their_bytes_and_replay_from_a_graph(kernel):
    _skip_unless(kernel)
    q, k, v, lengths = _inputs()
    mask = key_padding.reference_mask(lengths, TOKENS)
    reference = _masked(q, k, v, mask)
    out = _attend(kernel, q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    if kernel == "fa4":  # bf16: as near as PyTorch's SDPA with the mask
        assert _error(out, reference) <= _error(_masked(q, k, v, mask, torch.bfloat16), reference) * 1.05
    else:  # FP8: as near as the kernel without a mask is to unmasked attention
        unmasked = _error(_attend(kernel, q, k, v), _masked(q, k, v))
        assert _error(out, reference) <= unmasked * 1.5, (_error(out, reference), unmasked)
    assert _error(out, _masked(q, k, v)) > 5 * _error(out, reference)  # the mask mattered
    hidden = ~mask[:, 0, 0, :, None, None]
    k2 = torch.where(hidden, -k, k)  # the hidden keys change, the largest magnitude does not
    v2 = torch.where(hidden, v.flip(1), v) if kernel == "fa4" else v
    assert torch.equal(_attend(kernel, q, k2, v2, lengths), out)
    assert torch.equal(_attend(kernel, q, k, v, lengths), out), "not deterministic"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _attend(kernel, q, k, v, lengths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    assert cudnn_fp8_attention.refusals() == {}, "cuDNN refused a shape: its calls computed the reference"


@pytest.mark.parametrize("kernel", ["cudnn-fp8", "fa4"])
def test_a_scattered_key_mask_through_the_dispatch_is_near_masked_attention(kernel):
    _skip_unless(kernel)
    q, k, v, _ = _inputs()
    visible = torch.rand(2, TOKENS, device="cuda") > 0.3
    mask = visible[:, None, None, :]
    out = dispatched_attention.kernel_dispatch(kernel)(q, k, v, attn_mask=mask)
    reference = _masked(q, k, v, mask)
    assert _error(out, reference) < (0.1 if kernel == "cudnn-fp8" else 0.01), _error(out, reference)


@pytest.mark.parametrize("attention", ["fp8", "fa4"])
def test_hunyuanimage_in_fast_mode_attends_with_key_lengths_and_replays_its_compiled_bytes(attention):
    _skip_unless("cudnn-fp8" if attention == "fp8" else "fa4")
    report, image, bf16 = fast_mode_with("HunyuanImage", attention=attention)
    modules = report["fp8_attention_modules"] if attention == "fp8" else report["fa4_attention_modules"]
    assert report["attention"] == attention and modules > 0, report
    if attention == "fp8":  # the FP8 kernel ran in the joint attention, which is masked
        assert not torch.equal(image, bf16)
    # FA4 is the same bf16 attention: on the tiny model its image may equal PyTorch's kernel's, byte for byte
    # (run 214); that its masked calls reach it is tests/test_fa4_attention.py's, on the CPU
    assert psnr(image.float().cpu(), bf16.float().cpu()) > (25 if attention == "fp8" else 35)
