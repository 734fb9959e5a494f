"""GPU probe: what FP8 can give inside one fast-mode block, and where its time goes (issue 22).

Answered (run 67, `bench/results/2026-12-02-h200/probe-fp8-block-run67.log`): a compiled Z-Image block takes 0.78 (512²) and 0.70 (1024²) of its bf16 time in row-wise FP8 at best, 0.74 and 0.75 per-tensor; row-wise products at 1,088 rows gain 1.08–1.26× on the 3,840-wide outputs; max-autotune spends about 77 s per shape and its Triton FP8 kernels are no faster than cuBLAS's (those variants did not finish in the phase's time). A compiled Qwen-Image block at 1024² CFG takes 0.77 (default filter) and 0.76 (every block linear) of its bf16 time in row-wise FP8 (run 75, `probe-fp8-block-qwen-run75.log`).

* The matrix products of Z-Image-Turbo at 512² (1,088 tokens) and 1024² (4,160) and of Qwen-Image's
  image stream at 1024² with true CFG batched (8,192 rows), each cycling through eight weight copies
  so that no weight stays in L2: bf16 cuBLAS against ``torch._scaled_mm`` with row-wise scales (what
  torchao's ``PerRow`` calls) and with one scale per tensor (``PerTensor``: cuBLAS's own FP8 path),
  activations already quantized. This is the ceiling of each scaling, before its activation
  quantization is paid.
* One Z-Image block compiled as fast mode compiles it, replayed from a CUDA graph at both token
  counts: bf16, then torchao FP8 with each scaling, on ``quantize="fp8"``'s default filter and on
  every block linear, and the same with inductor's ``max_autotune`` GEMMs: time per block, the
  kernels, and the compile's cost.
* One Qwen-Image block the same way, at 1024² with true CFG batched (4,096 image and 64 text tokens,
  batch 2): bf16 and row-wise FP8 on both filters, the ceiling of its 0.75 target.

    python -m bench.probes.probe_fp8_block [--sections products,z-image,qwen-image]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any

import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import compiled_blocks as fast
from bcg_diffusion.features.quantization import (
    FP8,
    block_linears,
    default_filter,
    quantize_transformer,
    torchao_config,
)
from bcg_diffusion.patches import attention
from bench.probes.probe_block_kernels import COPIES, _inputs, _tflops, _time_products
from bench.probes.probe_fast_floor import graph_replay_ms, kernel_table, random_block, section

Z_DIM, Z_HEADS, Z_HIDDEN = 3840, 30, 10240
QWEN_DIM, QWEN_HIDDEN, QWEN_HEADS = 3072, 12288, 24
QWEN_TOKENS = {"1024² CFG": (4096, 64)}  # image tokens, text tokens; batch 2
Z_TOKENS = {"512²": 1088, "1024²": 4160}  # image tokens plus one 64-token caption


def _products(label: str, m: int, k: int, n: int) -> None:
    x, weights = _inputs(m, k, n)
    ms = _time_products(lambda i: F.linear(x, weights[i]))
    line = f"{label:28s} M={m:5d} K={k:5d} N={n:5d}: bf16 {ms * 1e3:7.1f} us ({_tflops(m, k, n, ms):5.0f} TFLOP/s)"
    x8 = x.to(torch.float8_e4m3fn)
    w8 = [w.to(torch.float8_e4m3fn).t() for w in weights]  # column-major, as _scaled_mm wants it
    scales = {
        "row-wise": (torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")),
        "per-tensor": (torch.ones((), device="cuda"), torch.ones((), device="cuda")),
    }
    for name, (scale_x, scale_w) in scales.items():
        try:
            ms8 = _time_products(
                lambda i, a=scale_x, b=scale_w: torch._scaled_mm(
                    x8, w8[i], a, b, out_dtype=torch.bfloat16, use_fast_accum=True
                )
            )
            line += f"; {name} {ms8 * 1e3:6.1f} us ({_tflops(m, k, n, ms8):5.0f}, {ms / ms8:.2f}x)"
        except Exception as exc:  # a probe: report and go on with the others
            line += f"; {name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    print(line, flush=True)


def matrix_products() -> None:
    torch.manual_seed(0)
    for size, m in Z_TOKENS.items():
        for label, k, n in (("q/k/v, out", Z_DIM, Z_DIM), ("gate, up", Z_DIM, Z_HIDDEN), ("down", Z_HIDDEN, Z_DIM)):
            _products(f"Z-Image {size} {label}", m, k, n)
    for label, k, n in (("q/k/v, out", QWEN_DIM, QWEN_DIM), ("mlp in", QWEN_DIM, QWEN_HIDDEN)):
        _products(f"Qwen-Image 1024² CFG {label}", 8192, k, n)
    _products("Qwen-Image 1024² CFG mlp out", 8192, QWEN_HIDDEN, QWEN_DIM)
    print(f"({COPIES} weight copies cycled per shape)")


def fp8_config(scaling: str) -> Any:
    """torchao's dynamic FP8 config: ``quantize="fp8"``'s for ``"row-wise"``, the same with one scale
    per tensor for ``"per-tensor"`` (process settings left alone, as ours)."""
    if scaling == "row-wise":
        return torchao_config(FP8)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor(), set_inductor_config=False)


Variant = tuple[str, str | None, Any, bool]  # label, FP8 scaling (None: bf16), filter, max-autotune

ALL_VARIANTS: list[Variant] = [
    ("bf16", None, None, False),
    ("row-wise, default filter", "row-wise", default_filter, False),
    ("row-wise, all block linears", "row-wise", block_linears, False),
    ("per-tensor, default filter", "per-tensor", default_filter, False),
    ("per-tensor, all block linears", "per-tensor", block_linears, False),
    ("row-wise, all, max-autotune", "row-wise", block_linears, True),
    ("per-tensor, all, max-autotune", "per-tensor", block_linears, True),
]


def time_block_variants(
    base: torch.nn.Module,
    inputs: dict[str, tuple[Any, ...]],
    processor_patches: tuple[Any, ...],
    variants: list[Variant],
    profiled: tuple[str, tuple[str, ...]],
) -> None:
    """Time ``base`` (a bf16 block on the GPU) compiled as fast mode compiles it, with fast mode's
    ``processor_patches``, replayed from a CUDA graph for each of ``inputs`` (label: positional
    arguments) in every variant; print the time per block and the relative error against bf16, and
    the kernel table of the ``profiled`` size for the labels it names."""
    references: dict[str, torch.Tensor] = {}
    for label, granularity, choose, autotune in variants:
        holder = torch.nn.Module()
        holder.block = copy.deepcopy(base)
        holder._repeated_blocks = [type(base).__name__]
        if granularity is not None:
            quantize_transformer(holder, fp8_config(granularity), choose(holder))
        patches, compile_patches = MethodPatches(), MethodPatches()
        for patch in processor_patches:
            patch.apply(holder.block, patches)
        torch._dynamo.reset()
        fast.compile_repeated_blocks(holder, compile_patches)
        settings = torch._inductor.config.patch(max_autotune=True) if autotune else contextlib.nullcontext()
        try:
            with torch.no_grad():
                started = time.perf_counter()
                with settings:
                    for args in inputs.values():
                        holder.block(*args)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
                for size, args in inputs.items():

                    def blocks(count: int = 10, args: tuple = args, block: Any = holder.block) -> Any:
                        for _ in range(count):
                            out = block(*args)
                        return out

                    ms, out = graph_replay_ms(blocks)
                    out = torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out
                    out = out.float()
                    if label == "bf16":
                        references[size] = out
                    error = (out - references[size]).norm() / references[size].norm()
                    print(
                        f"{label:32s} {size:10s}: {ms / 10 * 1e3:7.1f} us per block, relative error vs bf16 "
                        f"{error.item():.4f} (compile {compile_s:.1f} s)",
                        flush=True,
                    )
                    if size == profiled[0] and label in profiled[1]:
                        kernel_table(lambda args=args, block=holder.block: block(*args), f"{label}, {size}", top=14)
        finally:
            compile_patches.undo()
            patches.undo()
        del holder
        torch.cuda.empty_cache()


def zimage_blocks() -> None:
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = random_block(ZImageTransformerBlock(0, Z_DIM, Z_HEADS, Z_HEADS, 1e-5, qk_norm=True, modulation=True))
    inputs = {}
    for size, tokens in Z_TOKENS.items():
        angles = torch.rand(1, tokens, Z_DIM // Z_HEADS // 2, device="cuda") * 6.28
        inputs[size] = (
            torch.randn(1, tokens, Z_DIM, device="cuda", dtype=torch.bfloat16),
            None,
            torch.polar(torch.ones_like(angles), angles),
            torch.randn(1, 256, device="cuda", dtype=torch.bfloat16),
        )
    profiled = ("512²", ("bf16", "row-wise, all block linears", "per-tensor, all block linears"))
    time_block_variants(base, inputs, (attention.ZIMAGE_ATTENTION_PATCH,), ALL_VARIANTS, profiled)


def qwen_block_inputs(image: int, text: int, batch: int, device: str = "cuda") -> tuple[Any, ...]:
    """Positional arguments of ``QwenImageTransformerBlock.forward`` for ``batch`` prompts of ``text``
    tokens and ``image`` image tokens (no text mask, as the pipeline passes for one prompt length)."""
    head_dim = QWEN_DIM // QWEN_HEADS

    def frequencies(tokens: int) -> torch.Tensor:
        angles = torch.rand(tokens, head_dim // 2, device=device) * 6.28
        return torch.polar(torch.ones_like(angles), angles)

    return (
        torch.randn(batch, image, QWEN_DIM, device=device, dtype=torch.bfloat16),
        torch.randn(batch, text, QWEN_DIM, device=device, dtype=torch.bfloat16),
        None,
        torch.randn(batch, QWEN_DIM, device=device, dtype=torch.bfloat16),
        (frequencies(image), frequencies(text)),
    )


def qwen_blocks() -> None:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    from bcg_diffusion.patches.rope import QWEN_REAL_ROPE_PATCH

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = random_block(QwenImageTransformerBlock(QWEN_DIM, QWEN_HEADS, QWEN_DIM // QWEN_HEADS))
    inputs = {size: qwen_block_inputs(image, text, batch=2) for size, (image, text) in QWEN_TOKENS.items()}
    variants = ALL_VARIANTS[:3]  # row-wise only: per-tensor and max-autotune lost on Z-Image (run 67)
    profiled = ("1024² CFG", ("bf16", "row-wise, all block linears"))
    time_block_variants(base, inputs, (QWEN_REAL_ROPE_PATCH, attention.QWEN_ATTENTION_PATCH), variants, profiled)


SECTIONS = {
    "products": ("matrix products", matrix_products),
    "z-image": ("Z-Image block in bf16 and FP8", zimage_blocks),
    "qwen-image": ("Qwen-Image block in bf16 and FP8", qwen_blocks),
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    for name in parser.parse_args().sections.split(","):
        section(*SECTIONS[name])
