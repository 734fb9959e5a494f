"""Transformers quantized by diffusers' GGUF loader, CPU in debug mode: what ``accelerate`` does with them.

A tiny transformer of the real class is written to a GGUF file (the 2-D weights of the linears inside its
repeated blocks in Q8_0 or Q4_0, everything else F32, diffusers' own key names) and loaded back the way
users load GGUF checkpoints: ``from_single_file(path, quantization_config=GGUFQuantizationConfig(...),
config=<local dir>)``. For Qwen-Image and Z-Image the single-file loader takes diffusers' key names as they
are (it converts a checkpoint only when its keys differ from the model's), so no original-layout file is
needed. The loader turns those linears into ``GGUFLinear`` with ``GGUFParameter`` weights (the quantized
bytes, uint8), dequantized on every forward.

What the runner does with them, checked here: it runs them (debug mode: the whole runner path, no graphs)
and every call equals the same GGUF model run eagerly; ``stats()["quantized"]`` reports the weights
("before accelerate: N GGUFParameter"); ``restore`` leaves the user's GGUF model as it was. The hostile-op
finder (``stats()["signatures"][i]["hostile_ops"]``, what a real capture could not hold) finds nothing in
Q8_0's dequantize (views, casts, a product), and in Q4_0's
(``diffusers.quantizers.gguf.utils.dequantize_blocks_Q4_0``) one ``torch.tensor([0, 4], device=...)``
(tensor from Python data) in every quantized linear, each named by its module path. On a GPU that
constructor copies from pageable host memory and synchronizes, which a capture refuses: a Q4_0 signature
either fails to capture (and runs eagerly, with the reason) or runs those linears as eager breaks
(``test_quantize_loaders_cuda.py`` records which the GPU does).

bitsandbytes 4-bit has no CPU test: diffusers' ``BitsAndBytesConfig`` loader refuses a machine without a GPU
("No GPU found. A GPU is needed for quantization.", ``BnB4BitDiffusersQuantizer.validate_environment``),
although bitsandbytes itself quantizes on the CPU. Its checks are in ``test_quantize_loaders_cuda.py``.

``load_gguf`` (and through it ``write_gguf``) is imported by the GPU tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cases import run_cfg_case, tiny_pipeline
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install gguf)")
from diffusers import GGUFQuantizationConfig  # noqa: E402
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter  # noqa: E402

QUANT_TYPES = ("Q8_0", "Q4_0")
# What Q4_0's dequantize builds from Python data on every forward: ``torch.tensor([0, 4], device=...)``
Q4_0_OP = "torch.tensor (tensor from Python data, held as a graph constant)"


def gguf_weights(model: torch.nn.Module, quant_type: str) -> list[str]:
    """The state-dict keys :func:`write_gguf` quantizes: the weights of the linears inside ``model``'s
    ``_repeated_blocks`` whose input width is a multiple of ``quant_type``'s block (a linear of another
    width, Z-Image's tiny ``w2`` of 85 inputs, stays F32, as GGUF converters leave such tensors)."""
    block_size, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant_type]]
    classes = tuple(model._repeated_blocks)
    names = []
    for block_name, block in model.named_modules():
        if type(block).__name__ in classes:
            names += [
                f"{block_name}.{name}.weight"
                for name, module in block.named_modules()
                if isinstance(module, torch.nn.Linear) and module.in_features % block_size == 0
            ]
    return sorted(names)


