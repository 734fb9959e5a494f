"""Attention's fused prologue (:mod:`bcg_diffusion.kernels.qk_prologue`) on a CPU.

* The Triton kernel in Triton's interpreter (a process of its own, ``_qk_prologue_interpret.py``) against
  the plain-PyTorch reference: fp16 and fp32, strided inputs, groups of rows with different text lengths,
  sizes that do not fill the tiles.
* The reference against diffusers' own computation (its ``RMSNorm`` modules, its complex RoPE, the
  concatenation text first): equal to the bit where the rotation's products are exact, within float32
  rounding elsewhere; and equal to the bit to fast mode's compiled path (same operations).
* The operators' registrations (``torch.library.opcheck``), a compiled call without a graph break.
* Fast mode's processors with the switch (``QK_PROLOGUE_ATTRIBUTE``) on against off, on the CPU where the
  operators compute the reference; with cuDNN's FP8 attention, the prologue's float8 query and key
  (``joint_qkv_fp8``, ``norm_rope_fp8``) against the bf16 prologue quantized before attention.

The kernel on a GPU, at full size: ``test_attention_kernels_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from _cases import CFG_CASE, run_case, tiny_pipeline, zimage_block_call
from _checks import assert_graphs_ran, needs_compiler, needs_triton, run_interpreted

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.kernels import qk_prologue
from bcg_diffusion.patches import attention
from bcg_diffusion.patches.attention import QK_PROLOGUE_ATTRIBUTE, qwen_joint_attention_per_group

HEAD_DIM, HEADS = 16, 4


def _qwen_attention(
    dtype: torch.dtype = torch.float32, seed: int = 0, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> torch.nn.Module:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(seed)
    attn = QwenImageTransformerBlock(heads * head_dim, heads, head_dim).attn
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        norm.weight.data.normal_(1.0, 0.5)  # not ones: the weight's rounding is part of the contract
    return attn.to(dtype).eval()


def _exact_freqs(tokens: int) -> torch.Tensor:
    """Complex frequencies whose cosines and sines are 0 or ±1: every product of the rotation is exact,
    so complex and real arithmetic round alike."""
    quarter = torch.randint(0, 4, (tokens, HEAD_DIM // 2), generator=torch.Generator().manual_seed(tokens))
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    return torch.view_as_complex(table[quarter].contiguous())


def _random_freqs(*shape: int) -> torch.Tensor:
    angles = torch.rand(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 6.28
    return torch.polar(torch.ones_like(angles), angles)


def _qwen_inputs(attn, lengths, rows, image_tokens=10, exact=True, dtype=torch.float32):
    generator = torch.Generator().manual_seed(len(lengths) * 10 + rows)
    batch, text_tokens, width = rows * len(lengths), max(lengths) + 1, attn.inner_dim
    hidden = torch.randn(batch, image_tokens, width, generator=generator).to(dtype)
    text = torch.randn(batch, text_tokens, width, generator=generator).to(dtype)
    head_dim = width // attn.heads
    make = _exact_freqs if exact else (lambda n: _random_freqs(n, head_dim // 2))
    return hidden, text, (make(image_tokens), make(text_tokens))


@needs_triton
def test_kernel_matches_the_reference_in_tritons_interpreter():
    run_interpreted("_qk_prologue_interpret.py")


def _diffusers_joint(attn, hidden, text, rope, lengths, rows):
    """Diffusers' processor up to attention's inputs, per group of rows (its modules, its complex RoPE)."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    head_dim = attn.inner_dim // attn.heads
    streams = {}
    for name, x, linears, norms, freqs in (
        ("image", hidden, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k), rope[0]),
        ("text", text, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), (attn.norm_added_q, attn.norm_added_k), rope[1]),
    ):  # fmt: skip
        q, k, v = (linear(x).unflatten(-1, (-1, head_dim)) for linear in linears)
        q, k = (apply_rotary_emb_qwen(norm(t), freqs, use_real=False) for norm, t in zip(norms, (q, k)))
        streams[name] = (q, k, v)
    joints = []
    for g, length in enumerate(lengths):
        rows_ = slice(g * rows, (g + 1) * rows)
        joints.append([torch.cat([t[rows_, :length], i[rows_]], 1) for t, i in zip(streams["text"], streams["image"])])
    return joints


