"""Run 155 (2026-12-05): which arithmetic the FP8 prologue's query and key bytes follow.

A tidied copy of the script run (the same arithmetic and cases). Builds the inputs of the two FP8-prologue
tests in tests/test_attention_kernels_cuda.py (fp16, 4 rows, 1,024 image tokens; bf16, Qwen-Image 1024² CFG
batch), and for each element whose bytes differ from ``cudnn_fp8_attention.quantize`` of the bf16
prologue's output prints the values, then how many elements differ from each candidate arithmetic (a
reciprocal's product, double rounding through fp16 or bf16, e4m3 subnormals flushed). Run from the repository root: ``python <this file>``.
"""

import torch

from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8
from bcg_diffusion.kernels import qk_prologue


def frequencies(*shape: int) -> torch.Tensor:
    angles = torch.rand(*shape, device="cuda") * 6.28
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


CASES = ((torch.float16, 4, 77, 1024, 4, (50, 77)), (torch.bfloat16, 2, 205, 4096, 24, (160, 205)))
for dtype, batch, text_tokens, image_tokens, heads, lengths in CASES:
    torch.manual_seed(0)
    image, text = (
        [torch.randn(batch, tokens, heads, 128, device="cuda", dtype=dtype) for _ in range(3)]
        for tokens in (image_tokens, text_tokens)
    )
    weights = [(torch.randn(128, device="cuda") * 0.5 + 1).to(dtype) for _ in range(4)]
    freqs = (frequencies(image_tokens, 64), frequencies(text_tokens, 64))
    bounds = (cudnn_fp8.rms_norm_bound(weights[0::2], 128), cudnn_fp8.rms_norm_bound(weights[1::2], 128))
    descales = [cudnn_fp8.descale(bound) for bound in bounds]
    plain = qk_prologue.joint_qkv(image, text, weights, [1e-6] * 4, freqs, lengths)
    joint = qk_prologue.joint_qkv_fp8(image, text, weights, [1e-6] * 4, freqs, lengths, *descales)
    for name, got, bf16, descale in (
        ("q", joint.query, plain[0], descales[0]),
        ("k", joint.key, plain[1], descales[1]),
    ):
        for g, x in zip(*(qk_prologue.group_slices(t, lengths, text_tokens) for t in (got, bf16))):
            expected = cudnn_fp8.quantize(x, descale)
            bad = g.view(torch.uint8) != expected.view(torch.uint8)
            count = int(bad.sum())
            print(dtype, name, "differ", count, "of", g.numel(), "descale", descale.item())
            if count:
                print("  x", x[bad].float()[:8].tolist())
                print("  x/d", (x[bad].float() / descale)[:8].tolist())
                print("  kernel", g[bad][:8].float().tolist(), "torch", expected[bad][:8].float().tolist())
                scaled = x.float() / descale
                candidates = {
                    "mul reciprocal": (x.float() * (1 / descale)).clamp(-448, 448).to(torch.float8_e4m3fn),
                    "via fp16": scaled.clamp(-448, 448).half().to(torch.float8_e4m3fn),
                    "via bf16": scaled.clamp(-448, 448).bfloat16().to(torch.float8_e4m3fn),
                    "ftz": torch.where(scaled.abs() < 2**-6, 0.0, scaled).clamp(-448, 448).to(torch.float8_e4m3fn),
                }
                for label, candidate in candidates.items():
                    differ = int((candidate.view(torch.uint8) != g.view(torch.uint8)).sum())
                    print("  hypothesis", label, "differs in", differ)
