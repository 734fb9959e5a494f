"""Fast mode with ``quantize="fp8"``: Z-Image's query, key and value projected by one FP8 product
(``features/fused_qkv.py``).

torchao refuses FP8 on a CPU (no FP8 tensor cores), but its FP8 weights and products run there; these
tests switch its hardware check (and ours) off, so the whole path runs on the CPU: the fused weight
holds exactly the three quantized weights, which become views of it, the processor takes it, a changed
projection drops it (and the captures that read it), and ``restore`` takes it away. GPU runs:
``tests/test_quantize_cuda.py``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from _checks import needs_compiler

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.features import fused_qkv
from bcg_diffusion.features.quantization import FP8, quantize_transformer
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import attention

pytest.importorskip("torchao")
import torchao.quantization.quant_api as torchao_quant_api  # noqa: E402

import bcg_diffusion.features.quantization as quantization  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Deprecation:UserWarning")


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(torchao_quant_api, "_check_hardware_support", lambda *args, **kwargs: None)
    monkeypatch.setattr(quantization, "check_fp8_device", lambda device: None)


def _quantized_transformer() -> tuple[torch.nn.Module, quantization.Quantized]:
    transformer = build_pipeline("z-image", "tiny", dtype=torch.bfloat16).transformer
    return transformer, quantize_transformer(transformer, FP8)


def _shares_memory(part: torch.Tensor, whole: torch.Tensor) -> bool:
    return all(
        p.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        for p, w in zip(fused_qkv._inner(part), fused_qkv._inner(whole), strict=True)
    )


def test_the_fused_weight_holds_the_three_quantized_weights_in_their_memory(fp8_on_cpu):
    transformer, done = _quantized_transformer()
    apart = {n: m.weight for n, m in transformer.named_modules() if n.endswith(("to_q", "to_k", "to_v"))}
    made = fused_qkv.fuse_qkv(transformer, done)
    attentions = [
        m
        for m in transformer.modules()
        if type(getattr(m, "processor", None)).__name__ == "ZSingleStreamAttnProcessor"
    ]
    assert len(made) == len(attentions) > 0
    for fused in made:
        weight = getattr(fused.attention, attention.FUSED_QKV_ATTRIBUTE).weight
        parts = [getattr(fused.attention, name).weight for name in ("to_q", "to_k", "to_v")]
        before = [apart[f"{fused.name}.{name}"] for name in ("to_q", "to_k", "to_v")]
        assert torch.equal(weight.qdata.view(torch.uint8), torch.cat([p.qdata for p in before]).view(torch.uint8))
        assert torch.equal(weight.scale, torch.cat([p.scale for p in before]))
        for part, old in zip(parts, before, strict=True):  # each projection now reads its rows of the fused weight
            assert fused_qkv._same(part, old) and _shares_memory(part, weight)
        assert fused.stale() is None


def test_a_fused_weight_that_is_not_the_three_is_refused(fp8_on_cpu, monkeypatch):
    transformer, done = _quantized_transformer()
    to_q = transformer.layers[0].attention.to_q.weight
    monkeypatch.setattr(fused_qkv, "_same", lambda a, b: False)  # as a per-tensor scale would differ
    assert fused_qkv.fuse_qkv(transformer, done) == []
    assert transformer.layers[0].attention.to_q.weight is to_q
    assert not any(attention.FUSED_QKV_ATTRIBUTE in name for name, _ in transformer.named_modules())


def test_the_processor_splits_the_fused_product_into_the_three(fp8_on_cpu):
    transformer, done = _quantized_transformer()
    [first, *_] = fused_qkv.fuse_qkv(transformer, done)
    module = first.attention
    x = torch.randn(2, 5, module.to_q.in_features, dtype=torch.bfloat16)
    fused = attention._zimage_projections(module, x)
    fused_qkv.unfuse(first)
    apart = attention._zimage_projections(module, x)
    for got, expected in zip(fused, apart, strict=True):
        assert got.shape == expected.shape == (2, 5, module.heads, module.to_q.out_features // module.heads)
        # The same FP8 values and scales; only the product's accumulation order may differ.
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_a_replaced_or_rewritten_projection_is_stale(fp8_on_cpu):
    transformer, done = _quantized_transformer()
    first, second, *_ = fused_qkv.fuse_qkv(transformer, done)
    first.attention.to_k = copy.deepcopy(first.attention.to_k)
    assert first.stale() == "to_k was replaced"
    second.attention.to_v.weight.scale.mul_(1)  # an in-place write, even of nothing
    assert second.stale() == "a projection's weight was written in place"


def test_only_fast_mode_with_fp8_fuses():
    pipe = build_pipeline("z-image", "tiny")
    accelerate(pipe, debug=True)
    try:
        assert stats(pipe)["fused_qkv"] == 0
    finally:
        restore(pipe)


def _call(pipe) -> torch.Tensor:
    return pipe(
        prompt="a lighthouse",
        height=64,
        width=64,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    ).images


@needs_compiler
@pytest.mark.heavy
def test_fast_fp8_fuses_then_drops_a_changed_projection_and_recaptures(fp8_on_cpu, caplog):
    pipe = build_pipeline("z-image", "tiny", dtype=torch.bfloat16)
    accelerate(pipe, mode="fast", quantize="fp8", debug=True)
    try:
        _call(pipe)
        before = stats(pipe)
        assert before["fused_qkv"] > 0 and before["fused_qkv_dropped"] == 0, before
        layer = pipe.transformer.layers[0].attention
        assert isinstance(getattr(layer, attention.FUSED_QKV_ATTRIBUTE), torch.nn.Module)
        layer.to_q = copy.deepcopy(layer.to_q)  # as a LoRA layer would replace it
        with caplog.at_level(logging.INFO, logger="bcg_diffusion"):
            _call(pipe)
        after = stats(pipe)
        assert after["fused_qkv_dropped"] == 1 and after["fused_qkv"] == before["fused_qkv"] - 1, after
        assert not hasattr(layer, attention.FUSED_QKV_ATTRIBUTE)
        assert "to_q was replaced" in caplog.text
        transformer = after["components"]["transformer"]
        assert transformer["state_changes"] > before["components"]["transformer"]["state_changes"], (
            "the captures that read the fused projection are dropped"
        )
    finally:
        restore(pipe)
    assert not any(attention.FUSED_QKV_ATTRIBUTE in name for name, _ in pipe.transformer.named_modules())


@needs_compiler
@pytest.mark.heavy
def test_restore_gives_the_bf16_projections_back_not_rows_of_the_fused_weight(fp8_on_cpu):
    pipe = build_pipeline("z-image", "tiny", dtype=torch.bfloat16)
    plain = _call(pipe)
    weights = {name: p for name, p in pipe.transformer.named_parameters() if name.endswith("to_q.weight")}
    accelerate(pipe, mode="fast", quantize="fp8", debug=True)
    try:
        _call(pipe)
        assert stats(pipe)["fused_qkv"] > 0
    finally:
        restore(pipe)
    restored = {name: p for name, p in pipe.transformer.named_parameters() if name.endswith("to_q.weight")}
    assert all(torch.equal(restored[name], weight) for name, weight in weights.items())
    assert torch.equal(_call(pipe), plain)