def _reference_groups(attn, hidden, text, rope, lengths):
    image, text_ = attention.qwen_joint_projections(attn, hidden, text, normed=False)
    norms = [n.weight for n in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)]
    eps = [n.eps for n in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)]
    freqs = tuple(torch.view_as_real(f) for f in rope)
    joints = qk_prologue.reference_joint_qkv(image, text_, norms, eps, freqs, lengths)
    per_tensor = [qk_prologue.group_slices(j, lengths, text.shape[1]) for j in joints]
    return [list(group) for group in zip(*per_tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "rows"), [((6, 3), 1), ((2, 5), 2), ((4,), 1)])
def test_reference_is_diffusers_computation(dtype, lengths, rows):
    attn = _qwen_attention(dtype)
    with torch.no_grad():
        for exact in (True, False):
            hidden, text, rope = _qwen_inputs(attn, lengths, rows, exact=exact, dtype=dtype)
            expected = _diffusers_joint(attn, hidden, text, rope, lengths, rows)
            got = _reference_groups(attn, hidden, text, rope, lengths)
            for g_got, g_expected in zip(got, expected):
                for name, a, b in zip("qkv", g_got, g_expected):
                    assert a.shape == b.shape and a.dtype == b.dtype, name
                    if exact or name == "v":
                        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
                    else:  # complex against real arithmetic: float32 rounding, one step of bf16
                        tolerance = {torch.float32: 2e-6, torch.bfloat16: 2**-7}[dtype]
                        torch.testing.assert_close(a.float(), b.float(), atol=4 * tolerance, rtol=tolerance)
            # Fast mode's compiled path computes the same operations: equal to the bit.
            image, text_ = attention.qwen_joint_projections(attn, hidden, text)
            freqs = tuple(torch.view_as_real(f) for f in rope)
            for g, length in enumerate(lengths):
                compiled = attention._compiled_joint(image, text_, freqs, g * rows, (g + 1) * rows, length)
                assert all(torch.equal(a, b) for a, b in zip(got[g], compiled))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_zimage_computation(dtype):
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    norms = [RMSNorm(HEAD_DIM, eps=1e-5).to(dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data.normal_(1.0, 0.5)
    query, key = (torch.randn(2, 9, HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    for exact in (True, False):
        freqs = torch.stack([_exact_freqs(9) if exact else _random_freqs(9, HEAD_DIM // 2) for _ in range(2)])
        with torch.no_grad():
            expected = [attention._complex_rotation(norm(x), freqs) for norm, x in zip(norms, (query, key))]
            got = qk_prologue.reference_norm_rope(
                query, key, [n.weight for n in norms], [n.eps for n in norms], torch.view_as_real(freqs)
            )
        for a, b in zip(got, expected):
            if exact:
                assert torch.equal(a, b)
            else:
                tolerance = {torch.float32: 2e-6, torch.bfloat16: 2**-7}[dtype]
                torch.testing.assert_close(a.float(), b.float(), atol=4 * tolerance, rtol=tolerance)


def test_operators_are_registered_for_compilation():
    torch.manual_seed(0)
    image = [torch.randn(2, 13, 3, 16) for _ in range(3)]
    text = [torch.randn(2, 7, 3, 16) for _ in range(3)]
    weights = [torch.randn(16) for _ in range(4)]
    freqs = (torch.view_as_real(_random_freqs(13, 8)), torch.view_as_real(_random_freqs(7, 8)))
    torch.library.opcheck(torch.ops.bcg_diffusion.joint_qkv, (*image, *text, weights, [1e-6] * 4, *freqs, [7, 4]))
    torch.library.opcheck(torch.ops.bcg_diffusion.norm_rope, (image[0], image[1], weights[:2], [1e-5] * 2, freqs[0]))

    def joint(*tensors):
        joints = qk_prologue.joint_qkv(tensors[:3], tensors[3:6], tensors[6:10], [1e-6] * 4, tensors[10:], (7, 4))
        return [s * 2 for j in joints for s in qk_prologue.group_slices(j, (7, 4), 7)]

    compiled = torch.compile(joint, backend="aot_eager", fullgraph=True)  # no graph break
    for a, b in zip(compiled(*image, *text, *weights, *freqs), joint(*image, *text, *weights, *freqs)):
        assert torch.equal(a, b)

    descales = [torch.tensor(0.02), torch.tensor(0.03)]
    arguments = (*image, *text, weights, [1e-6] * 4, *freqs, [7, 4], *descales)
    torch.library.opcheck(torch.ops.bcg_diffusion.joint_qkv_fp8, arguments)

    def joint_fp8(*tensors):
        joint = qk_prologue.joint_qkv_fp8(
            tensors[:3], tensors[3:6], tensors[6:10], [1e-6] * 4, tensors[10:12], (7, 4), *tensors[12:]
        )
        return [joint.query.float() * joint.query_descale, joint.value * 2, joint.value_largest]

    inputs = (*image, *text, *weights, *freqs, *descales)
    compiled = torch.compile(joint_fp8, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(*inputs), joint_fp8(*inputs)):
        assert torch.equal(a, b)
    arguments = (image[0], image[1], image[2], weights[:2], [1e-5] * 2, freqs[0], *descales)
    torch.library.opcheck(torch.ops.bcg_diffusion.norm_rope_fp8, arguments)


def test_unsupported_calls_are_named():
    q = torch.randn(2, 5, 3, 16)
    weights = [torch.randn(16)] * 4
    assert qk_prologue.unsupported_joint([q] * 3, [q] * 3, weights, (None, None), (5, 5)) is None
    assert "groups" in qk_prologue.unsupported_joint([q] * 3, [q] * 3, weights, (None, None), (5,) * 5)
    assert "power of two" in qk_prologue.unsupported_norm_rope(q[..., :12], q[..., :12], [None, None], None)
    assert "missing" in qk_prologue.unsupported_norm_rope(q, q, [weights[0], None], None)
    assert "contiguous" in qk_prologue.unsupported_norm_rope(q.transpose(2, 3)[..., :3, :], q, [None] * 2, None)
    assert "float32" in qk_prologue.unsupported_norm_rope(q, q, [None] * 2, torch.zeros(5, 8, 2, dtype=torch.float64))
    assert qk_prologue.unavailable(torch.device("cpu")) == "the model is on cpu, not a CUDA GPU"
    with pytest.raises(ValueError, match="cannot take these tensors"):
        qk_prologue.norm_rope(q, q[:, :4], [None, None], [0.0, 0.0], None)
    scalar = torch.tensor(0.1)
    assert qk_prologue.unsupported_joint_fp8([q] * 3, [q] * 3, weights, (None, None), (5,), (scalar, scalar)) is None
    for descales in ((scalar, scalar.double()), (scalar, torch.ones(2))):
        reason = qk_prologue.unsupported_joint_fp8([q] * 3, [q] * 3, weights, (None, None), (5,), descales)
        assert "descales are not one float32 number each" in reason
    assert "groups" in qk_prologue.unsupported_joint_fp8(
        [q] * 3, [q] * 3, weights, (None, None), (5,) * 5, [scalar] * 2
    )
    with pytest.raises(ValueError, match="cannot take these tensors: the query's and key's descales"):
        qk_prologue.joint_qkv_fp8([q] * 3, [q] * 3, weights, [0.0] * 4, (None, None), (5,), scalar, scalar.half())
    assert qk_prologue.unsupported_norm_rope_fp8(q, q, q, [None] * 2, None, (scalar, scalar)) is None
    assert "descales" in qk_prologue.unsupported_norm_rope_fp8(q, q, q, [None] * 2, None, (scalar, torch.ones(3)))
    assert "value's shape" in qk_prologue.unsupported_norm_rope_fp8(q, q, q[:, :4], [None] * 2, None, (scalar,) * 2)
    assert "dtype" in qk_prologue.unsupported_norm_rope_fp8(q, q, q.double(), [None] * 2, None, (scalar,) * 2)
    with pytest.raises(ValueError, match="cannot take these tensors: query and key differ in tokens"):
        qk_prologue.norm_rope_fp8(q, q[:, :4], q, [None, None], [0.0, 0.0], None, scalar, scalar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2), ((5,), 1), ((2, 3, 4, 5, 6), 1)])
def test_qwen_processor_with_the_switch_on_equals_it_off(dtype, lengths, rows, monkeypatch):
    """On a CPU the operator computes the reference: the attention inputs are the compiled path's to the
    bit, so the processor's outputs are equal; five groups are beyond the kernel and stay compiled."""
    calls = []
    original = qk_prologue.joint_qkv
    monkeypatch.setattr(qk_prologue, "joint_qkv", lambda *a: calls.append(1) or original(*a))
    attn = _qwen_attention(dtype)
    hidden, text, rope = _qwen_inputs(attn, lengths, rows, exact=False, dtype=dtype)
    outputs = {}
    with torch.no_grad():
        for switch in ("compiled", "fused"):
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, switch)
            outputs[switch] = qwen_joint_attention_per_group(attn.processor, attn, hidden, text, rope, lengths)
    assert len(calls) == (len(lengths) <= qk_prologue.MAX_GROUPS)
    for a, b in zip(outputs["fused"], outputs["compiled"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2), ((5,), 1)])
def test_qwen_processor_quantizes_for_cudnn_fp8_attention_in_the_prologue(lengths, rows, monkeypatch):
    """With cuDNN's FP8 attention and the fused prologue, the query and key come out of the prologue in
    float8 and the value's largest magnitude with them (``joint_qkv_fp8``): on a CPU, where the operators
    compute their references, the same bytes as quantizing the compiled path's bf16 tensors."""
    from bcg_diffusion.kernels import cudnn_fp8_attention

    calls = {"bf16": 0, "fp8": 0, "quantized": 0}
    for name, key in (("joint_qkv", "bf16"), ("joint_qkv_fp8", "fp8")):
        original = getattr(qk_prologue, name)
        monkeypatch.setattr(
            qk_prologue, name, lambda *a, o=original, k=key: calls.__setitem__(k, calls[k] + 1) or o(*a)
        )
    original = cudnn_fp8_attention.attention_fp8_output  # what attention_quantized calls too
    monkeypatch.setattr(
        cudnn_fp8_attention,
        "attention_fp8_output",
        lambda *a, **kw: calls.__setitem__("quantized", calls["quantized"] + 1) or original(*a, **kw),
    )
    attn = _qwen_attention(torch.bfloat16, heads=2, head_dim=128)  # cuDNN's FP8 kernel takes heads of 128
    setattr(attn, attention.KERNEL_ATTRIBUTE, "cudnn-fp8")
    hidden, text, rope = _qwen_inputs(attn, lengths, rows, exact=False, dtype=torch.bfloat16)
    outputs = {}
    with torch.no_grad():
        for switch in ("compiled", "fused"):
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, switch)
            outputs[switch] = qwen_joint_attention_per_group(attn.processor, attn, hidden, text, rope, lengths)
    # compiled: attend quantizes the bf16 tensors (through attention_quantized); fused: the prologue does,
    # and the processor scales the float8 output back itself (the output projection is bf16 here)
    assert calls == {"bf16": 0, "fp8": 1, "quantized": 2 * len(lengths)}, calls
    for a, b in zip(outputs["fused"], outputs["compiled"]):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # Traced whole (no graph break), as fast mode compiles it.
    torch._dynamo.reset()
    traced = torch.compile(qwen_joint_attention_per_group, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for a, b in zip(traced(attn.processor, attn, hidden, text, rope, lengths), outputs["fused"]):
            assert torch.equal(a, b)
    torch._dynamo.reset()
    # choose_prologue(..., False): the bf16 prologue, quantized by attend; the same bytes here.
    from bcg_diffusion.features.fp8_attention import choose_prologue

    holder = torch.nn.Module()
    holder.attn = attn
    assert choose_prologue(holder, False) == 1
    before = dict(calls)
    with torch.no_grad():
        switched_off = qwen_joint_attention_per_group(attn.processor, attn, hidden, text, rope, lengths)
    assert {k: calls[k] - before[k] for k in calls} == {"bf16": 1, "fp8": 0, "quantized": len(lengths)}, calls
    assert all(torch.equal(a, b) for a, b in zip(switched_off, outputs["fused"]))
    with pytest.raises(TypeError, match="True or False"):
        choose_prologue(holder, "no")
    for wrong in ("no", 1):  # 1 == True, yet not a bool
        setattr(attn, attention.FP8_PROLOGUE_ATTRIBUTE, wrong)
        with pytest.raises(ValueError, match=f"_bcg_fp8_prologue is {wrong!r}; expected True or False"):
            qwen_joint_attention_per_group(attn.processor, attn, hidden, text, rope, lengths)
    choose_prologue(holder, True)
    # Without norms there is no bound: the bf16 prologue runs, and attend quantizes by the largest values.
    attn.norm_q = attn.norm_k = attn.norm_added_q = attn.norm_added_k = None
    before = dict(calls)
    with torch.no_grad():
        qwen_joint_attention_per_group(attn.processor, attn, hidden, text, rope, lengths)
    assert {k: calls[k] - before[k] for k in calls} == {"bf16": 1, "fp8": 0, "quantized": len(lengths)}, calls


@pytest.mark.parametrize("mask", [False, True])
def test_zimage_processor_quantizes_for_cudnn_fp8_attention_in_the_prologue(mask, monkeypatch):
    """Z-Image with cuDNN's FP8 attention and the fused prologue: unmasked, the query and key come out of
    the prologue in float8 (``norm_rope_fp8``); on a CPU, where the operators compute their references, the
    block's bytes are those of the bf16 prologue quantized before attention. Masked: the bf16 prologue and
    diffusers' dispatch, as without FP8 attention."""
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    from bcg_diffusion.core.hooks import MethodPatches

    calls = []
    original_fp8 = qk_prologue.norm_rope_fp8
    monkeypatch.setattr(qk_prologue, "norm_rope_fp8", lambda *a: calls.append(1) or original_fp8(*a))
    torch.manual_seed(0)
    block = ZImageTransformerBlock(0, 256, 2, 2, 1e-5, qk_norm=True, modulation=True).to(torch.bfloat16).eval()
    block.attention.norm_q.weight.data.normal_(1.0, 0.5)  # two bounds, each its own
    patches = MethodPatches()
    assert attention.ZIMAGE_ROPE_PATCH.apply(block, patches) == 1
    setattr(block.attention, attention.KERNEL_ATTRIBUTE, "cudnn-fp8")
    setattr(block.attention, QK_PROLOGUE_ATTRIBUTE, "fused")

    def call() -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            return zimage_block_call(block, generator, mask, torch.bfloat16)

    try:
        quantized_in_prologue = call()
        assert len(calls) == (0 if mask else 1)
        torch._dynamo.reset()
        traced = torch.compile(block, backend="aot_eager", fullgraph=True)  # no graph break, as fast mode compiles
        with torch.no_grad():
            traced_output = zimage_block_call(traced, torch.Generator().manual_seed(1), mask, torch.bfloat16)
        torch._dynamo.reset()
        original = attention._fused_norm_rope
        monkeypatch.setattr(  # the bf16 prologue, quantized by attend
            attention,
            "_fused_norm_rope",
            lambda a, q, k, f, fp8_value=None: None if fp8_value is not None else original(a, q, k, f),
        )
        quantized_after = call()
    finally:
        patches.undo()
    assert quantized_in_prologue.dtype == torch.bfloat16 and torch.equal(quantized_in_prologue, quantized_after)
    assert torch.equal(traced_output, quantized_in_prologue)


@pytest.mark.parametrize("mask", [False, True])
def test_zimage_processor_with_the_switch_on_is_near_it_off(mask, monkeypatch):
    """Z-Image's compiled path rotates in complex arithmetic, the prologue in real arithmetic: float32
    rounding apart, the same block output (float32 tiny model, relative error under 1e-5)."""
    from bcg_diffusion.core.hooks import MethodPatches

    calls = []
    original = qk_prologue.norm_rope
    monkeypatch.setattr(qk_prologue, "norm_rope", lambda *a: calls.append(1) or original(*a))

    transformer = tiny_pipeline("z-image").transformer
    block = transformer.layers[0]
    patches = MethodPatches()
    assert attention.ZIMAGE_ROPE_PATCH.apply(transformer, patches) > 0
    outputs = {}
    try:
        with torch.no_grad():
            for switch in ("compiled", "fused"):
                setattr(block.attention, QK_PROLOGUE_ATTRIBUTE, switch)
                outputs[switch] = zimage_block_call(block, torch.Generator().manual_seed(0), mask)
    finally:
        patches.undo()
        delattr(block.attention, QK_PROLOGUE_ATTRIBUTE)
    assert len(calls) == 1  # the switch on, the operator once
    error = (outputs["fused"] - outputs["compiled"]).norm() / outputs["compiled"].norm()
    assert error < 1e-5, error


@pytest.mark.heavy  # compiles with inductor on CPU
@needs_compiler
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_fast_mode_with_the_switch_on_compiles_the_operator(name, monkeypatch):
    """Fast mode with ``QK_PROLOGUE_DEFAULT = "fused"``: the compiled blocks call the operator (on a CPU
    its reference) without a graph break, the graphs give the compiled blocks' bytes, the image stays
    near diffusers', and Qwen-Image's other prompt lengths reuse the compiled blocks."""
    calls = []
    for function in ("reference_joint_qkv", "reference_norm_rope"):
        original = getattr(qk_prologue, function)
        monkeypatch.setattr(
            qk_prologue, function, lambda *a, original=original, **k: calls.append(1) or original(*a, **k)
        )
    monkeypatch.setattr(attention, "QK_PROLOGUE_DEFAULT", "fused")
    pipe = tiny_pipeline(name)
    case = CFG_CASE[name]
    expected = run_case(pipe, name, case, height=64, width=64)
    assert not calls  # diffusers' own processors
    accelerate(pipe, mode="fast", debug=True)
    try:
        first = run_case(pipe, name, case, height=64, width=64)
        assert calls, "the compiled blocks did not call the fused prologue"
        with eager(pipe):
            reference = run_case(pipe, name, case, height=64, width=64)
        report = stats(pipe)
        assert report["compile_failure"] is None and report["eager_fallbacks"] == 0, report
        assert torch.equal(first, reference)
        torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
        if name == "qwen-image":
            compiles = report["compiles"]
            pipe(prompt="a much longer prompt about a fox in the snow at dawn", negative_prompt="ugly",
                 true_cfg_scale=4.0, height=64, width=64, num_inference_steps=3)  # fmt: skip
            assert_graphs_ran(pipe, captures=True)
            assert stats(pipe)["compiles"] == compiles
    finally:
        restore(pipe)


@pytest.mark.parametrize(
    ("attribute", "call"),
    [
        (attention.QK_PROLOGUE_ATTRIBUTE, lambda m, x: attention._fused_prologue(m, x)),
        (attention.KERNEL_ATTRIBUTE, lambda m, x: attention.attend(m, x, x, x, lambda q, k, v: q)),
    ],
)
def test_an_unknown_kernel_or_prologue_name_is_a_clear_error(attribute, call):
    module = torch.nn.Linear(2, 2)
    x = torch.zeros(1, 4, 2, 8)
    setattr(module, attribute, "fast")
    with pytest.raises(ValueError, match=f"Linear.{attribute} is 'fast'; expected one of"):
        call(module, x)
    setattr(module, attribute, "fused" if attribute == attention.QK_PROLOGUE_ATTRIBUTE else "dispatch")
    call(module, x)  # a valid name is accepted
