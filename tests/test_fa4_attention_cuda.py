"""FlashAttention-4 (``attention="fa4"``) on a GPU (marker: cuda; skipped where ``flash-attn-4`` or a GPU of
compute capability 9.x or 10.x is missing).

The kernel alone: no further from float32 attention than PyTorch's SDPA (cuDNN's kernel on Hopper), the
same bytes on every call, and replayed from a CUDA graph. Then each published family's tiny pipeline with
128-wide heads (``test_published_cuda``) in fast mode: every attention module on the kernel, the graphs giving
the bytes of the same compiled blocks without graphs, and the images near bf16 fast mode's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_published import PIPELINES
from test_published_cuda import fast_mode_with

from bcg_diffusion.kernels import fa4_attention
from bench.measure import psnr

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _fa4_runs_here():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    reason = fa4_attention.unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


def _error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("tokens", [1536, 4608])
def test_kernel_is_as_near_float32_as_sdpa_repeats_its_bytes_and_replays_from_a_graph(tokens):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, tokens, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    as_sdpa = [t.transpose(1, 2) for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*(t.float() for t in as_sdpa)).transpose(1, 2)
    pytorchs = F.scaled_dot_product_attention(*as_sdpa).transpose(1, 2)
    out = fa4_attention.attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert _error(out, reference) <= _error(pytorchs, reference) * 1.05, (
        _error(out, reference),
        _error(pytorchs, reference),
    )
    assert torch.equal(fa4_attention.attention(q, k, v), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fa4_attention.attention(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("name", PIPELINES)
def test_every_attention_module_runs_fa4_and_graphs_equal_their_compiled_blocks(name):
    report, fa4, pytorchs = fast_mode_with(name, attention="fa4")
    assert report["attention"] == "fa4" and report["fa4_attention_modules"] > 0, report
    near = psnr(fa4.float().cpu(), pytorchs.float().cpu())
    assert near > 35, near  # the same precision as PyTorch's kernel: rounding apart
