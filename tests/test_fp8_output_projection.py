"""The attention output projection (Qwen-Image's image stream's, Z-Image's) taking cuDNN's FP8 attention
output as it is (``patches/fp8_output_projection.py``), on a CPU: the attention operator and the prologue run their PyTorch
references, and torchao's product runs on the CPU on weights made as its config makes them (its hardware
check aside, as in ``tests/test_fp8_feed_forward.py``). The direct path computes attention's float8 output
times the FP8 weight; the text stream and the scaled path keep their bytes; anything but a plain row-wise
FP8 projection takes the scaled path. GPU runs: ``tests/test_fp8_output_projection_cuda.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock  # noqa: E402
from torchao.float8.inference import Float8MMConfig  # noqa: E402
from torchao.quantization import PerRow, PerTensor  # noqa: E402
from torchao.quantization.quantize_.workflows import Float8Tensor, QuantizeTensorToFloat8Kwargs  # noqa: E402

from bcg_diffusion.kernels import cudnn_fp8_attention  # noqa: E402
from bcg_diffusion.patches import fp8_output_projection as fp8_output  # noqa: E402
from bcg_diffusion.patches.attention import (  # noqa: E402
    KERNEL_ATTRIBUTE,
    QK_PROLOGUE_ATTRIBUTE,
    qwen_joint_attention_per_group,
)

WIDTH, HEADS, IMAGE_TOKENS = 256, 2, 16  # heads of 128: what cuDNN's FP8 attention takes


def _fp8(linear: torch.nn.Linear, granularity=None) -> None:
    """``linear``'s weight as torchao's ``Float8DynamicActivationFloat8WeightConfig`` leaves it."""
    granularity = granularity or PerRow()
    weight = Float8Tensor.from_hp(
        linear.weight.detach(),
        torch.float8_e4m3fn,
        granularity,
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, granularity),
    )
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)


def _attention(fp8_projection: bool = True) -> torch.nn.Module:
    """A Qwen-Image attention module with cuDNN's FP8 attention and the fused prologue chosen (their
    references on a CPU), its image output projection in FP8."""
    torch.manual_seed(0)
    attn = QwenImageTransformerBlock(WIDTH, HEADS, WIDTH // HEADS).attn.to(torch.bfloat16).eval()
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        norm.weight.data.normal_(1.0, 0.5)
    setattr(attn, KERNEL_ATTRIBUTE, "cudnn-fp8")
    setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
    if fp8_projection:
        _fp8(attn.to_out[0])
    return attn


def _inputs(lengths: tuple[int, ...], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths) + rows)
    batch = rows * len(lengths)
    hidden = torch.randn(batch, IMAGE_TOKENS, WIDTH, generator=generator).to(torch.bfloat16)
    text = torch.randn(batch, max(lengths), WIDTH, generator=generator).to(torch.bfloat16)
    return hidden, text


def _run(attn, lengths, rows, choice, monkeypatch=None):
    """The per-group attention with ``choice``; with ``monkeypatch``, also each group's FP8 attention output
    and descale as the operator gave them."""
    outputs = []
    if monkeypatch is not None:
        original = cudnn_fp8_attention.attention_fp8_output

        def spy(*args, **kwargs):
            outputs.append(original(*args, **kwargs))
            return outputs[-1]

        monkeypatch.setattr(cudnn_fp8_attention, "attention_fp8_output", spy)
    setattr(attn, fp8_output.FP8_OUTPUT_ATTRIBUTE, choice)
    hidden, text = _inputs(lengths, rows)
    with torch.no_grad():
        result = qwen_joint_attention_per_group(attn.processor, attn, hidden, text, None, lengths)
    return result, outputs


@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2), ((6,), 1)])
def test_the_direct_path_is_attentions_fp8_output_times_the_fp8_weight(lengths, rows, monkeypatch):
    attn = _attention()
    products = []
    original = fp8_output.linear_on_fp8
    monkeypatch.setattr(fp8_output, "linear_on_fp8", lambda *a: products.append(a[1].dtype) or original(*a))
    (image, _), outputs = _run(attn, lengths, rows, "direct", monkeypatch)
    assert products == [torch.float8_e4m3fn]  # one product, on float8 rows
    weight = attn.to_out[0].weight
    dequantized = weight.qdata.float() * weight.scale.float()
    expected = []
    for (out8, descale), length in zip(outputs, lengths, strict=True):
        rows_ = out8.flatten(2, 3)[:, length:].float() * descale  # attention's output, exactly
        expected.append(F.linear(rows_, dequantized, attn.to_out[0].bias.float()))
    expected = torch.cat(expected)
    assert image.dtype == torch.bfloat16 and image.shape == expected.shape
    # float32 products of the same float8 values: the bf16 output's rounding (and the sums' order) only
    torch.testing.assert_close(image.float(), expected, rtol=2**-7, atol=2**-7 * expected.abs().amax().item())


@pytest.mark.parametrize(("lengths", "rows"), [((9, 4), 1), ((3, 7), 2)])
def test_the_scaled_path_and_the_text_stream_keep_their_bytes(lengths, rows, monkeypatch):
    attn = _attention()
    (image, text), outputs = _run(attn, lengths, rows, "scaled", monkeypatch)
    # The scaled path: attention's output scaled back to bf16, the module's own call on the joined rows
    # (torchao quantizes them again), as before the direct path existed.
    scaled = [(out8.float() * descale).to(torch.bfloat16).flatten(2, 3) for out8, descale in outputs]
    parts = [part for out, length in zip(scaled, lengths) for part in out[:, length:].unbind(0)]
    with torch.no_grad():
        assert torch.equal(image, attn.to_out[0](torch.stack(parts)))
    (direct_image, direct_text), _ = _run(attn, lengths, rows, "direct")
    assert torch.equal(direct_text, text)  # the text stream's projection is bf16 either way
    # both near: the scaled path rounds the output to bf16, then to float8 per row, before the product
    torch.testing.assert_close(direct_image.float(), image.float(), rtol=0.1, atol=0.05 * image.abs().amax().item())


def test_only_a_plain_row_wise_fp8_projection_takes_the_fp8_output():
    attn = _attention()
    assert fp8_output.takes_fp8(attn)  # the default: direct
    setattr(attn, fp8_output.FP8_OUTPUT_ATTRIBUTE, "scaled")
    assert not fp8_output.takes_fp8(attn)
    setattr(attn, fp8_output.FP8_OUTPUT_ATTRIBUTE, "yes")
    with pytest.raises(ValueError, match="expected one of"):
        fp8_output.takes_fp8(attn)
    delattr(attn, fp8_output.FP8_OUTPUT_ATTRIBUTE)

    assert not fp8_output.takes_fp8(_attention(fp8_projection=False))  # bf16: the default filter's
    per_tensor = _attention(fp8_projection=False)
    _fp8(per_tensor.to_out[0], PerTensor())
    assert not fp8_output.takes_fp8(per_tensor)

    projection = attn.to_out[0]
    handle = projection.register_forward_pre_hook(lambda module, args: None)
    assert not fp8_output.takes_fp8(attn)
    handle.remove()
    projection.forward = lambda x: F.linear(x, projection.weight, projection.bias)  # as offload hooks do
    assert not fp8_output.takes_fp8(attn)
    del projection.forward
    assert fp8_output.takes_fp8(attn)

    class LoraLinear(torch.nn.Linear):  # a layer put in the projection's place computes more than its weight
        pass

    lora = LoraLinear(WIDTH, WIDTH)
    lora.weight, lora.bias = projection.weight, projection.bias
    attn.to_out[0] = lora
    assert not fp8_output.takes_fp8(attn)


def test_a_weight_only_fp8_projection_keeps_the_scaled_path():
    # torchao's Float8WeightOnlyConfig: row-wise e4m3 weights, no product settings and bf16 activations; its
    # product cannot take float8 rows (it once stopped on torchao's assertion of a product config)
    attn = _attention(fp8_projection=False)
    linear = attn.to_out[0]
    weight = Float8Tensor.from_hp(linear.weight.detach(), torch.float8_e4m3fn, PerRow())
    assert weight.mm_config is None and weight.act_quant_kwargs is None
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert not fp8_output.takes_fp8(attn)
    (image, text), _ = _run(attn, (9, 4), 1, "direct")
    assert image.dtype == text.dtype == torch.bfloat16


def test_a_bf16_projection_keeps_the_scaled_path(monkeypatch):
    attn = _attention(fp8_projection=False)
    monkeypatch.setattr(fp8_output, "project", lambda *a: pytest.fail("the FP8 path took a bf16 weight"))
    (image, _), _ = _run(attn, (9, 4), 1, "direct")
    assert image.dtype == torch.bfloat16


def test_choose_sets_qwen_attention_modules_and_refuses_other_choices():
    model = torch.nn.ModuleList([QwenImageTransformerBlock(WIDTH, HEADS, WIDTH // HEADS) for _ in range(2)])
    model.append(torch.nn.Linear(4, 4))
    assert fp8_output.choose(model, "scaled") == 2
    assert all(getattr(block.attn, fp8_output.FP8_OUTPUT_ATTRIBUTE) == "scaled" for block in model[:2])
    with pytest.raises(ValueError, match="choice must be one of"):
        fp8_output.choose(model, "fp8")


def test_project_refuses_what_it_cannot_take():
    attn = _attention()
    part = torch.zeros(4, WIDTH, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one descale per part"):
        fp8_output.project(attn, [part, part], [torch.tensor(1.0)], torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_output.project(attn, [part.bfloat16()], [torch.tensor(1.0)], torch.bfloat16)
    with torch.no_grad():
        out = fp8_output.project(attn, [part, part], [torch.tensor(1.0)] * 2, torch.bfloat16)
    assert out.shape == (2, 4, WIDTH)


def test_the_direct_path_is_traced_whole_by_dynamo():
    attn = _attention()
    hidden, text = _inputs((9, 4), 1)
    args = (attn.processor, attn, hidden, text, None, (9, 4))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(qwen_joint_attention_per_group, backend="aot_eager", fullgraph=True)
        with torch.no_grad():  # as pipelines call it (torch has no derivative for _scaled_mm)
            got = compiled(*args)
            expected = qwen_joint_attention_per_group(*args)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_zimage_attention_hands_its_fp8_output_to_an_fp8_projection(monkeypatch):
    """Z-Image's processor (one descale for the batch): the direct path is attention's float8 output times
    the FP8 weight and near the scaled path, which keeps its bytes (the module's own call on the output
    scaled back); traced whole by dynamo."""
    from _cases import zimage_block_call
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    from bcg_diffusion.core.hooks import MethodPatches
    from bcg_diffusion.patches import attention

    torch.manual_seed(0)
    block = ZImageTransformerBlock(0, WIDTH, HEADS, 2, 1e-5, qk_norm=True, modulation=True)
    block = block.to(torch.bfloat16).eval()
    block.attention.norm_q.weight.data.normal_(1.0, 0.5)
    projection = block.attention.to_out[0]
    _fp8(projection)
    patches = MethodPatches()
    assert attention.ZIMAGE_ROPE_PATCH.apply(block, patches) == 1
    setattr(block.attention, KERNEL_ATTRIBUTE, "cudnn-fp8")
    setattr(block.attention, QK_PROLOGUE_ATTRIBUTE, "fused")
    attended, projected, module_calls = [], [], []
    original = cudnn_fp8_attention.attention_fp8_output
    monkeypatch.setattr(
        cudnn_fp8_attention, "attention_fp8_output", lambda *a: attended.append(original(*a)) or attended[-1]
    )
    original_project = fp8_output.project
    monkeypatch.setattr(fp8_output, "project", lambda *a: projected.append(original_project(*a)) or projected[-1])

    def record(module, args, out):  # a global hook: a hook of the projection's own sends it down the scaled path
        if module is projection:
            module_calls.append((args[0], out))

    hook = torch.nn.modules.module.register_module_forward_hook(record)

    def call(module: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return zimage_block_call(module, torch.Generator().manual_seed(1), False, torch.bfloat16)

    try:
        results = {}
        for choice in ("scaled", "direct"):
            setattr(block.attention, fp8_output.FP8_OUTPUT_ATTRIBUTE, choice)
            results[choice] = call(block)
        hook.remove()
        torch._dynamo.reset()
        traced_output = call(torch.compile(block, backend="aot_eager", fullgraph=True))
        torch._dynamo.reset()
    finally:
        hook.remove()
        patches.undo()
    # scaled: the module's own call on the output scaled back; direct (then traced): a product on float8 rows
    assert len(module_calls) == 1 and len(projected) == 2
    (scaled8, scaled_descale), (out8, descale) = attended[:2]
    assert torch.equal(module_calls[0][0], (scaled8.float() * scaled_descale).to(torch.bfloat16).flatten(2, 3))
    weight = projection.weight
    expected = F.linear(out8.flatten(2, 3).float() * descale, weight.qdata.float() * weight.scale.float())
    direct = projected[0].reshape(expected.shape)  # project's [1, B * S, N]: one part, the batch's rows
    assert direct.dtype == torch.bfloat16 and direct.shape == expected.shape == (2, 24, WIDTH)
    torch.testing.assert_close(direct.float(), expected, rtol=2**-7, atol=2**-7 * expected.abs().amax().item())
    assert torch.equal(traced_output, results["direct"])
    torch.testing.assert_close(
        results["direct"].float(),
        results["scaled"].float(),
        rtol=0.1,
        atol=0.05 * results["scaled"].abs().amax().item(),
    )
