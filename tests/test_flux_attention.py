"""Fast mode's FLUX attention processors: the query and key norms, RoPE and the joint text-and-image tensors
in one launch of the attention prologue's kernel (``patches/flux_attention.py``).

On a CPU the kernel's operators compute their PyTorch reference, which follows ``torch.nn.RMSNorm`` and
diffusers' ``apply_rotary_emb`` operation for operation: with the prologue forced on, each patched processor
must give the unpatched one's bytes. The kernel itself is held to that reference in Triton's interpreter
(``_qk_prologue_interpret.py``) and compiled for sm_90 (``test_kernels_sm90.py``).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.kernels import qk_prologue
from bcg_diffusion.patches import dispatched_attention, flux_attention
from bcg_diffusion.patches.attention import FP8_PROLOGUE_ATTRIBUTE, QK_PROLOGUE_ATTRIBUTE
from bcg_diffusion.pipelines.base import PipelineAdapter

DIM, HEADS, IMAGE, TEXT = 256, 2, 12, 5  # heads of 128, as cuDNN's FP8 attention takes them
BF16 = torch.bfloat16


def _attention(kind: str) -> torch.nn.Module:
    """A FLUX attention module with random norms (weights away from 1, so that they matter)."""
    torch.manual_seed(0)
    head_dim = DIM // HEADS
    if kind == "flux double":
        attn = FluxAttention(
            DIM, HEADS, head_dim, bias=True, added_kv_proj_dim=DIM, eps=1e-6, processor=FluxAttnProcessor()
        )
    elif kind == "flux single":
        attn = FluxAttention(DIM, HEADS, head_dim, bias=True, eps=1e-6, pre_only=True, processor=FluxAttnProcessor())
    elif kind == "flux2 double":
        attn = Flux2Attention(DIM, HEADS, head_dim, added_kv_proj_dim=DIM, eps=1e-6, processor=Flux2AttnProcessor())
    else:
        attn = Flux2ParallelSelfAttention(DIM, HEADS, head_dim, eps=1e-6, processor=Flux2ParallelSelfAttnProcessor())
    for module in attn.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.weight.data.normal_(1.0, 0.5)
    return attn.to(BF16).eval()


KINDS = ("flux double", "flux single", "flux2 double", "flux2 single")


def _inputs(kind: str) -> dict:
    torch.manual_seed(1)
    image = (torch.randn(2, IMAGE, DIM) * 2).to(BF16)
    angles = torch.randn(TEXT + IMAGE, DIM // HEADS // 2).repeat_interleave(2, dim=1)  # FLUX's: pairs alike
    rotary = (angles.cos(), angles.sin())
    if kind.endswith("double"):
        text = (torch.randn(2, TEXT, DIM) * 2).to(BF16)
        return {"hidden_states": image, "encoder_hidden_states": text, "image_rotary_emb": rotary}
    joint = (torch.randn(2, TEXT + IMAGE, DIM) * 2).to(BF16)  # a single-stream block sees text and image joined
    return {"hidden_states": joint, "image_rotary_emb": rotary}


def _patch(attn: torch.nn.Module, patches: MethodPatches) -> int:
    holder = torch.nn.Module()
    holder.attn = attn
    return sum(patch.apply(holder, patches) for patch in PipelineAdapter.fast_patches)


def _counting(monkeypatch, names: tuple[str, ...]) -> list[str]:
    """Calls of ``qk_prologue``'s functions ``names``, recorded by name."""
    calls: list[str] = []
    for name in names:
        original = getattr(qk_prologue, name)
        monkeypatch.setattr(qk_prologue, name, lambda *a, o=original, n=name, **k: calls.append(n) or o(*a, **k))
    return calls


