"""quantize= (torchao) on the transformer, CPU in debug mode: validation, the default filter, equality
with the same quantization applied by hand, restore, models quantized before accelerate, and a quantize
that fails midway (an injected failure in torchao's handler), which must leave the weights as they were.

FP8 needs FP8 tensor cores, so the CPU tests quantize with torchao's int8 weight-only config through the
same option and filter; the FP8 runs are in ``test_quantize_cuda.py``.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import pytest
import torch
from _cases import run_cfg_case, tiny_pipeline

import bcg_diffusion.features.quantization as quantize_module
from bcg_diffusion import AccelerateConfig, accelerate, restore, stats
from bcg_diffusion.features.quantization import block_linears, default_filter, quantize_transformer

torchao = pytest.importorskip("torchao")
from torchao.core.config import AOBaseConfig  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402
from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER  # noqa: E402

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

    from bcg_diffusion.core import settings

    precision, tuning = torch.get_float32_matmul_precision(), inductor.coordinate_descent_tuning
    keyed = settings.current()
    pipe = _pipe("z-image")
    accelerate(pipe, debug=True, quantize=Int8WeightOnlyConfig())
    try:
        assert torch.get_float32_matmul_precision() == precision
        assert inductor.coordinate_descent_tuning == tuning
        # The settings every runner keys its graphs on, per-backend precisions included: setting the old
        # API's "highest" again moved them from "none" to "ieee", so every pipeline captured before
        # captured again on its next call (FLUX.1 and klein in bcg and fast mode, H100 runs 161 and 162).
        assert settings.differences(keyed, settings.current()) == []
    finally:
        restore(pipe)


def test_keeping_global_settings_undoes_a_precision_change_exactly():
    from bcg_diffusion.core import settings
    from bcg_diffusion.features.quantization import keeping_global_settings

    keyed = settings.current()
    with keeping_global_settings():
        torch.set_float32_matmul_precision("high")  # what torchao's set_inductor_config=True does
    assert settings.differences(keyed, settings.current()) == []


# ------------------------------------------------------------------------------ a quantize that fails midway


@dataclass
class _SwapConfig(AOBaseConfig):
    """A config whose handler swaps each linear for a new module (int8 weight-only on a copy), as some of
    torchao's configs replace the module rather than its weight."""


def _swap(module: torch.nn.Module, config: _SwapConfig, **kwargs) -> torch.nn.Module:
    return _QUANTIZE_CONFIG_HANDLER[Int8WeightOnlyConfig](copy.deepcopy(module), Int8WeightOnlyConfig())


@pytest.fixture
def handlers(monkeypatch):
    """torchao's handler table (process-wide), given back as it was after the test; ``fail_at(config_type,
    n, error)`` makes ``config_type``'s handler quantize as usual, then raise ``error`` once it has quantized
    its ``n``th linear (so ``n`` linears are quantized, or swapped, when the error leaves torchao)."""
    monkeypatch.setitem(_QUANTIZE_CONFIG_HANDLER, _SwapConfig, _swap)

    def fail_at(config_type: type, n: int, error: BaseException) -> list[torch.nn.Module]:
        real, calls = _QUANTIZE_CONFIG_HANDLER[config_type], []

        def failing(module, config, **kwargs):
            calls.append(module)
            replacement = real(module, config, **kwargs)
            if len(calls) == n:
                raise error
            return replacement

        monkeypatch.setitem(_QUANTIZE_CONFIG_HANDLER, config_type, failing)
        return calls

    return fail_at


