"""Fast mode's Qwen-Image FP8 block: its glue in three kernels per stream (``patches/qwenimage_block.py``).

On a CPU the kernels' operators run their PyTorch references, so the patched block must give the bytes of
the unpatched one with fast mode's other FP8 pieces (the FP8 feed-forward, fast mode's processor attending
per group). torchao refuses to quantize on a CPU, so the weights are made as its config makes them
(``tests/test_fp8_feed_forward.py``'s helper); its products run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels import block_glue as block_glue_kernels
from bcg_diffusion.patches import block_glue, qwenimage_block
from bcg_diffusion.patches import fp8_feed_forward as ff
from bcg_diffusion.patches.attention import QWEN_ATTENTION_PATCH, TEXT_LENGTHS_KWARG
from bcg_diffusion.patches.zimage_block import ZIMAGE_BLOCK_PATCH

pytest.importorskip("torchao")
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock  # noqa: E402
from test_fp8_feed_forward import _fp8  # noqa: E402

WIDTH, HEADS, IMAGE, TEXT = 64, 2, 8, 6
HEAD_DIM = WIDTH // HEADS


def _block(seed: int = 0, text_fp8: bool = True, zero_cond_t: bool = False) -> QwenImageTransformerBlock:
    """A Qwen-Image block as fast mode prepares it under ``quantize="fp8"`` before its glue is fused: FP8
    projections and feed-forwards, the text stream's too unless ``text_fp8`` is false (``quantize="fp8"``'s
    default filter leaves them in bf16); ``zero_cond_t``: Qwen-Image-Edit-2511's."""
    torch.manual_seed(seed)
    block = QwenImageTransformerBlock(WIDTH, HEADS, HEAD_DIM, zero_cond_t=zero_cond_t).to(torch.bfloat16).eval()
    streams = (qwenimage_block._IMAGE, qwenimage_block._TEXT) if text_fp8 else (qwenimage_block._IMAGE,)
    for stream in streams:
        for name in stream.projections:
            _fp8(getattr(block.attn, name))
        feed_forward = getattr(block, stream.feed_forward)
        _fp8(feed_forward.net[0].proj)
        _fp8(feed_forward.net[2])
    return block


def _prepared(block: QwenImageTransformerBlock) -> MethodPatches:
    patches = MethodPatches()
    assert QWEN_ATTENTION_PATCH.apply(block, patches) == 1
    assert ff.patch_fp8_feed_forwards(block, patches) in (1, 2)
    return patches


