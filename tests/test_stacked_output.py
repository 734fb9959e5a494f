"""Qwen-Image's image output projection per CFG group, written into one output (``kernels/stacked_linear.py``,
``patches/stacked_output.py``), on a CPU: the operator's bytes are those of ``F.linear`` on each part, the
processor takes it only where it computes the module's own call, and a compiled block calls it instead
of joining the groups. GPU runs: ``tests/test_stacked_output_cuda.py``."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from _cases import run_case
from _checks import needs_compiler
from test_attention import _block_inputs

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.kernels.stacked_linear import stacked_linear, unsupported
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import stacked_output
from bcg_diffusion.patches.attention import qwen_joint_attention_per_group
from bcg_diffusion.patches.stacked_output import STACKED_OUTPUT_ATTRIBUTE, choose, project_image

heavy = pytest.mark.heavy  # compiles with inductor on CPU


def _parts(rows=(5, 5), width=8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(sum(rows))
    return [torch.randn(r, width, generator=generator, dtype=dtype) for r in rows]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_part_gets_the_bytes_of_its_own_linear(with_bias, dtype):
    parts = _parts((5, 3, 7), dtype=dtype)
    weight = torch.randn(6, 8, dtype=dtype)
    bias = torch.randn(6, dtype=dtype) if with_bias else None
    out = stacked_linear(parts, weight, bias)
    assert out.shape == (15, 6) and out.dtype == dtype
    assert torch.equal(out, torch.cat([F.linear(p, weight, bias) for p in parts]))
    torch.testing.assert_close(out, F.linear(torch.cat(parts), weight, bias))


def test_parts_may_be_views_of_larger_tensors():
    whole = torch.randn(2, 9, 8)
    parts = list(whole[:, 4:].unbind(0))  # the image rows of two attention outputs: [5, 8] views, row stride 8
    weight, bias = torch.randn(6, 8), torch.randn(6)
    assert torch.equal(stacked_linear(parts, weight, bias), torch.cat([F.linear(p, weight, bias) for p in parts]))


def test_the_operator_passes_opcheck():
    parts, weight, bias = _parts((4, 4)), torch.randn(6, 8), torch.randn(6)
    torch.library.opcheck(torch.ops.bcg_diffusion.stacked_linear, (parts, weight, bias))
    torch.library.opcheck(torch.ops.bcg_diffusion.stacked_linear, (parts, weight, None))


def test_what_it_refuses():
    parts, weight = _parts((4, 4)), torch.randn(6, 8)
    assert unsupported(parts, weight) is None
    assert unsupported([], weight) == "no parts"
    assert "not [rows, 8]" in unsupported([torch.randn(4, 7)], weight)
    assert "bias" in unsupported(parts, weight, torch.randn(5))
    assert "dtype or device" in unsupported(parts, weight.bfloat16())
    assert "requires grad" in unsupported(parts, weight.requires_grad_())
    with torch.no_grad():
        assert unsupported(parts, weight) is None  # no autograd: a weight that requires grad is fine

    class Quantized(torch.Tensor):
        pass

    assert "subclass" in unsupported(parts, torch.randn(6, 8).as_subclass(Quantized))
    with pytest.raises(ValueError, match="cannot take these tensors"):
        stacked_linear([], torch.randn(6, 8))


class _Attention(torch.nn.Module):
    """What :func:`project_image` reads of a Qwen-Image attention module."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.to_out = torch.nn.ModuleList([torch.nn.Linear(width, 6), torch.nn.Dropout(0.0)])
        self.add_q_proj = torch.nn.Linear(width, width)