def write_gguf(model: torch.nn.Module, path: Path, quant_type: str) -> list[str]:
    """Write ``model``'s state dict to the GGUF file ``path`` under its own key names: the weights of
    :func:`gguf_weights` in ``quant_type`` (gguf's reference quantizer), the rest F32. Returns those keys."""
    qtype = gguf.GGMLQuantizationType[quant_type]
    quantized = set(gguf_weights(model, quant_type))
    writer = gguf.GGUFWriter(str(path), arch="bcg-test")
    for key, value in model.state_dict().items():
        array = value.detach().to("cpu", torch.float32).numpy()
        if key in quantized:
            writer.add_tensor(key, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(quantized)


def load_gguf(model: torch.nn.Module, directory: Path, quant_type: str, compute_dtype: torch.dtype):
    """``model`` through a GGUF file and back: written in ``directory`` with its config, then loaded with
    ``from_single_file`` and ``GGUFQuantizationConfig(compute_dtype=...)`` on the CPU, offline.

    Returns the loaded model (on the CPU) and the keys of its quantized weights."""
    path = directory / "transformer.gguf"
    names = write_gguf(model, path, quant_type)
    model.save_config(directory)
    loaded = type(model).from_single_file(
        str(path),
        config=str(directory),
        quantization_config=GGUFQuantizationConfig(compute_dtype=compute_dtype),
        torch_dtype=compute_dtype,
        local_files_only=True,
    )
    return loaded, names


_pipe, _run = tiny_pipeline, run_cfg_case


def _gguf_pipe(name, quant_type, directory):
    pipe = _pipe(name)
    pipe.transformer, names = load_gguf(pipe.transformer, directory, quant_type, torch.float32)
    return pipe, names


def _linear_names(weights):
    return {key.removesuffix(".weight") for key in weights}


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_the_gguf_loader_makes_gguf_linears_holding_the_files_weights(name, quant_type, tmp_path):
    original = _pipe(name).transformer
    model, names = load_gguf(original, tmp_path, quant_type, torch.float32)
    assert names, "nothing quantized"
    gguf_linears = {fqn for fqn, module in model.named_modules() if isinstance(module, GGUFLinear)}
    assert gguf_linears == _linear_names(names)
    qtype = gguf.GGMLQuantizationType[quant_type]
    expected = original.state_dict()
    for key, value in model.state_dict().items():
        if key in names:
            assert type(value) is GGUFParameter and value.quant_type == qtype and value.dtype == torch.uint8, key
            decoded = gguf.quants.dequantize(value.as_tensor().numpy(), qtype)
            file_weight = gguf.quants.dequantize(gguf.quants.quantize(expected[key].numpy(), qtype), qtype)
            assert (decoded == file_weight).all(), key
        else:
            assert type(value) is torch.Tensor and torch.equal(value, expected[key]), key  # F32: the same


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_a_gguf_transformer_runs_in_the_runner_equal_to_itself_eager_and_restore_keeps_it(name, quant_type, tmp_path):
    pipe, names = _gguf_pipe(name, quant_type, tmp_path)
    reference = _run(pipe, name)
    accelerate(pipe, debug=True)
    try:
        images = [_run(pipe, name) for _ in range(2)]
        report = assert_graphs_ran(pipe)
        assert report["reason"] is None, report
        assert report["quantized"] == f"before accelerate: {len(names)} GGUFParameter", report
        for image in images:
            assert torch.equal(image, reference)
        signatures = report["signatures"]
        assert signatures and all(s["status"] == "debug" for s in signatures), signatures
        transformer = [s for s in signatures if s["component"] == "transformer"]
        assert transformer, signatures
        others = [op for s in signatures if s["component"] != "transformer" for op in s["hostile_ops"]]
        assert not [op for op in others if "dequantize" in op], others
        for signature in transformer:
            ops = signature["hostile_ops"]
            if quant_type == "Q8_0":  # views, casts and a product: nothing a capture could not hold
                assert ops == [], ops
            else:  # one torch.tensor([0, 4]) per quantized linear, each named by its module
                assert all(op.startswith(Q4_0_OP) and "in dequantize_blocks_Q4_0" in op for op in ops), ops
                named = {op.split(" in ")[1].split(" at ")[0] for op in ops}
                assert named == _linear_names(names), ops
    finally:
        restore(pipe)
    # restore undoes what accelerate did, not the user's quantization
    assert {fqn for fqn, m in pipe.transformer.named_modules() if isinstance(m, GGUFLinear)} == _linear_names(names)
    assert sum(type(p) is GGUFParameter for p in pipe.transformer.parameters()) == len(names)
    assert torch.equal(_run(pipe, name), reference)
