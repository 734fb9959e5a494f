"""quantize= (torchao) on the transformer, CPU in debug mode: validation, the default filter, equality
with the same quantization applied by hand, restore, and models quantized before accelerate.

FP8 needs FP8 tensor cores, so the CPU tests quantize with torchao's int8 weight-only config through the
same option and filter; the FP8 runs are in ``test_quantize_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _cases import run_cfg_case, tiny_pipeline

from bcg_diffusion import AccelerateConfig, accelerate, restore, stats
from bcg_diffusion.quantize import block_linears, default_filter

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Deprecation:UserWarning")  # torchao's notes on its own classes


_pipe, _run = tiny_pipeline, run_cfg_case


def test_options_are_validated():
    with pytest.raises(ValueError, match="quantize must be"):
        AccelerateConfig(quantize="int4")
    with pytest.raises(ValueError, match="with quantize= only"):
        AccelerateConfig(quantize_filter=lambda module, name: True)
    with pytest.raises(TypeError, match="callable"):
        AccelerateConfig(quantize="fp8", quantize_filter="blocks")
    assert AccelerateConfig(quantize=Int8WeightOnlyConfig()).quantize == Int8WeightOnlyConfig()


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_the_default_filter_takes_the_blocks_linears_but_modulation_text_and_attention_out(name):
    model = _pipe(name).transformer
    chosen, candidates = default_filter(model), block_linears(model)
    selected = [fqn for fqn, module in model.named_modules() if chosen(module, fqn)]
    every = [fqn for fqn, module in model.named_modules() if candidates(module, fqn)]
    assert selected and all(isinstance(model.get_submodule(fqn), torch.nn.Linear) for fqn in every)
    blocks = "transformer_blocks." if name == "qwen-image" else ("layers.", "noise_refiner.", "context_refiner.")
    assert all(fqn.startswith(blocks) for fqn in every), every
    assert not [fqn for fqn in every if "mod" in fqn or "add_" in fqn or "txt_mlp" in fqn], every
    assert "proj_out" not in every and not any("embed" in fqn for fqn in every)
    assert sorted(set(every) - set(selected)) == sorted(fqn for fqn in every if fqn.endswith(".to_out.0")) != []


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_quantized_runner_equals_the_same_quantization_by_hand_and_restore_gives_the_weights_back(name):
    pipe = _pipe(name)
    by_hand = copy.deepcopy(pipe)
    quantize_(by_hand.transformer, Int8WeightOnlyConfig(), filter_fn=default_filter(by_hand.transformer))
    reference = _run(by_hand, name)
    original = {key: value.clone() for key, value in pipe.transformer.state_dict().items()}
    plain = _run(pipe, name)
    accelerate(pipe, debug=True, quantize=Int8WeightOnlyConfig())
    try:
        report = stats(pipe)
        assert report["quantized_linears"] > 0 and "Int8WeightOnly" in report["quantized"], report
        assert torch.equal(_run(pipe, name), reference)
        assert torch.equal(_run(pipe, name), reference)
        assert stats(pipe)["replays"] > 0
    finally:
        restore(pipe)
    restored = pipe.transformer.state_dict()
    assert all(type(value) is torch.Tensor and torch.equal(value, original[key]) for key, value in restored.items())
    assert torch.equal(_run(pipe, name), plain)


def test_fp8_refuses_a_device_without_fp8_with_a_clear_error():
    pipe = _pipe("z-image")
    with pytest.raises(RuntimeError, match="compute capability 8.9"):
        accelerate(pipe, debug=True, quantize="fp8")
    assert not any(type(p) is not torch.nn.Parameter for p in pipe.transformer.parameters())  # nothing changed
    assert torch.isfinite(_run(pipe, "z-image")).all()


def test_a_model_quantized_before_accelerate_is_reported_and_equal():
    pipe = _pipe("qwen-image")
    quantize_(pipe.transformer, Int8WeightOnlyConfig(), filter_fn=default_filter(pipe.transformer))
    reference = _run(pipe, "qwen-image")
    accelerate(pipe, debug=True)
    try:
        assert "before accelerate" in stats(pipe)["quantized"]
        assert torch.equal(_run(pipe, "qwen-image"), reference)
    finally:
        restore(pipe)


def test_quantize_leaves_the_process_settings_as_they_were():
    # torchao's set_inductor_config=True switched float32 products to TF32 and turned on inductor's
    # coordinate-descent tuning for the whole process: on the H200 (run 58), graphs of a bf16 pipeline
    # captured before another pipeline was quantized no longer matched the same code run after.
    import torch._inductor.config as inductor

    precision, tuning = torch.get_float32_matmul_precision(), inductor.coordinate_descent_tuning
    pipe = _pipe("z-image")
    accelerate(pipe, debug=True, quantize=Int8WeightOnlyConfig())
    try:
        assert torch.get_float32_matmul_precision() == precision
        assert inductor.coordinate_descent_tuning == tuning
    finally:
        restore(pipe)