def _spy_operator(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = stacked_output.stacked_linear.stacked_linear

    def spy(parts, weight, bias=None):
        calls.append(len(parts))
        return original(parts, weight, bias)

    monkeypatch.setattr(stacked_output.stacked_linear, "stacked_linear", spy)
    return calls


@pytest.mark.parametrize("choice", ["stacked", "joined"])
def test_project_image_is_the_module_on_the_joined_rows(choice, monkeypatch):
    calls = _spy_operator(monkeypatch)
    attn, parts = _Attention(), _parts((5, 5))
    setattr(attn, STACKED_OUTPUT_ATTRIBUTE, choice)
    with torch.no_grad():
        out = project_image(attn, parts)
        expected = attn.to_out[0](torch.stack(parts))
    assert out.shape == (2, 5, 6)
    torch.testing.assert_close(out, expected)
    assert calls == ([2] if choice == "stacked" else [])


def test_the_default_stacks_two_parts_of_any_size(monkeypatch):
    calls = _spy_operator(monkeypatch)
    attn = _Attention()
    with torch.no_grad():
        project_image(attn, _parts((5, 5)))
        project_image(attn, _parts((3, 3)))
        project_image(attn, _parts((5,)))  # one part: nothing to join
    assert calls == [2, 2]


def test_one_part_reaches_the_projection_as_a_view():
    # One prompt (no CFG): its image rows go to the module as they lie, as before per-group outputs were
    # joined; a copy there would cost what the stacked product saves.
    attn, whole = _Attention(), torch.randn(1, 9, 8)
    seen = []
    attn.to_out[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].data_ptr()))
    with torch.no_grad():
        out = project_image(attn, [whole[0, 4:]])
    assert out.shape == (1, 5, 6) and seen == [whole[0, 4:].data_ptr()]


def test_a_hooked_replaced_or_quantized_projection_gets_the_module_call(monkeypatch):
    calls = _spy_operator(monkeypatch)
    attn, parts = _Attention(), _parts((5, 5))
    setattr(attn, STACKED_OUTPUT_ATTRIBUTE, "stacked")
    seen = []
    handle = attn.to_out[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        project_image(attn, parts)
    handle.remove()
    assert seen == [(2, 5, 6)] and calls == []  # the hook saw the module's own call
    # A global module hook changes nothing: the runner's search for hostile ops installs some for its first
    # run only, which once sent that run down the joined path and the later ones down the stacked one.
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with torch.no_grad():
            project_image(attn, parts)
    finally:
        handle.remove()
    assert calls == [2]
    calls.clear()

    original = attn.to_out[0].forward
    attn.to_out[0].forward = lambda x: original(x)  # as accelerate's offload hooks replace it
    with torch.no_grad():
        project_image(attn, parts)
    assert calls == []
    del attn.to_out[0].forward

    class LoraLinear(torch.nn.Linear):  # a layer put in the projection's place computes more than F.linear
        pass

    attn.to_out[0] = LoraLinear(8, 6)
    with torch.no_grad():
        project_image(attn, parts)
    assert calls == []


def test_choose_sets_qwen_attention_modules_and_refuses_other_choices(qwen_tiny):
    transformer = qwen_tiny.transformer
    assert choose(transformer, "joined") == len(transformer.transformer_blocks)
    assert all(getattr(b.attn, STACKED_OUTPUT_ATTRIBUTE) == "joined" for b in transformer.transformer_blocks)
    with pytest.raises(ValueError, match="choice must be one of"):
        choose(transformer, "yes")
    attn = _Attention()
    setattr(attn, STACKED_OUTPUT_ATTRIBUTE, "yes")
    with pytest.raises(ValueError, match="expected one of"):
        project_image(attn, _parts((5, 5)))


@pytest.fixture
def qwen_tiny():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2)])
def test_per_group_attention_stacked_gives_the_joined_bytes_on_cpu(qwen_tiny, lengths, rows):
    attn, hidden_states, text, _, rope = _block_inputs(qwen_tiny.transformer, lengths, rows)
    results = {}
    for choice in ("joined", "stacked"):
        setattr(attn, STACKED_OUTPUT_ATTRIBUTE, choice)
        with torch.no_grad():
            results[choice] = qwen_joint_attention_per_group(attn.processor, attn, hidden_states, text, rope, lengths)
    for joined, stacked in zip(results["joined"], results["stacked"], strict=True):
        torch.testing.assert_close(stacked, joined)  # float32 products of other row counts: rounding only