def _equal(got, want) -> bool:
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_references_are_torchs_rms_norm_and_diffusers_rotation():
    """``norm="torch"`` with ``(cos, sin)`` frequencies: ``torch.nn.RMSNorm``, then diffusers'
    ``apply_rotary_emb(..., sequence_dim=1)``, to the byte; the joint form also joins text before image."""
    attn = _attention("flux double")
    torch.manual_seed(2)
    image = [torch.randn(2, IMAGE, HEADS, DIM // HEADS).to(BF16) * 3 for _ in range(3)]
    text = [torch.randn(2, TEXT, HEADS, DIM // HEADS).to(BF16) * 3 for _ in range(3)]
    cos, sin = _inputs("flux double")["image_rotary_emb"]
    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    weights, eps = [n.weight for n in norms], [n.eps for n in norms]
    with torch.no_grad():
        query, key = qk_prologue.reference_norm_rope(
            image[0], image[1], weights[:2], eps[:2], (cos[:IMAGE], sin[:IMAGE]), norm="torch"
        )
        assert torch.equal(query, apply_rotary_emb(attn.norm_q(image[0]), (cos[:IMAGE], sin[:IMAGE]), sequence_dim=1))
        assert torch.equal(key, apply_rotary_emb(attn.norm_k(image[1]), (cos[:IMAGE], sin[:IMAGE]), sequence_dim=1))
        freqs = ((cos[TEXT:], sin[TEXT:]), (cos[:TEXT], sin[:TEXT]))
        joint = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, (TEXT,), norm="torch")
        query = torch.cat([attn.norm_added_q(text[0]), attn.norm_q(image[0])], dim=1)
        key = torch.cat([attn.norm_added_k(text[1]), attn.norm_k(image[1])], dim=1)
        assert torch.equal(joint[0], apply_rotary_emb(query, (cos, sin), sequence_dim=1))
        assert torch.equal(joint[1], apply_rotary_emb(key, (cos, sin), sequence_dim=1))
        assert torch.equal(joint[2], torch.cat([text[2], image[2]], dim=1))


@pytest.mark.parametrize("kind", KINDS)
def test_the_patched_processor_gives_diffusers_bytes_with_the_prologue_on_or_off(kind, monkeypatch):
    """Forced on (``"fused"``: on a CPU, the operator's reference) the operator runs once a call; off, and by
    default on a CPU, diffusers' own steps: the unpatched processor's bytes each way. ``restore`` gives
    diffusers' processor back."""
    calls = _counting(monkeypatch, ("norm_rope", "joint_qkv"))
    attn = _attention(kind)
    inputs = _inputs(kind)
    original = attn.processor
    with torch.no_grad():
        expected = attn(**inputs)
        patches = MethodPatches()
        assert _patch(attn, patches) == 1
        assert type(attn.processor) is not type(original) and type(attn.processor).__name__ == type(original).__name__
        try:
            for switch, launches in (("fused", 1), ("compiled", 0), (None, 0)):
                if switch is None:
                    delattr(attn, QK_PROLOGUE_ATTRIBUTE)  # "auto": the kernel on CUDA only
                else:
                    setattr(attn, QK_PROLOGUE_ATTRIBUTE, switch)
                calls.clear()
                assert _equal(attn(**inputs), expected), switch
                assert len(calls) == launches, (switch, calls)
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
            torch._dynamo.reset()
            traced = torch.compile(attn, backend="aot_eager", fullgraph=True)  # no graph break, as fast mode compiles
            assert _equal(traced(**inputs), expected)
        finally:
            torch._dynamo.reset()
            patches.undo()
    assert attn.processor is original


@pytest.mark.parametrize("kind", ["flux double", "flux single"])
def test_fused_projections_feed_the_prologue_their_views(kind, monkeypatch):
    """``fuse_projections()`` (one product for query, key and value): the prologue reads the three views of
    its output as they are, with diffusers' bytes."""
    calls = _counting(monkeypatch, ("norm_rope", "joint_qkv"))
    attn = _attention(kind)
    attn.fuse_projections()
    inputs = _inputs(kind)
    patches = MethodPatches()
    with torch.no_grad():
        expected = attn(**inputs)
        assert _patch(attn, patches) == 1
        setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
        try:
            assert _equal(attn(**inputs), expected)
        finally:
            patches.undo()
    assert len(calls) == 1, calls


@pytest.mark.parametrize("kind", ["flux double", "flux single"])
def test_what_the_kernel_does_not_take_runs_diffusers_steps(kind, monkeypatch):
    """No RoPE, a norm that is not ``torch.nn.RMSNorm`` (here diffusers' own), frequencies not a ``(cos, sin)``
    pair: diffusers' steps, the unpatched bytes, no launch."""
    from diffusers.models.normalization import RMSNorm

    calls = _counting(monkeypatch, ("norm_rope", "joint_qkv"))
    inputs = _inputs(kind)
    patches = MethodPatches()
    with torch.no_grad():
        for change in ("no rope", "diffusers norm"):
            attn = _attention(kind)
            if change == "no rope":
                inputs = {**inputs, "image_rotary_emb": None}
            else:
                attn.norm_q = RMSNorm(DIM // HEADS, eps=1e-6).to(BF16)
            expected = attn(**inputs)
            assert _patch(attn, patches) == 1
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
            got = attn(**inputs)
            patches.undo()
            assert _equal(got, expected), change
            assert len(calls) == (1 if change == "no rope" else 0), (change, calls)  # no RoPE: the norms alone
            calls.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_under_cudnn_fp8_attention_the_prologue_writes_the_float8_query_and_key(kind, monkeypatch):
    """With FP8 attention's cuDNN kernel on the processor's class (as ``attention="fp8"`` installs it,
    before fast mode's patch), the prologue writes the query and key in float8 at their norms' bounds and
    reduces the value's largest magnitude: on a CPU, where the operators compute their references, the same
    bytes as the bf16 prologue whose output the FP8 dispatch quantizes. ``choose_prologue(..., False)`` keeps
    the bf16 prologue."""
    from bcg_diffusion.kernels import cudnn_fp8_attention

    calls = _counting(monkeypatch, ("norm_rope", "joint_qkv", "norm_rope_fp8", "joint_qkv_fp8"))
    bounds = []
    original_attention = cudnn_fp8_attention.attention
    monkeypatch.setattr(  # the FP8 dispatch's kernel, given the bounds the prologue uses (else: the largest values)
        cudnn_fp8_attention,
        "attention",
        lambda q, k, v, qb=None, kb=None, scale=None, key_lengths=None: original_attention(
            q, k, v, *bounds, scale=scale, key_lengths=key_lengths
        ),
    )
    attn = _attention(kind)
    inputs = _inputs(kind)
    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if kind.endswith("double") else [])
    bounds += [cudnn_fp8_attention.rms_norm_bound([n.weight for n in norms[i::2]], DIM // HEADS) for i in (0, 1)]
    patches = MethodPatches()
    dispatched_attention.install([attn], lambda module: "cudnn-fp8", patches)
    assert _patch(attn, patches) == 1
    setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
    fp8_name, bf16_name = ("norm_rope_fp8", "norm_rope") if kind.endswith("single") else ("joint_qkv_fp8", "joint_qkv")
    try:
        with torch.no_grad():
            in_prologue = attn(**inputs)
            assert calls == [fp8_name], calls
            setattr(attn, FP8_PROLOGUE_ATTRIBUTE, False)  # what choose_prologue(..., False) before accelerate sets
            calls.clear()
            quantized_after = attn(**inputs)
            assert calls == [bf16_name], calls
            assert _equal(in_prologue, quantized_after)
            setattr(attn, FP8_PROLOGUE_ATTRIBUTE, "yes")
            with pytest.raises(ValueError, match="expected True or False"):
                attn(**inputs)
    finally:
        patches.undo()


def test_every_flux_patch_names_the_code_it_follows():
    """Each FLUX processor patch is digest-checked against the diffusers code it re-implements."""
    from bcg_diffusion.patches.followed import FOLLOWED, changed

    for patch in flux_attention.FLUX_ATTENTION_PATCHES:
        assert patch.name in FOLLOWED, patch.name
        assert changed(patch.name) == [], patch.name


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
@pytest.mark.parametrize("name", ["FLUX.1", "FLUX.2 klein"])
def test_fast_mode_compiles_the_prologue_into_flux_blocks(name, monkeypatch):
    """Fast mode with the prologue forced on: every FLUX processor is patched, the compiled blocks call the
    operator (its reference on a CPU) without a graph break, the graphs give the compiled blocks' bytes, and
    the image stays diffusers' (the reference is diffusers' arithmetic)."""
    from bcg_diffusion import accelerate, eager, restore, stats
    from bcg_diffusion.patches import attention
    from bench.coverage import _call
    from bench.coverage_models import TINY

    calls = _counting(monkeypatch, ("reference_norm_rope", "reference_joint_qkv"))
    monkeypatch.setattr(attention, "QK_PROLOGUE_DEFAULT", "fused")
    pipe, inputs = TINY[name]()
    with torch.no_grad():
        expected = _call(pipe, inputs)
    processors = [
        m for m in pipe.transformer.modules() if type(m.__dict__.get("processor")).__name__.startswith("Flux")
    ]
    accelerate(pipe, mode="fast", debug=True)
    try:
        report = stats(pipe)
        names = {patch.name for patch in flux_attention.FLUX_ATTENTION_PATCHES}
        assert names & set(report["patches"]), report["patches"]
        assert all(type(m.processor).__call__.__module__ == flux_attention.__name__ for m in processors)
        fast = _call(pipe, inputs)
        assert calls, "the compiled blocks did not call the fused prologue"
        with eager(pipe):
            reference = _call(pipe, inputs)
        after = stats(pipe)
        assert after["compile_failure"] is None and after["eager_fallbacks"] == 0, after
        assert torch.equal(fast, reference)
        torch.testing.assert_close(fast, expected, atol=2e-2, rtol=0)
    finally:
        restore(pipe)


def test_choose_qk_prologue_sets_every_attention_module_and_refuses_an_unknown_choice():
    from bcg_diffusion.patches.attention import choose_qk_prologue

    holder = torch.nn.Module()
    holder.a, holder.b = _attention("flux double"), _attention("flux2 single")
    assert choose_qk_prologue(holder, "compiled") == 2
    assert getattr(holder.a, QK_PROLOGUE_ATTRIBUTE) == getattr(holder.b, QK_PROLOGUE_ATTRIBUTE) == "compiled"
    with pytest.raises(ValueError, match="expected one of"):
        choose_qk_prologue(holder, "triton")
