"""Fast mode's Wan attention under cuDNN's FP8 kernel: the query and key quantized at their norms' bounds
(``patches/wan_attention.py``).

On a CPU cuDNN's FP8 operator computes its float32 reference on the float8 tensors it is given, so the bytes
follow from the scales: with the bounds, the patched processor must give the bytes of diffusers' processor
whose FP8 dispatch is handed the same bounds; with ``choose_prologue(..., False)``, the bytes of diffusers'
processor under the FP8 dispatch as it is (the largest magnitudes).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_chronoedit
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels import cudnn_fp8_attention
from bcg_diffusion.patches import dispatched_attention, wan_attention
from bcg_diffusion.patches.attention import FP8_PROLOGUE_ATTRIBUTE
from bcg_diffusion.patches.wan_attention import WAN_ATTENTION_PATCH

DIM, HEADS, TOKENS, IMAGE_CONTEXT = 256, 2, 12, 4  # heads of 128, as cuDNN's FP8 attention takes them
BF16 = torch.bfloat16
KINDS = ("self", "cross", "image-to-video")


def _attention(kind: str, processor=None) -> torch.nn.Module:
    """A Wan attention module with random norm weights (away from 1, so that the bounds differ per norm)."""
    torch.manual_seed(0)
    options = {}
    if kind != "self":
        options["cross_attention_dim_head"] = DIM // HEADS
    if kind == "image-to-video":
        options["added_kv_proj_dim"] = DIM
    attn = WanAttention(DIM, HEADS, DIM // HEADS, eps=1e-6, processor=processor or WanAttnProcessor(), **options)
    for module in attn.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.weight.data.normal_(1.0, 0.5)
    return attn.to(BF16).eval()


def _inputs(kind: str) -> dict:
    torch.manual_seed(1)
    hidden = (torch.randn(2, TOKENS, DIM) * 2).to(BF16)
    if kind == "self":
        angles = torch.randn(1, TOKENS, 1, DIM // HEADS // 2).repeat_interleave(2, dim=-1)  # Wan's: pairs alike
        return {"hidden_states": hidden, "rotary_emb": (angles.cos(), angles.sin())}
    context = wan_attention.TEXT_TOKENS + (IMAGE_CONTEXT if kind == "image-to-video" else 0)
    return {"hidden_states": hidden, "encoder_hidden_states": (torch.randn(2, context, DIM) * 2).to(BF16)}


def _holder(attn: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.attn = attn
    return holder


def _bounds(attn: torch.nn.Module, key_norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(cudnn_fp8_attention.rms_norm_bound([n.weight], DIM) for n in (attn.norm_q, key_norm))


def _recording(monkeypatch) -> list[tuple]:
    """Calls of cuDNN's FP8 attention, recorded as the bounds each was given."""
    seen, original = [], cudnn_fp8_attention.attention

    def attention(query, key, value, query_bound=None, key_bound=None, scale=None, key_lengths=None):
        seen.append((query_bound, key_bound))
        return original(query, key, value, query_bound, key_bound, scale=scale, key_lengths=key_lengths)

    monkeypatch.setattr(cudnn_fp8_attention, "attention", attention)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_the_query_and_key_are_quantized_at_their_norms_bounds(kind, monkeypatch):
    """Every attention call of the patched processor hands cuDNN's kernel the bounds of the query's and the
    key's norms (the image context's own key norm in image-to-video), and gives the bytes of diffusers'
    processor whose FP8 dispatch is handed the same bounds; ``choose_prologue(..., False)`` gives diffusers'
    processor's bytes under the FP8 dispatch as it is, each tensor at its largest magnitude."""
    seen = _recording(monkeypatch)
    attn, inputs = _attention(kind), _inputs(kind)
    patches = MethodPatches()
    dispatched_attention.install([attn], lambda module: "cudnn-fp8", patches)
    expected_bounds = [_bounds(attn, attn.norm_k)]
    if kind == "image-to-video":
        expected_bounds.insert(0, _bounds(attn, attn.norm_added_k))
    try:
        with torch.no_grad():
            largest = attn(**inputs)  # diffusers' processor, FP8-scoped
            assert seen == [(None, None)] * len(expected_bounds)
            original = cudnn_fp8_attention.attention
            bounds_iter = iter(expected_bounds)
            monkeypatch.setattr(
                cudnn_fp8_attention,
                "attention",
                lambda q, k, v, qb=None, kb=None, scale=None, key_lengths=None: original(q, k, v, *next(bounds_iter)),
            )
            bounded = attn(**inputs)
            monkeypatch.setattr(cudnn_fp8_attention, "attention", original)
            seen.clear()
            assert WAN_ATTENTION_PATCH.apply(_holder(attn), patches) == 1
            assert type(attn.processor).__call__.__module__ == wan_attention.__name__
            assert torch.equal(attn(**inputs), bounded)
            assert len(seen) == len(expected_bounds)
            for (query_bound, key_bound), (want_query, want_key) in zip(seen, expected_bounds, strict=True):
                assert torch.equal(query_bound, want_query) and torch.equal(key_bound, want_key)
            assert not torch.equal(bounded, largest)  # the scales matter: the test can tell them apart
            setattr(attn, FP8_PROLOGUE_ATTRIBUTE, False)  # what choose_prologue(..., False) before accelerate sets
            seen.clear()
            assert torch.equal(attn(**inputs), largest)
            assert seen == [(None, None)] * len(expected_bounds)
            setattr(attn, FP8_PROLOGUE_ATTRIBUTE, "yes")
            with pytest.raises(ValueError, match="expected True or False"):
                attn(**inputs)
    finally:
        patches.undo()
    assert type(attn.processor) is WanAttnProcessor