@needs_compiler
@heavy
def test_a_compiled_per_group_attention_calls_the_operator_and_joins_nothing(qwen_tiny):
    from torch._inductor.utils import run_and_get_code

    attn, hidden_states, text, _, rope = _block_inputs(qwen_tiny.transformer, (9, 4), 1)
    setattr(attn, STACKED_OUTPUT_ATTRIBUTE, "stacked")

    def image_output(hidden_states, text):
        return qwen_joint_attention_per_group(attn.processor, attn, hidden_states, text, rope, (9, 4))[0]

    with torch.no_grad():
        compiled, [code] = run_and_get_code(torch.compile(image_output, fullgraph=True), hidden_states, text)
        torch.testing.assert_close(compiled, image_output(hidden_states, text))
    assert "bcg_diffusion.stacked_linear" in code
    setattr(attn, STACKED_OUTPUT_ATTRIBUTE, "joined")
    with torch.no_grad():
        _, [joined_code] = run_and_get_code(torch.compile(image_output, fullgraph=True), hidden_states, text)
    assert "bcg_diffusion.stacked_linear" not in joined_code


@needs_compiler
@heavy
def test_another_image_size_reuses_the_compiled_attention(qwen_tiny):
    # Fast mode compiles its blocks for any number of image tokens; a choice that depended on that number
    # (a threshold on the rows of a part) would guard on it and compile a second variant.
    compiles = []

    def backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    attn = qwen_tiny.transformer.transformer_blocks[0].attn
    compiled = torch.compile(qwen_joint_attention_per_group, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):  # as fast mode compiles
        for image in ((1, 4, 4), (1, 6, 6), (1, 8, 4)):
            _, hidden_states, text, _, rope = _block_inputs(qwen_tiny.transformer, (9, 4), 1, image=image)
            compiled(attn.processor, attn, hidden_states, text, rope, (9, 4))
    assert len(compiles) == 1


@needs_compiler
@heavy
def test_a_choice_set_after_capture_drops_the_graphs_that_read_it(qwen_tiny, caplog):
    accelerate(qwen_tiny, mode="fast", debug=True)
    try:
        run_case(qwen_tiny, "qwen-image", "true_cfg", height=64, width=64)
        before = stats(qwen_tiny)["components"]["transformer"]["state_changes"]
        attn = qwen_tiny.transformer.transformer_blocks[0].attn
        setattr(attn, STACKED_OUTPUT_ATTRIBUTE, "joined")
        with caplog.at_level(logging.INFO, logger="bcg_diffusion"):
            run_case(qwen_tiny, "qwen-image", "true_cfg", height=64, width=64)
        assert stats(qwen_tiny)["components"]["transformer"]["state_changes"] > before
        assert f"transformer_blocks.0.attn.{STACKED_OUTPUT_ATTRIBUTE}: unset -> 'joined' since its capture" in (
            caplog.text
        )
    finally:
        restore(qwen_tiny)


@needs_compiler
@heavy
def test_fast_mode_with_the_output_stacked_equals_its_compiled_blocks_and_stays_near_eager(qwen_tiny, monkeypatch):
    """The whole pipeline in fast mode (debug mode on a CPU) with every attention stacking its output
    projection: the same bytes as its compiled blocks without graphs, near diffusers' own call."""
    calls = _spy_operator(monkeypatch)  # compiled: called while dynamo traces the blocks
    expected = run_case(qwen_tiny, "qwen-image", "true_cfg", height=64, width=64)
    accelerate(qwen_tiny, mode="fast", debug=True)  # stacked: the default
    try:
        first = run_case(qwen_tiny, "qwen-image", "true_cfg", height=64, width=64)
        with eager(qwen_tiny):
            reference = run_case(qwen_tiny, "qwen-image", "true_cfg", height=64, width=64)
        report = stats(qwen_tiny)
        assert report["cfg_batched"] > 0 and report["eager_fallbacks"] == 0 and report["compile_failure"] is None
    finally:
        restore(qwen_tiny)
    assert calls and set(calls) == {2}  # the CFG pair's two groups
    assert torch.equal(first, reference)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
