"""GPU probe: what is left inside one fast-mode Z-Image block, measured at full width (random weights).

Answered (run 42, `bench/results/2026-12-01-h200/probe-block-kernels-run42.log`): cuBLAS runs a block's bf16 GEMMs at 650–685 TFLOP/s; fusing q/k/v or gate/up and inductor's Triton templates gain nothing; row-wise FP8 would be 1.2–1.9× faster; diffusers' complex RoPE stays.

* The block's matrix products (``F.linear`` at 1,088 tokens: 1,024 image + one 64-token caption;
  1,024 for the noise refiner) replayed from a CUDA graph, each cycling through eight weight copies so
  that no weight stays in L2: time and TFLOP/s per shape, next to the same product with the query, key
  and value (and the two gate projections) fused into one, inductor's Triton templates
  (``max-autotune``) for the two output-width-3,840 shapes, and row-wise FP8 (``torch._scaled_mm``,
  activations already quantized: an upper bound on what FP8 would give).
* One whole block compiled as fast mode compiles it (cuDNN attention), with Z-Image's RoPE as diffusers
  writes it (complex multiply: an eager kernel inductor falls back to) against RoPE in real arithmetic,
  fused as inductor likes and applied per sequence slice: replayed time per block and the kernels.

    python -m bench.probes.probe_block_kernels
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import compiled_blocks as fast
from bcg_diffusion.patches import attention
from bench.probes.probe_fast_floor import graph_replay_ms, kernel_table, random_block, section

DIM, HEADS, HIDDEN = 3840, 30, 10240
TOKENS, IMAGE_TOKENS = 1088, 1024
COPIES = 8  # weight copies per shape: 8 x 79 MB for the largest, well past the 60 MB of L2


def _tflops(m: int, k: int, n: int, ms: float) -> float:
    return 2 * m * k * n / (ms * 1e-3) / 1e12


def _time_products(product: Callable[[int], torch.Tensor]) -> float:
    """ms per product: ``product(i)`` for each weight copy i, replayed from one graph."""

    def all_copies() -> torch.Tensor:
        for i in range(COPIES):
            out = product(i)
        return out

    return statistics.median(graph_replay_ms(all_copies)[0] for _ in range(3)) / COPIES


def _inputs(m: int, k: int, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return x, [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(COPIES)]


def _cublas_and_fp8(label: str, m: int, k: int, n: int) -> None:
    x, weights = _inputs(m, k, n)
    ms = _time_products(lambda i: F.linear(x, weights[i]))
    line = f"{label:24s} M={m} K={k} N={n}: cuBLAS {ms * 1e3:7.1f} us ({_tflops(m, k, n, ms):5.0f} TFLOP/s)"
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        try:
            x8 = x.to(fp8)
            w8 = [w.to(fp8).t() for w in weights]  # column-major, as _scaled_mm wants its second operand
            scale_x, scale_w = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
            ms8 = _time_products(lambda i: torch._scaled_mm(x8, w8[i], scale_x, scale_w, out_dtype=torch.bfloat16))
            line += f"; FP8 row-wise {ms8 * 1e3:7.1f} us ({_tflops(m, k, n, ms8):5.0f})"
        except Exception as exc:  # a probe: report and go on with the other shapes
            line += f"; FP8 failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    print(line, flush=True)


def _autotuned(label: str, m: int, k: int, n: int) -> None:
    x, weights = _inputs(m, k, n)
    torch._dynamo.reset()
    tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    for w in weights[:2]:
        tuned(x, w)  # autotunes here, outside the graph capture
    ms = _time_products(lambda i: tuned(x, weights[i]))
    print(f"max-autotune {label:11s} M={m} K={k} N={n}: {ms * 1e3:7.1f} us ({_tflops(m, k, n, ms):5.0f})")
    kernel_table(lambda: tuned(x, weights[0]), f"max-autotune {label}", top=3)


def matmul_shapes() -> None:
    torch.manual_seed(0)
    shapes = [
        ("q / k / v, out", TOKENS, DIM, DIM),
        ("w1 / w3 (gate, up)", TOKENS, DIM, HIDDEN),
        ("w2 (down)", TOKENS, HIDDEN, DIM),
        ("q+k+v fused", TOKENS, DIM, 3 * DIM),
        ("w1+w3 fused", TOKENS, DIM, 2 * HIDDEN),
        ("refiner q / k / v, out", IMAGE_TOKENS, DIM, DIM),
        ("refiner w2", IMAGE_TOKENS, HIDDEN, DIM),
    ]
    for shape in shapes:
        _cublas_and_fp8(*shape)
    for shape in (("out", TOKENS, DIM, DIM), ("w2", TOKENS, HIDDEN, DIM)):
        _autotuned(*shape)


def _rotate_real(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's RoPE (``x`` ``[B, S, H, D]``, complex ``freqs_cis`` ``[B, S, D/2]``) in real arithmetic."""
    pairs = x.float().unflatten(-1, (-1, 2))
    freqs = torch.view_as_real(freqs_cis).unsqueeze(2)
    real, imag, cos, sin = pairs[..., 0], pairs[..., 1], freqs[..., 0], freqs[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(3).type_as(x)


def _rotate_real_sliced(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate_real` on the image and caption rows apart, joined by one ``cat``."""
    parts = [(x[:, :IMAGE_TOKENS], freqs_cis[:, :IMAGE_TOKENS]), (x[:, IMAGE_TOKENS:], freqs_cis[:, IMAGE_TOKENS:])]
    return torch.cat([_rotate_real(p, f) for p, f in parts], dim=1)


def _processor_call(rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A ``__call__`` for ``ZSingleStreamAttnProcessor`` doing what diffusers' does (no mask, cuDNN
    dispatch as fast mode's patch) with ``rope`` for the rotation."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        query, key, value = (
            linear(hidden_states).unflatten(-1, (attn.heads, -1)) for linear in (attn.to_q, attn.to_k, attn.to_v)
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key = rope(query, freqs_cis), rope(key, freqs_cis)
        out = attention.dispatch_attention_fn(query, key, value, attn_mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3).to(query.dtype))

    return __call__


def zimage_block_rope() -> None:
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock, ZSingleStreamAttnProcessor

    torch.manual_seed(0)
    with torch.device("cuda"):
        block = random_block(ZImageTransformerBlock(0, DIM, HEADS, HEADS, 1e-5, qk_norm=True, modulation=True))
    x = torch.randn(1, TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(1, TOKENS, DIM // HEADS // 2, device="cuda") * 6.28
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    adaln = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    holder = torch.nn.Module()
    holder.block = block
    holder._repeated_blocks = ["ZImageTransformerBlock"]
    original = block.attention.processor
    variants = {
        "complex (diffusers, now)": None,
        "real, fused by inductor": _rotate_real,
        "real, per image/caption slice": _rotate_real_sliced,
    }
    outputs = {}
    for name, rope in variants.items():
        processor_patches = MethodPatches()
        if rope is None:
            attention.ZIMAGE_ATTENTION_PATCH.apply(block, processor_patches)
        else:
            cls = type(
                "ZSingleStreamAttnProcessor", (ZSingleStreamAttnProcessor,), {"__call__": _processor_call(rope)}
            )
            processor_patches.replace(block.attention, "processor", cls())
        torch._dynamo.reset()
        compile_patches = MethodPatches()
        fast.compile_repeated_blocks(holder, compile_patches)
        try:

            def blocks(count: int = 10) -> torch.Tensor:
                for _ in range(count):
                    out = block(x, None, freqs_cis, adaln)
                return out

            with torch.no_grad():
                times = [graph_replay_ms(blocks)[0] / 10 for _ in range(3)]
                outputs[name] = block(x, None, freqs_cis, adaln).float()
                print(f"Z-Image block, RoPE {name}: {statistics.median(times) * 1e3:.1f} us per block ({times})")
                kernel_table(lambda: blocks(1), f"block, RoPE {name}", top=16)
        finally:
            compile_patches.undo()
            processor_patches.undo()
    assert block.attention.processor is original
    reference = outputs.pop("complex (diffusers, now)")
    for name, out in outputs.items():
        print(f"RoPE {name} against complex: max abs difference {(out - reference).abs().max().item():.4f}")


if __name__ == "__main__":
    section("Z-Image block: RoPE", zimage_block_rope)
    section("matrix products", matmul_shapes)
