"""Fast mode's Z-Image FP8 block: its glue in three kernels (``patches/zimage_block.py``).

On a CPU the kernels' operators run their PyTorch references, so the patched block must give the bytes of
the unpatched one with fast mode's other FP8 pieces (the fused query, key and value product, the FP8
feed-forward, the Z-Image processor). torchao refuses to quantize on a CPU, so the weights are made as its
config makes them (``tests/test_fp8_feed_forward.py``'s helper); its products run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.patches import block_glue, zimage_block
from bcg_diffusion.patches import fp8_feed_forward as ff
from bcg_diffusion.patches.attention import FUSED_QKV_ATTRIBUTE, ZIMAGE_ROPE_PATCH

pytest.importorskip("torchao")
from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock  # noqa: E402
from test_fp8_feed_forward import _fp8  # noqa: E402

WIDTH, HEADS, TOKENS = 64, 2, 6


def _block(seed: int = 0) -> ZImageTransformerBlock:
    """A Z-Image block as fast mode prepares it under ``quantize="fp8"`` before its glue is fused: FP8
    feed-forward, one FP8 product for query, key and value, fast mode's processor."""
    torch.manual_seed(seed)
    block = ZImageTransformerBlock(0, WIDTH, HEADS, HEADS, 1e-5, qk_norm=True).to(torch.bfloat16).eval()
    for name in zimage_block._NORMS:
        torch.nn.init.normal_(getattr(block, name).weight, 1.0, 0.1)
    for linear in (block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3):
        _fp8(linear)
    attention = block.attention
    joined = torch.cat([attention.to_q.weight, attention.to_k.weight, attention.to_v.weight])
    fused = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False).to(torch.bfloat16)
    fused.weight = torch.nn.Parameter(joined.detach().clone(), requires_grad=False)
    _fp8(fused)
    attention.add_module(FUSED_QKV_ATTRIBUTE, fused)
    return block


def _prepared(block: ZImageTransformerBlock) -> MethodPatches:
    patches = MethodPatches()
    assert ZIMAGE_ROPE_PATCH.apply(block, patches) == 1
    assert ff.patch_fp8_feed_forwards(block, patches) == 1
    return patches


def _inputs(batch: int = 2):
    torch.manual_seed(1)
    x = (torch.randn(batch, TOKENS, WIDTH) * 2).to(torch.bfloat16)
    freqs = torch.polar(
        torch.ones(batch, TOKENS, WIDTH // HEADS // 2), torch.randn(batch, TOKENS, WIDTH // HEADS // 2)
    )
    adaln = torch.randn(batch, min(WIDTH, 256)).to(torch.bfloat16)
    return x, None, freqs, adaln


@pytest.mark.parametrize("batch", [1, 2])
def test_the_patched_block_gives_the_unpatched_blocks_bytes(batch):
    block = _block()
    patches = _prepared(block)
    inputs = _inputs(batch)
    with torch.no_grad():
        expected = block(*inputs)
        assert zimage_block.patch_zimage_blocks(torch.nn.Sequential(block), patches) == 1
        try:
            assert torch.equal(block(*inputs), expected)
        finally:
            patches.undo()
        assert "forward" not in block.__dict__  # the class's forward again


def test_a_call_that_does_not_fit_runs_the_class_forward():
    block = _block()
    patches = _prepared(block)
    x, mask, freqs, adaln = _inputs()
    with torch.no_grad():
        zimage_block.patch_zimage_blocks(block, patches)
        try:
            calls = []
            original = ZImageTransformerBlock.forward

            def counting(self, *args, **kwargs):
                calls.append(1)
                return original(self, *args, **kwargs)

            ZImageTransformerBlock.forward = counting
            try:
                block(x, mask, freqs, adaln)
                assert calls == []
                noise_mask = torch.zeros(2, TOKENS, dtype=torch.bool)
                block(x, mask, freqs, None, noise_mask, adaln, adaln)  # per-token modulation (omni mode)
                assert calls == [1]
                # a feed-forward projection wrapped (as a LoRA layer wraps it): its own forward must run
                w1 = block.feed_forward.w1
                block.feed_forward.w1 = torch.nn.Sequential(w1)
                expected = original(block, x, mask, freqs, adaln)
                assert torch.equal(block(x, mask, freqs, adaln), expected) and calls == [1, 1]
                block.feed_forward.w1 = w1
                # the fused product dropped (a projection replaced): the three projections again
                block.attention._modules.pop(FUSED_QKV_ATTRIBUTE)
                expected = original(block, x, mask, freqs, adaln)
                assert torch.equal(block(x, mask, freqs, adaln), expected) and calls == [1, 1, 1]
            finally:
                ZImageTransformerBlock.forward = original
        finally:
            patches.undo()


def test_blocks_that_do_not_fit_are_left_with_the_reason():
    plain = ZImageTransformerBlock(0, WIDTH, HEADS, HEADS, 1e-5, qk_norm=True)
    assert "no fused FP8" in zimage_block.unfit(plain)
    assert "not diffusers' ZImageTransformerBlock" in zimage_block.unfit(torch.nn.Linear(2, 2))
    assert "without modulation" in zimage_block.unfit(
        ZImageTransformerBlock(0, WIDTH, HEADS, HEADS, 1e-5, qk_norm=True, modulation=False)
    )
    block = _block()
    assert zimage_block.unfit(block) is None
    setattr(block.feed_forward, ff.FP8_FEED_FORWARD_ATTRIBUTE, "torchao")
    assert "chose 'torchao'" in zimage_block.unfit(block)
    block = _block()
    assert block_glue.choose(torch.nn.Sequential(block, _block(1)), False) == 2
    assert zimage_block.unfit(block) == "chosen off"
    with pytest.raises(TypeError, match="True or False"):
        block_glue.choose(block, "yes")


def test_the_patched_block_is_traced_whole_by_dynamo():
    block = _block()
    patches = _prepared(block)
    inputs = _inputs()
    try:
        assert zimage_block.patch_zimage_blocks(block, patches) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():  # as pipelines call it (torch has no derivative for _scaled_mm)
            assert torch.equal(compiled(*inputs), block(*inputs))
    finally:
        patches.undo()
        torch._dynamo.reset()