def _inputs(lengths: tuple[int, ...]) -> tuple[tuple, dict]:
    """A call of the block: a batch of ``len(lengths)`` rows, each with its valid text tokens, and fast mode's
    text lengths (what its CFG batcher passes)."""
    batch = len(lengths)
    torch.manual_seed(1)
    image = (torch.randn(batch, IMAGE, WIDTH) * 2 + 0.5).to(torch.bfloat16)
    text = (torch.randn(batch, TEXT, WIDTH) * 2).to(torch.bfloat16)
    mask = torch.arange(TEXT)[None, :] < torch.tensor(lengths)[:, None]
    temb = torch.randn(batch, WIDTH).to(torch.bfloat16)
    angles = (torch.randn(IMAGE, HEAD_DIM // 2), torch.randn(TEXT, HEAD_DIM // 2))
    rotary = tuple(torch.polar(torch.ones_like(a), a) for a in angles)
    kwargs = {"image_rotary_emb": rotary, "joint_attention_kwargs": {TEXT_LENGTHS_KWARG: lengths}}
    return (image, text, mask, temb), kwargs


@pytest.mark.parametrize("text_fp8", [True, False])
@pytest.mark.parametrize("lengths", [(TEXT,), (TEXT, TEXT - 2)])
def test_the_patched_block_gives_the_unpatched_blocks_bytes(lengths, text_fp8):
    block = _block(text_fp8=text_fp8)
    patches = _prepared(block)
    args, kwargs = _inputs(lengths)
    with torch.no_grad():
        expected = block(*args, **kwargs)
        assert qwenimage_block.patch_qwenimage_blocks(torch.nn.Sequential(block), patches) == 1
        try:
            got = block(*args, **kwargs)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        finally:
            patches.undo()
        assert "forward" not in block.__dict__  # the class's forward again


@pytest.mark.parametrize("text_fp8", [True, False])
def test_a_per_token_modulated_block_gives_the_unpatched_blocks_bytes(text_fp8, monkeypatch):
    """Qwen-Image-Edit-2511's blocks (``zero_cond_t``): twice the modulation rows (the step's, then timestep
    0's) and ``modulate_index`` (the input image's tokens 1), as its transformer builds them; the kernels pick
    each token's row, the text stream keeps the step's."""
    calls = []
    original = block_glue_kernels.modulated_layer_norm_fp8
    monkeypatch.setattr(
        block_glue_kernels,
        "modulated_layer_norm_fp8",
        lambda *a, **k: calls.append(k.get("index")) or original(*a, **k),
    )
    block = _block(text_fp8=text_fp8, zero_cond_t=True)
    assert qwenimage_block.unfit(block) is None
    patches = _prepared(block)
    args, kwargs = _inputs((TEXT, TEXT - 2))
    temb = torch.cat([args[3], torch.randn_like(args[3])])  # [2B, C]: the step's embedding, then timestep 0's
    index = torch.zeros(2, IMAGE, dtype=torch.int32)
    index[:, IMAGE // 2 :] = 1
    call = (*args[:3], temb)
    with torch.no_grad():
        expected = block(*call, **kwargs, modulate_index=index)
        assert qwenimage_block.patch_qwenimage_blocks(torch.nn.Sequential(block), patches) == 1
        try:
            got = block(*call, **kwargs, modulate_index=index)
        finally:
            patches.undo()
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert len(calls) == (2 if text_fp8 else 1) and calls[0] is index  # the image stream per token, the text not
    assert all(i is None for i in calls[1:])


def test_a_call_that_does_not_fit_runs_the_class_forward():
    block = _block()
    patches = _prepared(block)
    args, kwargs = _inputs((TEXT, TEXT - 2))
    calls = []
    original = QwenImageTransformerBlock.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with torch.no_grad():
        qwenimage_block.patch_qwenimage_blocks(block, patches)
        QwenImageTransformerBlock.forward = counting
        try:
            block(*args, **kwargs)
            assert calls == []
            # per-token modulation (Qwen-Image-Edit-2511's zero_cond_t: twice the timesteps, an index per token)
            # with an index the kernels do not take (int64; its transformer makes int32)
            block.zero_cond_t = True
            index = torch.zeros(2, IMAGE, dtype=torch.long)
            doubled = (*args[:3], torch.cat([args[3], args[3]]))
            block(*doubled, **kwargs, modulate_index=index)
            assert calls == [1]
            block.zero_cond_t = False
            block(*args, **kwargs, modulate_index=index.int())  # an index without zero_cond_t: the class's way
            assert calls == [1, 1]
            calls.pop()
            # a text mask without fast mode's lengths: diffusers' processor runs, which takes no FP8 rows
            block(*args, image_rotary_emb=kwargs["image_rotary_emb"])
            assert calls == [1, 1]
            # a feed-forward projection wrapped (as a LoRA layer wraps it): its own forward must run
            down = block.img_mlp.net[2]
            block.img_mlp.net[2] = torch.nn.Sequential(down)
            expected = original(block, *args, **kwargs)
            assert all(torch.equal(g, e) for g, e in zip(block(*args, **kwargs), expected, strict=True))
            assert calls == [1, 1, 1]
            block.img_mlp.net[2] = down
            # a query projection wrapped
            to_q = block.attn.to_q
            block.attn.to_q = torch.nn.Sequential(to_q)
            expected = original(block, *args, **kwargs)
            assert all(torch.equal(g, e) for g, e in zip(block(*args, **kwargs), expected, strict=True))
            assert calls == [1, 1, 1, 1]
            block.attn.to_q = to_q
            # a text projection wrapped, or the text feed-forward choosing torchao's steps: only the text stream
            # leaves the kernels
            add_k_proj = block.attn.add_k_proj
            block.attn.add_k_proj = torch.nn.Sequential(add_k_proj)
            expected = original(block, *args, **kwargs)
            assert all(torch.equal(g, e) for g, e in zip(block(*args, **kwargs), expected, strict=True))
            block.attn.add_k_proj = add_k_proj
            setattr(block.txt_mlp, ff.FP8_FEED_FORWARD_ATTRIBUTE, "torchao")
            expected = original(block, *args, **kwargs)
            assert all(torch.equal(g, e) for g, e in zip(block(*args, **kwargs), expected, strict=True))
            assert calls == [1, 1, 1, 1]
        finally:
            QwenImageTransformerBlock.forward = original
            patches.undo()


def test_blocks_that_do_not_fit_are_left_with_the_reason():
    plain = QwenImageTransformerBlock(WIDTH, HEADS, HEAD_DIM)
    assert "to_q: the projection's weight is not a torchao Float8Tensor" in qwenimage_block.unfit(plain)
    assert "not diffusers' QwenImageTransformerBlock" in qwenimage_block.unfit(torch.nn.Linear(2, 2))
    block = _block()
    assert qwenimage_block.unfit(block) is None
    assert qwenimage_block.unfit(_block(text_fp8=False)) is None  # the text stream runs the class's steps
    setattr(block.img_mlp, ff.FP8_FEED_FORWARD_ATTRIBUTE, "torchao")
    assert "img_mlp chose 'torchao'" in qwenimage_block.unfit(block)
    block = _block()
    block.img_norm2 = torch.nn.LayerNorm(WIDTH, eps=1e-6)
    assert "LayerNorm without weight" in qwenimage_block.unfit(block)
    block = _block()
    assert block_glue.choose(torch.nn.Sequential(block, _block(1)), False) == 2
    assert qwenimage_block.unfit(block) == "chosen off"
    with pytest.raises(TypeError, match="True or False"):
        block_glue.choose(block, "yes")


def test_the_patched_block_is_traced_whole_by_dynamo():
    block = _block()
    patches = _prepared(block)
    args, kwargs = _inputs((TEXT, TEXT - 2))
    try:
        assert qwenimage_block.patch_qwenimage_blocks(block, patches) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():  # as pipelines call it (torch has no derivative for _scaled_mm)
            got, want = compiled(*args, **kwargs), block(*args, **kwargs)
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))
    finally:
        patches.undo()
        torch._dynamo.reset()


def test_the_feature_patches_both_models_blocks_counts_them_and_undoes():
    import types

    import test_zimage_block

    from bcg_diffusion.features.block_glue import FusedBlockGlue

    model = torch.nn.Module()
    model.qwen, model.z = _block(), test_zimage_block._block()
    patches = _prepared(model.qwen)
    patches_z = test_zimage_block._prepared(model.z)
    feature = FusedBlockGlue()
    setup = types.SimpleNamespace(quantized="fp8", modules={"transformer": model})
    feature.prepare(setup, patches)
    try:
        assert feature.stats() == {"fused_blocks": 2}
        assert feature.patch_names() == [ZIMAGE_BLOCK_PATCH, qwenimage_block.QWENIMAGE_BLOCK_PATCH]
        assert "forward" in model.qwen.__dict__ and "forward" in model.z.__dict__
    finally:
        patches.undo()
        patches_z.undo()
    assert "forward" not in model.qwen.__dict__ and "forward" not in model.z.__dict__
    unquantized = FusedBlockGlue()  # quantize= did nothing (a model quantized before accelerate): no patch
    unquantized.prepare(types.SimpleNamespace(quantized=None, modules={"transformer": model}), MethodPatches())
    assert unquantized.stats() == {"fused_blocks": 0}
