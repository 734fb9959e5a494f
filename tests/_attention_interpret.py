"""Our Triton attention kernels (``kernels/attention.py``: bf16/fp16 and FP8, both tile readers) in Triton's
interpreter, against PyTorch's attention in float32.

Run as a script by ``test_fp8_attention.py`` in a process of its own: ``TRITON_INTERPRET=1`` must be set before
Triton is imported. float16 inputs (the interpreter's bf16 is not reliable on this machine). Exits non-zero on
the first case out of tolerance; prints one line per case.
"""

from __future__ import annotations

import _interpreter  # noqa: F401 - first: Triton's interpreter on, its loop bounds read under NumPy 2.4
import torch
import torch.nn.functional as F

from bcg_diffusion.kernels import attention

TOKENS, HEAD_DIM = 150, 64  # a partial last block of keys for both kernels (64 and 128 keys a block)


def _run(query, key, value, reader: str, fp8: bool) -> torch.Tensor:  # noqa: ANN001
    attention._tma_fits = lambda *tensors: reader == "tma"
    out = torch.empty_like(query)
    if not fp8:
        attention._launch(query, key, value, value, out, (query,) * 3, HEAD_DIM**-0.5, fp8=False)
        return out
    q8, q_scales, k8, k_scales, v8, v_scales = attention.quantize_for_fp8_attention(query, key, value)
    value_view = v8[..., : key.shape[1]].permute(0, 3, 1, 2)  # as the FP8 operator views it
    attention._launch(q8, k8, v8, value_view, out, (q_scales, k_scales, v_scales), HEAD_DIM**-0.5, fp8=True)
    return out


def case(reader: str, fp8: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, TOKENS, 2, HEAD_DIM, generator=generator).half() for _ in range(3))
    out = _run(query, key, value, reader, fp8)
    expected = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (query, key, value)))
    error = (out.float() - expected.transpose(1, 2)).abs().mean().item()
    assert error < (0.02 if fp8 else 2e-3), (reader, fp8, error)  # FP8: its rounding of all four operands
    print(f"{reader}, {'fp8' if fp8 else 'fp16'}: mean error {error:.4f}")


if __name__ == "__main__":
    for reader in ("pointers", "tma"):
        case(reader, fp8=True)
    case("pointers", fp8=False)  # the bf16/fp16 kernel's configuration reads through pointers
    print("all cases within tolerance")
