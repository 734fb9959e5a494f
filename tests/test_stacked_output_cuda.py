"""The stacked output projection (``kernels/stacked_linear.py``) on a GPU (marker: cuda): at Qwen-Image's
1024² CFG shapes each part's rows are the bytes of cuBLAS's ``F.linear`` on that part, and a CUDA graph
of it replays them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bcg_diffusion.kernels.stacked_linear import stacked_linear

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS, WIDTH = 4096, 3072  # Qwen-Image 1024²: 64 x 64 image tokens per prompt, 24 heads of 128


def test_each_part_is_cublas_linear_on_it_and_a_graph_replays_it():
    torch.manual_seed(0)
    outputs = torch.randn(2, 120 + ROWS, WIDTH, device="cuda", dtype=torch.bfloat16)  # two groups' attention
    parts = [outputs[0, 120:], outputs[1, 64 : 64 + ROWS]]  # their image rows, views
    weight = torch.randn(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16) * WIDTH**-0.5
    bias = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = stacked_linear(parts, weight, bias)
        assert torch.equal(out, torch.cat([F.linear(p, weight, bias) for p in parts]))
        torch.testing.assert_close(out, F.linear(torch.cat(parts), weight, bias), atol=0.05, rtol=0.02)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            stacked_linear(parts, weight, bias)  # warm-up off the capture (cuBLAS's workspace)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = stacked_linear(parts, weight, bias)
        outputs.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, torch.cat([F.linear(p, weight, bias) for p in parts]))
