"""Fast mode's Z-Image FP8 block with its glue in our kernels, on a GPU (marker: cuda).

Tiny Z-Image's feed-forward is too narrow for FP8 (its widths are not multiples of 16), so the block
patch (``patches/zimage_block.py``) never applies to it; here one block of Z-Image's shape at a smaller
width (768, heads of 128) is prepared as fast mode prepares it under ``quantize="fp8"``: quantized, one
product for query, key and value, the FP8 feed-forward, fast mode's processor. Patched, it stays near the
same block with inductor's glue (the class's forward), compiles whole, and a CUDA graph of the compiled
block replays its bytes.
"""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features.compiled_blocks import compile_repeated_blocks
from bcg_diffusion.features.fused_qkv import fuse_qkv
from bcg_diffusion.features.quantization import FP8, default_filter, quantize_transformer, torchao_config
from bcg_diffusion.patches import zimage_block
from bcg_diffusion.patches.attention import ZIMAGE_ATTENTION_PATCH, ZIMAGE_ROPE_PATCH
from bcg_diffusion.patches.fp8_feed_forward import patch_fp8_feed_forwards
from bench.probes.probe_fast_floor import random_block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs compute 8.9+"
    ),
]
pytest.importorskip("torchao")

WIDTH, HEADS, TOKENS = 768, 6, 1088


def _prepared_block() -> tuple[torch.nn.Module, MethodPatches]:
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    torch.manual_seed(0)
    holder = torch.nn.Module()
    with torch.device("cuda"):  # trained-like scales: matrices ~ N(0, 1/fan_in), norms ~ 1; bf16
        holder.block = random_block(ZImageTransformerBlock(0, WIDTH, HEADS, HEADS, 1e-5, qk_norm=True))
    holder._repeated_blocks = ["ZImageTransformerBlock"]
    done = quantize_transformer(holder, torchao_config(FP8), default_filter(holder))
    assert fuse_qkv(holder, done)
    patches = MethodPatches()
    assert ZIMAGE_ATTENTION_PATCH.apply(holder, patches) + ZIMAGE_ROPE_PATCH.apply(holder, patches) == 1
    assert patch_fp8_feed_forwards(holder, patches) == 1
    return holder, patches


def _inputs() -> tuple:
    torch.manual_seed(1)
    angles = torch.rand(1, TOKENS, WIDTH // HEADS // 2, device="cuda") * 6.28
    x = torch.randn(1, TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16)
    adaln = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    return x, None, torch.polar(torch.ones_like(angles), angles), adaln


def test_the_fp8_block_glue_stays_near_inductors_and_a_graph_replays_its_compiled_bytes():
    holder, patches = _prepared_block()
    inputs = _inputs()
    try:
        with torch.no_grad():
            expected = holder.block(*inputs)  # the class's forward: the glue in PyTorch's operators
            assert zimage_block.patch_zimage_blocks(holder, patches) == 1
            got = holder.block(*inputs)
            error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
            assert error < 0.02, error  # FP8 rows a few ulps apart move some float8 values by a step
            compile_repeated_blocks(holder, patches)
            compiled = holder.block(*inputs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                holder.block(*inputs)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = holder.block(*inputs)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, compiled)
            print(f"\nrelative error against inductor's glue {error:.4f}")
    finally:
        patches.undo()
        torch._dynamo.reset()
