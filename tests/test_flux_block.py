"""Fast mode's FLUX single block under FP8: its attention output and MLP GELU joined in the output
projection's FP8 input by one kernel (``patches/flux_block.py``).

On a CPU the kernel runs its PyTorch reference, so the patched block must give the unpatched block's bytes.
torchao refuses to quantize on a CPU, so the weights are made as its config makes them
(``tests/test_fp8_feed_forward.py``'s helper); its products run on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.patches import block_glue, flux_block

pytest.importorskip("torchao")
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock  # noqa: E402
from test_fp8_feed_forward import _fp8  # noqa: E402

WIDTH, HEADS, IMAGE, TEXT = 64, 2, 8, 6


def _block(seed: int = 0, quantized: bool = True) -> FluxSingleTransformerBlock:
    """A FLUX single block as ``quantize="fp8"`` leaves it: its projections FP8, its modulation bf16."""
    torch.manual_seed(seed)
    block = FluxSingleTransformerBlock(WIDTH, HEADS, WIDTH // HEADS).to(torch.bfloat16).eval()
    if quantized:
        for linear in (block.proj_mlp, block.proj_out, block.attn.to_q, block.attn.to_k, block.attn.to_v):
            _fp8(linear)
    return block


def _inputs() -> tuple:
    torch.manual_seed(1)
    image = (torch.randn(1, IMAGE, WIDTH) * 2).to(torch.bfloat16)
    text = (torch.randn(1, TEXT, WIDTH) * 2).to(torch.bfloat16)
    temb = torch.randn(1, WIDTH).to(torch.bfloat16)
    angles = torch.randn(TEXT + IMAGE, WIDTH // HEADS)
    return image, text, temb, (angles.cos(), angles.sin())


def _equal(got: tuple, want: tuple) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_patched_block_gives_the_unpatched_blocks_bytes(monkeypatch):
    block = _block()
    image, text, temb, rotary = _inputs()
    patches = MethodPatches()
    joined = []
    kernel = flux_block.gelu_fp8
    monkeypatch.setattr(flux_block, "gelu_fp8", lambda *args, **kwargs: joined.append(1) or kernel(*args, **kwargs))
    with torch.no_grad():
        expected = block(image, text, temb, image_rotary_emb=rotary)
        assert flux_block.patch_flux_single_blocks(torch.nn.Sequential(block), patches) == 1
        try:
            assert _equal(block(image, text, temb, image_rotary_emb=rotary), expected)
            assert joined == [1]  # the joined row came from the kernel's operator
        finally:
            patches.undo()
    assert "forward" not in block.__dict__  # the class's forward again


def test_a_block_that_no_longer_fits_runs_the_class_forward():
    block = _block()
    image, text, temb, rotary = _inputs()
    patches = MethodPatches()
    calls = []
    original = FluxSingleTransformerBlock.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with torch.no_grad():
        flux_block.patch_flux_single_blocks(block, patches)
        FluxSingleTransformerBlock.forward = counting
        try:
            block(image, text, temb, rotary)
            assert calls == []
            proj_out = block.proj_out
            block.proj_out = torch.nn.Sequential(proj_out)  # as a LoRA layer wraps it: its own forward must run
            assert _equal(block(image, text, temb, rotary), original(block, image, text, temb, rotary))
            assert calls == [1]
            block.proj_out = proj_out
            block.act_mlp = torch.nn.GELU()  # the exact GELU: not the kernel's
            assert _equal(block(image, text, temb, rotary), original(block, image, text, temb, rotary))
            assert calls == [1, 1]
        finally:
            FluxSingleTransformerBlock.forward = original
            patches.undo()


def test_blocks_that_do_not_fit_are_left_with_the_reason():
    assert "not diffusers' FluxSingleTransformerBlock" in flux_block.unfit(torch.nn.Linear(2, 2))
    assert "not a torchao Float8Tensor" in flux_block.unfit(_block(quantized=False))
    block = _block()
    assert flux_block.unfit(block) is None
    block.act_mlp = torch.nn.GELU()
    assert "not nn.GELU(approximate='tanh')" in flux_block.unfit(block)
    block = _block()
    block.proj_out = torch.nn.Sequential(block.proj_out)
    assert "proj_out is not a plain nn.Linear" in flux_block.unfit(block)
    block = _block()
    assert block_glue.choose(torch.nn.Sequential(block), False) == 1
    assert "chosen off" in flux_block.unfit(block)


def test_the_patched_block_is_traced_whole_by_dynamo():
    block = _block()
    image, text, temb, rotary = _inputs()
    patches = MethodPatches()
    try:
        assert flux_block.patch_flux_single_blocks(block, patches) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():  # as pipelines call it (torch has no derivative for _scaled_mm)
            assert _equal(compiled(image, text, temb, rotary), block(image, text, temb, rotary))
    finally:
        patches.undo()
        torch._dynamo.reset()


def test_the_block_glue_feature_patches_flux_single_blocks_and_undoes():
    from bcg_diffusion.features.block_glue import FusedBlockGlue

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_block(), _block(1)])
    feature = FusedBlockGlue()
    patches = MethodPatches()
    feature.prepare(types.SimpleNamespace(quantized="fp8", modules={"transformer": model}), patches)
    try:
        assert feature.stats() == {"fused_blocks": 2}
        assert feature.patch_names() == [flux_block.FLUX_SINGLE_BLOCK_PATCH]
    finally:
        patches.undo()
    assert all("forward" not in block.__dict__ for block in model.blocks)
