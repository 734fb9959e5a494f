"""Fast mode's FLUX blocks (``patches/flux_block.py``): under FP8, the single block's attention output and MLP
GELU joined in the output projection's FP8 input by one kernel, its norm and the double block's glue in the
block-glue kernels; in bf16, the single block's output projection split at the join.

On a CPU the kernel runs its PyTorch reference, so the patched block must give the unpatched block's bytes.
torchao refuses to quantize on a CPU, so the weights are made as its config makes them
(``tests/test_fp8_feed_forward.py``'s helper); its products run on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels import block_glue as block_glue_kernels
from bcg_diffusion.patches import block_glue, flux_block
from bcg_diffusion.patches import fp8_feed_forward as ff
from bcg_diffusion.patches.flux_attention import FLUX_ATTENTION_PATCHES

pytest.importorskip("torchao")
from diffusers.models.transformers.transformer_flux import (  # noqa: E402
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
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


# bf16 fast mode: the MLP's GELU in its product's epilogue and the output projection split at the join. The
# forward takes CUDA weights only; on a CPU these tests let it take them and give the epilogue product its tanh
# GELU (a CPU's _addmm_activation computes the erf one), then hold it, in float64, to the class's forward.


def _split_on_cpu(monkeypatch):
    monkeypatch.setattr(flux_block, "_plain_half_linear", lambda module: type(module) is torch.nn.Linear)

    def tanh_epilogue(bias, rows, weight, use_gelu=False):
        product = torch.addmm(bias, rows, weight)
        return torch.nn.functional.gelu(product, approximate="tanh") if use_gelu else product

    monkeypatch.setattr(torch, "_addmm_activation", tanh_epilogue)


def _float64(tensors: tuple) -> tuple:
    image, text, temb, (cos, sin) = tensors
    return image.double(), text.double(), temb.double(), (cos.double(), sin.double())


def test_the_split_output_is_the_joined_products_sum(monkeypatch):
    _split_on_cpu(monkeypatch)
    block = _block(quantized=False).double()
    inputs = _float64(_inputs())
    patches = MethodPatches()
    with torch.no_grad():
        expected = block(*inputs)
        assert flux_block.patch_flux_split_outputs(torch.nn.Sequential(block), patches) == 1
        try:
            got = block(*inputs)
        finally:
            patches.undo()
    for g, w in zip(got, expected, strict=True):  # the same sum, added in another order
        torch.testing.assert_close(g, w)
    assert "forward" not in block.__dict__


def test_the_split_forward_falls_back_where_the_block_no_longer_fits(monkeypatch):
    _split_on_cpu(monkeypatch)
    block = _block(quantized=False)
    inputs = _inputs()
    patches = MethodPatches()
    products = []
    epilogue = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **k: products.append(1) or epilogue(*a, **k))
    with torch.no_grad():
        flux_block.patch_flux_split_outputs(block, patches)
        try:
            block(*inputs)
            assert products == [1]
            original = FluxSingleTransformerBlock.forward
            block.proj_out = torch.nn.Sequential(block.proj_out)  # as a LoRA layer wraps it
            assert _equal(block(*inputs), original(block, *inputs)) and products == [1]
            block.proj_out = block.proj_out[0]
            block.act_mlp = torch.nn.GELU()
            assert _equal(block(*inputs), original(block, *inputs)) and products == [1]
        finally:
            patches.undo()


def test_blocks_the_split_forward_does_not_take_are_left_with_the_reason():
    block = _block(quantized=False)
    assert "on a CUDA GPU" in flux_block.unfit_split(block)  # a CPU block
    assert "on a CUDA GPU" in flux_block.unfit_split(_block())  # FP8 weights: the FP8 forward's
    assert "not diffusers' FluxSingleTransformerBlock" in flux_block.unfit_split(torch.nn.Linear(2, 2))
    block.proj_out = torch.nn.Sequential(block.proj_out)
    assert "proj_out is not a plain nn.Linear" in flux_block.unfit_split(block)
    block = _block(quantized=False)
    block_glue.choose(torch.nn.Sequential(block), False)
    assert "chosen off" in flux_block.unfit_split(block)


def test_the_split_forward_is_traced_whole_by_dynamo(monkeypatch):
    _split_on_cpu(monkeypatch)
    block = _block(quantized=False).float()
    image, text, temb, rotary = (t.float() if torch.is_tensor(t) else t for t in _inputs())
    patches = MethodPatches()
    try:
        assert flux_block.patch_flux_split_outputs(block, patches) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            for g, w in zip(compiled(image, text, temb, rotary), block(image, text, temb, rotary), strict=True):
                torch.testing.assert_close(g, w)
    finally:
        patches.undo()
        torch._dynamo.reset()


def test_the_gelu_epilogue_feature_splits_flux_single_blocks_and_undoes(monkeypatch):
    from bcg_diffusion.features.gelu_epilogue import GeluEpilogue

    _split_on_cpu(monkeypatch)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_block(quantized=False), _block(1, quantized=False)])
    feature = GeluEpilogue()
    patches = MethodPatches()
    feature.prepare(types.SimpleNamespace(modules={"transformer": model}), patches)
    try:
        assert feature.split_blocks == 2
        assert feature.patch_names() == [flux_block.FLUX_SPLIT_OUTPUT_PATCH]
    finally:
        patches.undo()
    assert all("forward" not in block.__dict__ for block in model.blocks)


# FP8 with fast mode's processor (it takes FP8 rows): the single block's norm and the double block's glue in the
# block-glue kernels, whose PyTorch references run on a CPU, so the bytes must be the unpatched block's with the
# same processor and FP8 feed-forwards.


def _with_fast_processor(block: torch.nn.Module, patches: MethodPatches) -> None:
    flux_processor = next(patch for patch in FLUX_ATTENTION_PATCHES if patch.processor_class == "FluxAttnProcessor")
    assert flux_processor.apply(block, patches) == 1
    ff.patch_fp8_feed_forwards(block, patches)


def _double(seed: int = 0, text_fp8: bool = True) -> FluxTransformerBlock:
    """A FLUX double block as ``quantize="fp8"`` leaves it: the image's query, key and value and both
    feed-forwards FP8 (the text's feed-forward too unless ``text_fp8`` is false), the rest bf16."""
    torch.manual_seed(seed)
    block = FluxTransformerBlock(WIDTH, HEADS, WIDTH // HEADS).to(torch.bfloat16).eval()
    linears = [block.attn.to_q, block.attn.to_k, block.attn.to_v, block.ff.net[0].proj, block.ff.net[2]]
    if text_fp8:
        linears += [block.ff_context.net[0].proj, block.ff_context.net[2]]
    for linear in linears:
        _fp8(linear)
    return block


def _counting_kernels(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("modulated_layer_norm_fp8", "gated_add_layer_norm_fp8", "gated_add"):
        original = getattr(block_glue_kernels, name)
        monkeypatch.setattr(
            block_glue_kernels, name, lambda *a, o=original, n=name, **k: calls.append(n) or o(*a, **k)
        )
    return calls


def _patched_with_fast_processor(block: torch.nn.Module, patch, monkeypatch) -> tuple[tuple, tuple, list[str]]:
    """The block's outputs with fast mode's processor and FP8 feed-forwards, before and after ``patch`` (which
    must patch it), and the block-glue kernels the patched call ran; the patch undone."""
    image, text, temb, rotary = _inputs()
    patches = MethodPatches()
    _with_fast_processor(block, patches)
    calls = _counting_kernels(monkeypatch)
    with torch.no_grad():
        expected = block(image, text, temb, image_rotary_emb=rotary)
        assert patch(torch.nn.Sequential(block), patches) == 1
        try:
            got = block(image, text, temb, image_rotary_emb=rotary)
        finally:
            patches.undo()
    return got, expected, calls


@pytest.mark.parametrize("text_fp8", [True, False])
def test_the_patched_double_block_gives_the_unpatched_blocks_bytes(text_fp8, monkeypatch):
    block = _double(text_fp8=text_fp8)
    got, expected, calls = _patched_with_fast_processor(block, flux_block.patch_flux_double_blocks, monkeypatch)
    assert _equal(got, expected)
    image_stream = ["modulated_layer_norm_fp8", "gated_add_layer_norm_fp8", "gated_add"]
    assert calls == image_stream + (["gated_add_layer_norm_fp8", "gated_add"] if text_fp8 else [])
    assert "forward" not in block.__dict__


def test_the_single_block_enters_attention_as_fp8_rows_with_fast_modes_processor(monkeypatch):
    got, expected, calls = _patched_with_fast_processor(_block(), flux_block.patch_flux_single_blocks, monkeypatch)
    assert _equal(got, expected)
    assert calls == ["modulated_layer_norm_fp8"]


def test_a_double_block_call_that_does_not_fit_runs_the_class_forward(monkeypatch):
    block = _double()
    inputs = _inputs()
    patches = MethodPatches()
    _with_fast_processor(block, patches)
    calls = _counting_kernels(monkeypatch)
    original = FluxTransformerBlock.forward
    with torch.no_grad():
        flux_block.patch_flux_double_blocks(block, patches)
        try:
            block(*inputs)
            assert calls
            calls.clear()
            to_q = block.attn.to_q
            block.attn.to_q = torch.nn.Sequential(to_q)  # as a LoRA layer wraps it: its own forward must run
            assert _equal(block(*inputs), original(block, *inputs)) and calls == []
            block.attn.to_q = to_q
            block.ff.net[1].p, block.ff.net[1].training = 0.5, True  # a dropout that drops: the class's forward
            torch.manual_seed(0)
            want = original(block, *inputs)
            torch.manual_seed(0)
            assert _equal(block(*inputs), want) and calls == []
        finally:
            patches.undo()


def test_double_blocks_that_do_not_fit_are_left_with_the_reason():
    assert "not diffusers' FluxTransformerBlock" in flux_block.unfit_double(_block())
    assert "not a torchao Float8Tensor" in flux_block.unfit_double(_double_bf16())
    block = _double()
    assert flux_block.unfit_double(block) is None
    ff.choose(block, "torchao")
    assert "chose 'torchao'" in flux_block.unfit_double(block)
    block = _double()
    assert block_glue.choose(torch.nn.Sequential(block), False) == 1
    assert "chosen off" in flux_block.unfit_double(block)


def _double_bf16() -> FluxTransformerBlock:
    torch.manual_seed(0)
    return FluxTransformerBlock(WIDTH, HEADS, WIDTH // HEADS).to(torch.bfloat16).eval()


def test_the_patched_double_block_is_traced_whole_by_dynamo():
    block = _double()
    image, text, temb, rotary = _inputs()
    patches = MethodPatches()
    _with_fast_processor(block, patches)
    try:
        assert flux_block.patch_flux_double_blocks(block, patches) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            assert _equal(compiled(image, text, temb, rotary), block(image, text, temb, rotary))
    finally:
        patches.undo()
        torch._dynamo.reset()