def _as_they_are(model: torch.nn.Module) -> tuple[dict, dict]:
    """Every parameter of ``model`` (the object, a copy of its values, its requires_grad) and every module (the
    object, the names of its instance attributes)."""
    parameters = {name: (p, p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}
    modules = {name: (m, sorted(m.__dict__)) for name, m in model.named_modules()}
    return parameters, modules


def _assert_as_they_were(model: torch.nn.Module, before: tuple[dict, dict], *, same_objects: bool = False) -> None:
    parameters, modules = before
    now = dict(model.named_parameters())
    assert sorted(now) == sorted(parameters)
    for name, (original, values, requires_grad) in parameters.items():
        parameter = now[name]
        assert type(parameter) is torch.nn.Parameter, (name, type(parameter))
        assert (parameter.dtype, parameter.device, parameter.requires_grad) == (
            values.dtype,
            values.device,
            requires_grad,
        ), name
        assert torch.equal(parameter, values), name
        assert parameter is original or not same_objects, name
    now_modules = dict(model.named_modules())
    assert sorted(now_modules) == sorted(modules)
    for name, (module, attributes) in modules.items():
        assert now_modules[name] is module, name  # a module torchao swapped in is gone
        assert sorted(module.__dict__) == attributes, name  # torchao binds extra_repr on the instance


def _notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", ()))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("injected failure inside torchao"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)"),
        KeyboardInterrupt(),
    ],
    ids=["error", "out-of-memory", "interrupt"],
)
def test_a_quantize_that_fails_midway_leaves_the_pipeline_as_it_was(handlers, error):
    # The issue: a quantize= that failed midway (out of memory, say) left the model partly quantized and
    # the original weights gone.
    name = "z-image"
    pipe = _pipe(name)
    plain = _run(pipe, name)
    before = _as_they_are(pipe.transformer)
    calls = handlers(Int8WeightOnlyConfig, 5, error)
    with pytest.raises(type(error)) as raised:
        accelerate(pipe, debug=True, quantize=Int8WeightOnlyConfig())
    assert raised.value is error  # the same error, its type kept (an out-of-memory error stays one)
    assert (
        len(calls) == 5 < len([fqn for fqn, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)])
    )
    assert not hasattr(pipe, "_bcg_state")
    _assert_as_they_were(pipe.transformer, before)
    if sys.version_info >= (3, 11):
        notes = _notes(raised.value)
        assert "failed at" in notes and "original weights are back" in notes, notes
    assert torch.equal(_run(pipe, name), plain)
    accelerate(pipe, debug=True)
    try:
        assert torch.equal(_run(pipe, name), plain)
        assert stats(pipe)["quantized"] is None
    finally:
        restore(pipe)


def test_a_quantize_that_swaps_modules_and_fails_puts_the_original_modules_back(handlers):
    pipe = _pipe("qwen-image")
    before = _as_they_are(pipe.transformer)
    handlers(_SwapConfig, 3, torch.OutOfMemoryError("CUDA out of memory (injected)"))
    with pytest.raises(torch.OutOfMemoryError):
        accelerate(pipe, debug=True, quantize=_SwapConfig())
    assert not hasattr(pipe, "_bcg_state")
    _assert_as_they_were(pipe.transformer, before, same_objects=True)  # the swapped-out modules kept their weights


def test_a_quantize_that_swaps_modules_is_restored_with_the_original_modules(handlers):
    name = "qwen-image"
    pipe = _pipe(name)
    plain = _run(pipe, name)
    before = _as_they_are(pipe.transformer)
    accelerate(pipe, debug=True, quantize=_SwapConfig())
    try:
        assert stats(pipe)["quantized_linears"] > 0
        swapped = [fqn for fqn, (module, _) in before[1].items() if pipe.transformer.get_submodule(fqn) is not module]
        assert swapped, "the handler swapped no module"
    finally:
        restore(pipe)
    _assert_as_they_were(pipe.transformer, before, same_objects=True)
    assert torch.equal(_run(pipe, name), plain)


def test_restore_gives_requires_grad_back():
    pipe = _pipe("z-image")
    before = _as_they_are(pipe.transformer)
    accelerate(pipe, debug=True, quantize=Int8WeightOnlyConfig())
    restore(pipe)
    parameters, _ = before
    now = dict(pipe.transformer.named_parameters())
    assert all(now[name].requires_grad == requires_grad for name, (_, _, requires_grad) in parameters.items())


def test_a_failed_quantize_that_cannot_move_the_weights_back_says_where_they_are(handlers, monkeypatch):
    # After an out-of-memory error, moving the original weights back onto the GPU may fail for lack of
    # memory too: the weights stay whole on the CPU, and the error says so.
    model = _pipe("z-image").transformer
    before = _as_they_are(model)
    handlers(Int8WeightOnlyConfig, 4, torch.OutOfMemoryError("CUDA out of memory (injected)"))
    moving = torch.OutOfMemoryError("CUDA out of memory while moving back (injected)")

    def refuse(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise moving

    monkeypatch.setattr(quantize_module, "_to_device", refuse)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        quantize_transformer(model, Int8WeightOnlyConfig())
    _assert_as_they_were(model, before)  # on the CPU here, where the model was
    assert raised.value is moving and isinstance(raised.value.__context__, torch.OutOfMemoryError)
    if sys.version_info >= (3, 11):
        notes = _notes(raised.value)
        assert "4 linears" in notes and "on the CPU" in notes and ".to(" in notes, notes
