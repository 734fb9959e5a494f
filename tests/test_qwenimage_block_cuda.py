"""Fast mode's Qwen-Image FP8 block with its glue in our kernels, on a GPU (marker: cuda).

One block of Qwen-Image's shape at a smaller width (768, heads of 128), prepared as fast mode prepares it
under ``quantize="fp8"``: quantized, the FP8 feed-forward, fast mode's processor and RoPE, called as fast
mode's CFG batch calls it (two prompts of 64 and 40 valid text tokens). Patched, it stays near the same
block with inductor's glue (the class's forward), compiles whole, and a CUDA graph of the compiled block
replays its bytes; the same for Qwen-Image-Edit-2511's block (``zero_cond_t``: per-token modulation).
"""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features.compiled_blocks import compile_repeated_blocks
from bcg_diffusion.features.quantization import FP8, default_filter, quantize_transformer, torchao_config
from bcg_diffusion.patches import qwenimage_block
from bcg_diffusion.patches.attention import QWEN_ATTENTION_PATCH, TEXT_LENGTHS_KWARG
from bcg_diffusion.patches.fp8_feed_forward import patch_fp8_feed_forwards
from bcg_diffusion.patches.rope import QWEN_REAL_ROPE_PATCH
from bench.probes.probe_fast_floor import random_block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs compute 8.9+"
    ),
]
pytest.importorskip("torchao")

WIDTH, HEADS, IMAGE, TEXT = 768, 6, 1024, 64


def _prepared_block(zero_cond_t: bool = False) -> tuple[torch.nn.Module, MethodPatches]:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    holder = torch.nn.Module()
    with torch.device("cuda"):  # trained-like scales: matrices ~ N(0, 1/fan_in), norms ~ 1; bf16
        holder.block = random_block(QwenImageTransformerBlock(WIDTH, HEADS, WIDTH // HEADS, zero_cond_t=zero_cond_t))
    holder._repeated_blocks = ["QwenImageTransformerBlock"]
    quantize_transformer(holder, torchao_config(FP8), default_filter(holder))
    patches = MethodPatches()
    assert QWEN_REAL_ROPE_PATCH.apply(holder, patches) + QWEN_ATTENTION_PATCH.apply(holder, patches) == 2
    assert patch_fp8_feed_forwards(holder, patches) == 1  # the image stream's: the text stream stays bf16
    return holder, patches


def _inputs(zero_cond_t: bool = False) -> tuple[tuple, dict]:
    """Fast mode's CFG batch of two prompts; with ``zero_cond_t``, Qwen-Image-Edit-2511's: twice the
    embedding rows and the input image's tokens (the second half) indexed 1."""
    torch.manual_seed(1)

    def frequencies(tokens: int) -> torch.Tensor:
        angles = torch.rand(tokens, WIDTH // HEADS // 2, device="cuda") * 6.28
        return torch.polar(torch.ones_like(angles), angles)

    args = (
        torch.randn(2, IMAGE, WIDTH, device="cuda", dtype=torch.bfloat16),
        torch.randn(2, TEXT, WIDTH, device="cuda", dtype=torch.bfloat16),
        None,
        torch.randn(4 if zero_cond_t else 2, WIDTH, device="cuda", dtype=torch.bfloat16),
    )
    kwargs = {
        "image_rotary_emb": (frequencies(IMAGE), frequencies(TEXT)),
        "joint_attention_kwargs": {TEXT_LENGTHS_KWARG: (TEXT, 40)},
    }
    if zero_cond_t:
        index = torch.zeros(2, IMAGE, dtype=torch.int32, device="cuda")
        index[:, IMAGE // 2 :] = 1
        kwargs["modulate_index"] = index
    return args, kwargs


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["Qwen-Image", "Qwen-Image-Edit-2511"])
def test_the_fp8_block_glue_stays_near_inductors_and_a_graph_replays_its_compiled_bytes(zero_cond_t):
    holder, patches = _prepared_block(zero_cond_t)
    args, kwargs = _inputs(zero_cond_t)

    def relative_error(got: tuple, expected: tuple) -> float:
        got, expected = (torch.cat([t.flatten().float() for t in ts]) for ts in (got, expected))
        return ((got - expected).norm() / expected.norm()).item()

    try:
        with torch.no_grad():
            expected = holder.block(*args, **kwargs)  # the class's forward: the glue in PyTorch's operators
            assert qwenimage_block.patch_qwenimage_blocks(holder, patches) == 1
            got = holder.block(*args, **kwargs)
            error = relative_error(got, expected)
            assert error < 0.02, error  # FP8 rows a few ulps apart move some float8 values by a step
            compile_repeated_blocks(holder, patches)
            compiled = holder.block(*args, **kwargs)
            assert relative_error(compiled, expected) < 0.02
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                holder.block(*args, **kwargs)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = holder.block(*args, **kwargs)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(c, e) for c, e in zip(captured, compiled, strict=True))
            print(f"\nrelative error against inductor's glue {error:.4f}")
    finally:
        patches.undo()
        torch._dynamo.reset()
