"""Transformers quantized by diffusers' GGUF and bitsandbytes 4-bit loaders, inside real graphs (marker: cuda).

Tiny bf16 pipelines on the GPU. The transformer is replaced by the same weights loaded through
``from_single_file(..., quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16))`` (a GGUF
file written as in ``test_quantize_loaders_cpu.py``: the blocks' linears in Q8_0 or Q4_0) or through
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` (``Linear4bit``),
then ``accelerate(pipe)`` (exact mode). Every call must give the bytes of the same quantized model run
eagerly, never another image, and:

* GGUF (Q8_0 and Q4_0) must capture: every signature captured and the transformer itself replayed, with no
  eager fallback (``assert_graphs_ran``). Q4_0 builds ``torch.tensor([0, 4])`` on the GPU in every linear;
  the capture holds it as a graph constant (run 63: every signature captured, no automatic break), so an
  image equal to eager proves nothing unless the graphs ran;
* bitsandbytes (not run yet): what the hostile-op finder saw in the quantized linears on the eager
  reference run decides what is asserted: nothing -> as for GGUF; something -> each signature either
  captured (its automatic breaks and constants listed) or failed with its reason;
* each test prints what happened (signatures captured / failed with reasons, automatic breaks, what the
  finder saw), so that the GPU log records it: run with ``-s``.

Needs ``gguf`` (small, in the ``test`` extra) and ``bitsandbytes`` (a 43 MB wheel: not in the extra; its
test is skipped without it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cases import CFG_CASE, cuda_pipeline, run_case
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.core.hostile import HostileOpFinder

pytestmark = pytest.mark.cuda

SIZE = 64


def _run(pipe, name):
    return run_case(pipe, name, CFG_CASE[name], height=SIZE, width=SIZE, steps=3)


def _check_in_graphs(pipe, name: str, label: str, linears: set[str], weights: str, *, require_capture: bool) -> None:
    """Eager reference under the finder, then ``accelerate`` and two calls: each equal to the reference;
    ``require_capture`` (or no finding of the finder in ``linears``, module paths) asks for every signature
    captured and the transformer replayed (module doc)."""
    with HostileOpFinder(pipe.transformer) as finder:
        reference = _run(pipe, name)
    in_linears = [op for op in finder.found if op.module in linears]
    accelerate(pipe)
    try:
        images = [_run(pipe, name) for _ in range(2)]
        report = stats(pipe)
        signatures = report["signatures"]
        captured = [s for s in signatures if s["status"] == "captured"]
        failed = [s for s in signatures if s["status"] == "failed"]
        auto = sorted({b for s in signatures for b in s.get("auto_breaks") or []})
        constants = sorted({c for s in signatures for c in s.get("constants") or []})
        lines = [
            f"{label}: {report['quantized']}; signatures {len(signatures)}: captured {len(captured)}, "
            f"failed {len(failed)}; captures {report['captures']}, replays {report['replays']}, "
            f"eager fallbacks {report['eager_fallbacks']}",
            *(f"  failed {s['component']} {s['signature'][:120]}: {s['reason']}" for s in failed),
            f"  automatic breaks: {len(auto)}",
            *(f"    {b}" for b in auto[:8]),
            f"  graph constants: {len(constants)}",
            *(f"    {c}" for c in constants[:4]),
            f"  the finder saw in the quantized linears: {len(in_linears)}",
            *(f"    {op}" for op in in_linears[:4]),
        ]
        print("\n" + "\n".join(lines))
        assert report["active"], report["reason"]
        quantized = report["quantized"] or ""
        assert quantized.startswith("before accelerate") and weights in quantized, quantized
        for image in images:  # whichever way the capture went
            assert torch.equal(image, reference)
        assert all(s["status"] in ("captured", "failed") for s in signatures), signatures
        assert all(s["reason"] for s in failed), failed
        if require_capture or not in_linears:  # GGUF, or nothing a capture could not hold: all captured, replayed
            assert_graphs_ran(pipe, captures=True, components=("transformer",))
        # else: either outcome (captured, with or without automatic breaks, or failed with its reason) is
        # right as long as the images are; the lines printed above record which one the GPU gave
    finally:
        restore(pipe)
    assert torch.equal(_run(pipe, name), reference)


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_a_gguf_transformer_in_graphs_equals_itself_eager(name, quant_type, tmp_path: Path):
    pytest.importorskip("gguf", reason="needs gguf (pip install gguf)")
    from diffusers.quantizers.gguf.utils import GGUFParameter
    from test_quantize_loaders_cpu import load_gguf

    with cuda_pipeline(name, "tiny") as pipe:
        model, names = load_gguf(pipe.transformer, tmp_path, quant_type, torch.bfloat16)
        pipe.transformer = model.to("cuda")
        quantized = [p for p in pipe.transformer.parameters() if type(p) is GGUFParameter]
        assert len(quantized) == len(names) and all(p.is_cuda for p in quantized)
        linears = {key.removesuffix(".weight") for key in names}
        _check_in_graphs(pipe, name, f"{name}/gguf-{quant_type}", linears, "GGUFParameter", require_capture=True)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_a_bitsandbytes_4bit_transformer_in_graphs_equals_itself_eager(name, quant_type, tmp_path: Path):
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes)")
    from diffusers import BitsAndBytesConfig

    with cuda_pipeline(name, "tiny") as pipe:
        pipe.transformer.save_pretrained(tmp_path)
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.bfloat16
        )
        model = type(pipe.transformer).from_pretrained(
            tmp_path, quantization_config=config, torch_dtype=torch.bfloat16
        )
        pipe.transformer = model
        linears = {fqn: module for fqn, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
        assert linears and all(module.weight.is_cuda for module in linears.values())
        _check_in_graphs(pipe, name, f"{name}/bnb-{quant_type}", set(linears), "Params4bit", require_capture=False)