@pytest.mark.parametrize(
    "kind, change",
    [("self", "mask"), ("cross", "mask"), ("self", "diffusers norm"), ("image-to-video", "diffusers norm")],
)
def test_what_the_bounds_do_not_cover_keeps_the_fp8_dispatch(kind, change, monkeypatch):
    """A mask, or a query norm that is not ``torch.nn.RMSNorm`` across the heads (here diffusers' own): the
    processor's FP8 dispatch as it is, with the unpatched processor's bytes."""
    from diffusers.models.normalization import RMSNorm

    seen = _recording(monkeypatch)
    attn, call = _attention(kind), _inputs(kind)
    if change == "mask":
        keys = call.get("encoder_hidden_states", call["hidden_states"]).shape[1]
        call["attention_mask"] = torch.ones(2, 1, TOKENS, keys, dtype=torch.bool)
    else:
        attn.norm_q = RMSNorm(DIM, eps=1e-6).to(BF16)
    patches = MethodPatches()
    dispatched_attention.install([attn], lambda module: "cudnn-fp8", patches)
    try:
        with torch.no_grad():
            expected = attn(**call)
            assert WAN_ATTENTION_PATCH.apply(_holder(attn), patches) == 1
            seen.clear()
            assert torch.equal(attn(**call), expected)
    finally:
        patches.undo()
    assert all(bounds == (None, None) for bounds in seen), seen


def test_the_patch_applies_only_to_wans_processor_under_cudnns_fp8_attention():
    """Without FP8 attention on cuDNN's kernel the patch applies to nothing (the bounds would go unused), nor
    to ChronoEdit's processor of the same name, whose code is not the code it follows."""
    patches = MethodPatches()
    assert WAN_ATTENTION_PATCH.apply(_holder(_attention("self")), patches) == 0
    other = _attention("self", processor=transformer_chronoedit.WanAttnProcessor())
    dispatched_attention.install([other], lambda module: "cudnn-fp8", patches)
    try:
        assert WAN_ATTENTION_PATCH.apply(_holder(other), patches) == 0
        wan = _attention("self")
        dispatched_attention.install([wan], lambda module: "fp8", patches)  # our Triton kernel takes no bounds
        assert WAN_ATTENTION_PATCH.apply(_holder(wan), patches) == 0
    finally:
        patches.undo()


def test_the_patched_processor_compiles_without_a_graph_break():
    """As fast mode compiles a block: one graph, the patched processor's bytes."""
    attn, inputs = _attention("self"), _inputs("self")
    patches = MethodPatches()
    dispatched_attention.install([attn], lambda module: "cudnn-fp8", patches)
    assert WAN_ATTENTION_PATCH.apply(_holder(attn), patches) == 1
    try:
        with torch.no_grad():
            expected = attn(**inputs)
            torch._dynamo.reset()
            traced = torch.compile(attn, backend="aot_eager", fullgraph=True)
            assert torch.equal(traced(**inputs), expected)
    finally:
        torch._dynamo.reset()
        patches.undo()


def test_the_wan_patch_names_the_code_it_follows():
    from bcg_diffusion.patches.followed import FOLLOWED, changed

    assert WAN_ATTENTION_PATCH.name in FOLLOWED
    assert changed(WAN_ATTENTION_PATCH.name) == []
