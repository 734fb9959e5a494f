"""Rotary embeddings in real arithmetic, for fast mode (compiled blocks).

Qwen-Image applies RoPE by viewing query and key as complex numbers and multiplying them by complex
frequencies. Inductor generates no code for complex operators: it falls back to eager kernels, which
also split the fusion of the surrounding norm and cast. The same rotation in real arithmetic,
``(a + ib)(c + id) = (ac - bd) + i(ad + bc)`` in float32, compiles into the fused kernel. Results
match the original up to float32 rounding of the products (tested against it). Only fast mode uses
it, and only inside the accelerated model (:mod:`bcg_diffusion.patches.scoped`).
"""

from __future__ import annotations

import torch

from .scoped import ProcessorPatch

__all__ = ["QWEN_REAL_ROPE_PATCH", "apply_rotary_emb_qwen", "rotate_pairs"]


def apply_rotary_emb_qwen(
    x: torch.Tensor,
    freqs_cis: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    use_real: bool = True,
    use_real_unbind_dim: int = -1,
) -> torch.Tensor:
    """Same contract as diffusers' function of that name; the complex path (``use_real=False``, the one
    Qwen-Image uses) in real arithmetic, the other paths delegated to the original.

    ``x``: ``[B, S, H, D]``; ``freqs_cis``: complex ``[S, D/2]``. Returns ``x`` rotated, in ``x``'s dtype.
    """
    if use_real:
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen as original

        return original(x, freqs_cis, use_real, use_real_unbind_dim)
    return rotate_pairs(x, torch.view_as_real(freqs_cis))


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x`` (``[B, S, H, D]``) rotated pairwise by ``freqs``, the real view (``[S, D/2, 2]``: cosine,
    sine) of the complex frequencies: what :func:`apply_rotary_emb_qwen` computes, for callers that
    slice the frequencies first (a slice of a complex tensor is not compiled by inductor)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    freqs = freqs.unsqueeze(1)  # [S, 1, D/2, 2], broadcast over heads
    cos, sin = freqs[..., 0], freqs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


QWEN_REAL_ROPE_PATCH = ProcessorPatch(
    name="qwenimage.apply_rotary_emb_qwen (real arithmetic)",
    processor_class="QwenDoubleStreamAttnProcessor2_0",
    replacements={"apply_rotary_emb_qwen": apply_rotary_emb_qwen},
)
