"""The attention prologue's Triton kernel in Triton's interpreter, against its plain-PyTorch reference.

Run as a script by ``test_qk_prologue.py`` in a process of its own: ``TRITON_INTERPRET=1`` must be set
before Triton is imported, which inductor may already have done in the test process. Exits non-zero on
the first case out of tolerance; prints one line per case. fp16 and fp32 only (the interpreter's bf16
is not reliable on this machine).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402 - after the environment Triton reads on import
from _fp8_interpret import close_fp8  # noqa: E402

from bcg_diffusion.kernels import cudnn_fp8_attention, qk_prologue  # noqa: E402

# float32: the mean of squares sums in another order (a few ulps); half precision: at most one step of
# the dtype where a float32 difference crosses a rounding boundary.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}
CONFIGS = (
    qk_prologue._CONFIG,
    (32, 4),
    (8, 1),
)  # the library's; its previous one; one whose tiles split tokens unevenly


def strided(batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str) -> list[torch.Tensor]:
    """Query, key and value ``[B, S, H, D]`` as a linear's outputs may be viewed: slices of one wide
    tensor (a fused QKV projection), or heads-first memory seen tokens-first."""
    if layout == "slices":
        wide = torch.randn(batch, tokens, heads, 3 * head_dim + 2).to(dtype)
        return [wide[..., i * head_dim : (i + 1) * head_dim] for i in range(3)]
    return [torch.randn(batch, heads, tokens, head_dim).to(dtype).transpose(1, 2) for _ in range(3)]


def frequencies(*shape: int) -> torch.Tensor:
    angles = torch.rand(*shape) * 6.28
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def check(label: str, got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    worst = 0.0
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (label, g.shape, e.shape, g.dtype)
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
        worst = max(worst, (g.float() - e.float()).abs().max().item())
    print(f"{label}: max abs error {worst:.3g}", flush=True)


def joint_case(dtype: torch.dtype, lengths: tuple[int, ...], rows: int, norm: bool, rope: bool, config) -> None:
    batch, text_tokens, image_tokens, heads, head_dim = rows * len(lengths), max(lengths) + 2, 13, 3, 16
    image = strided(batch, image_tokens, heads, head_dim, dtype, "slices")
    text = strided(batch, text_tokens, heads, head_dim, dtype, "heads-first")
    weights = [torch.randn(head_dim).to(dtype) if norm else None for _ in range(4)]
    eps = [1e-6, 1e-5, 1e-6, 1e-3]
    freqs = (
        (frequencies(image_tokens, head_dim // 2), frequencies(text_tokens + 3, head_dim // 2))
        if rope
        else (None, None)
    )
    expected = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, lengths)
    outputs = [torch.full_like(e, float("nan")) for e in expected]
    normed = [w for w in weights if w is not None]
    qk_prologue._launch(image, text, normed, eps, freqs, lengths, outputs, config)
    label = f"joint {str(dtype)[6:]} lengths {lengths} rows {rows} norm {norm} rope {rope} config {config}"
    got, want = [], []
    for out, ref in zip(outputs, expected):
        got += qk_prologue.group_slices(out, lengths, text_tokens)
        want += qk_prologue.group_slices(ref, lengths, text_tokens)
        for g, length in enumerate(lengths):  # nothing written before a group's valid text
            assert out[g * rows : (g + 1) * rows, : text_tokens - length].isnan().all(), label
    check(label, got, want, dtype)


def joint_fp8_case(dtype: torch.dtype, lengths: tuple[int, ...], rows: int, config, saturate: bool = False) -> None:
    """The query and key quantized by their norms' bound (``saturate``: by a tenth of it, so that most
    elements saturate at ±448), the value's largest magnitude per group."""
    batch, text_tokens, image_tokens, heads, head_dim = rows * len(lengths), max(lengths) + 2, 13, 3, 16
    image = strided(batch, image_tokens, heads, head_dim, dtype, "slices")
    text = strided(batch, text_tokens, heads, head_dim, dtype, "heads-first")
    for group in range(len(lengths)):  # each group's largest value somewhere else: text, image
        stream = text if group % 2 else image
        stream[2][group * rows, group % 3, 1, 2] = 40.0 + group
    weights = [torch.randn(head_dim).to(dtype) for _ in range(4)]
    eps = [1e-6, 1e-5, 1e-6, 1e-3]
    freqs = (frequencies(image_tokens, head_dim // 2), frequencies(text_tokens + 3, head_dim // 2))
    bound = cudnn_fp8_attention.rms_norm_bound(weights, head_dim) / (10 if saturate else 1)
    descales = (cudnn_fp8_attention.descale(bound), cudnn_fp8_attention.descale(bound * 2))
    expected = qk_prologue.reference_joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales)
    outputs = [torch.full_like(e, float("nan")) for e in expected[:3]]
    largest = torch.zeros(len(lengths))
    qk_prologue._launch(image, text, weights, eps, freqs, lengths, outputs, config, fp8=(*descales, largest))
    label = f"joint fp8 {str(dtype)[6:]} lengths {lengths} rows {rows} config {config} saturate {saturate}"
    assert outputs[0].dtype == outputs[1].dtype == torch.float8_e4m3fn, label
    equal, saturated = [], 0
    for out, ref in zip(outputs[:2], expected[:2]):
        for got, want in zip(*(qk_prologue.group_slices(t, lengths, text_tokens) for t in (out, ref))):
            equal.append(close_fp8(got, want))
            saturated += int((got.float().abs() == 448).sum())
    assert min(equal) > 0.9, (label, equal)
    assert (saturated > 0) == saturate, (label, saturated)  # past the bound: ±448, never NaN
    for got, want in zip(*(qk_prologue.group_slices(t, lengths, text_tokens) for t in (outputs[2], expected[2]))):
        assert torch.equal(got, want), label  # the value is copied
    assert torch.equal(largest, expected[3]), (label, largest, expected[3])
    print(f"{label}: {min(equal):.4%} of float8 bytes equal at least", flush=True)


def norm_rope_fp8_case(dtype: torch.dtype, config) -> None:
    batch, tokens, heads, head_dim = 2, 11, 5, 32
    query, key, value = strided(batch, tokens, heads, head_dim, dtype, "slices")  # the value: read only
    value[1, 7, 3, 2] = -40.0  # its largest magnitude, negative
    weights = [torch.randn(head_dim).to(dtype) for _ in range(2)]
    eps = [1e-5, 1e-6]
    freqs = frequencies(tokens, head_dim // 2)
    descales = [cudnn_fp8_attention.descale(cudnn_fp8_attention.rms_norm_bound([w], head_dim)) for w in weights]
    expected = qk_prologue.reference_norm_rope_fp8(query, key, value, weights, eps, freqs, *descales)
    *outputs, largest = qk_prologue._norm_rope_fp8_empty(query)
    largest.zero_()
    qk_prologue._launch((query, key, value), None, weights, eps, (freqs, None), [0], (*outputs, None), config,
                        fp8=(*descales, largest))  # fmt: skip
    equal = min(close_fp8(got, want) for got, want in zip(outputs, expected))
    assert equal > 0.9, equal
    assert torch.equal(largest, expected[2]) and float(largest) == 40.0, (largest, expected[2])
    value[0, 3, 1, 5] = float("nan")  # a NaN in the value is its largest magnitude, as PyTorch's amax says
    largest.zero_()
    qk_prologue._launch((query, key, value), None, weights, eps, (freqs, None), [0], (*outputs, None), config,
                        fp8=(*descales, largest))  # fmt: skip
    assert largest.isnan(), largest
    print(f"norm_rope fp8 {str(dtype)[6:]} config {config}: {equal:.4%} of float8 bytes equal at least", flush=True)


def norm_rope_case(dtype: torch.dtype, freqs_batch: int | None, config) -> None:
    batch, tokens, heads, head_dim = 2, 11, 5, 32
    query, key, _ = strided(batch, tokens, heads, head_dim, dtype, "slices")
    weights = [torch.randn(head_dim).to(dtype) for _ in range(2)]
    eps = [1e-5, 1e-6]
    shape = (tokens, head_dim // 2) if freqs_batch is None else (freqs_batch, tokens, head_dim // 2)
    freqs = frequencies(*shape)
    expected = qk_prologue.reference_norm_rope(query, key, weights, eps, freqs)
    outputs = [torch.full_like(e, float("nan")) for e in expected]
    qk_prologue._launch((query, key, None), None, weights, eps, (freqs, None), [0], (*outputs, None), config)
    check(f"norm_rope {str(dtype)[6:]} freqs {tuple(freqs.shape)} config {config}", outputs, list(expected), dtype)


def real_frequencies(tokens: int, head_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[S, D]`` in diffusers' real form: FLUX's (each pair's two entries equal, a rotation),
    or any values (the kernel follows diffusers' arithmetic either way)."""
    if not interleaved:
        return torch.randn(tokens, head_dim), torch.randn(tokens, head_dim)
    angles = (torch.rand(tokens, head_dim // 2) * 6.28).repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def flux_norm_rope_case(dtype: torch.dtype, config, interleaved: bool) -> None:
    """FLUX's single-stream attention: ``torch.nn.RMSNorm``'s rounding, ``(cos, sin)`` frequencies."""
    batch, tokens, heads, head_dim = 2, 11, 5, 32
    query, key, value = strided(batch, tokens, heads, head_dim, dtype, "slices")
    weights = [torch.randn(head_dim).to(dtype) for _ in range(2)]
    eps = [1e-6, 1e-5]
    freqs = real_frequencies(tokens + 2, head_dim, interleaved)
    expected = qk_prologue.reference_norm_rope(query, key, weights, eps, freqs, norm="torch")
    outputs = [torch.full_like(e, float("nan")) for e in expected]
    qk_prologue._launch((query, key, None), None, weights, eps, (freqs, None), [0], (*outputs, None), config,
                        norm="torch")  # fmt: skip
    label = f"flux norm_rope {str(dtype)[6:]} interleaved {interleaved} config {config}"
    check(label, outputs, list(expected), dtype)
    if interleaved:  # a rotation: the query's and key's norms bound them, as FP8 attention needs
        descales = [cudnn_fp8_attention.descale(cudnn_fp8_attention.rms_norm_bound([w], head_dim)) for w in weights]
        want = qk_prologue.reference_norm_rope_fp8(query, key, value, weights, eps, freqs, *descales, norm="torch")
        *got, largest = qk_prologue._norm_rope_fp8_empty(query)
        largest.zero_()
        qk_prologue._launch((query, key, value), None, weights, eps, (freqs, None), [0], (*got, None), config,
                            fp8=(*descales, largest), norm="torch")  # fmt: skip
        equal = min(close_fp8(g, w) for g, w in zip(got, want))
        assert equal > 0.9 and torch.equal(largest, want[2]), (label, equal, largest, want[2])
        assert not any((g.float().abs() == 448).any() for g in got), label  # within the bound: none saturates
        print(f"{label} fp8: {equal:.4%} of float8 bytes equal at least", flush=True)


def flux_joint_case(dtype: torch.dtype, config) -> None:
    """FLUX's double-stream attention: one group, text first, each stream's ``(cos, sin)`` a slice of the
    joint sequence's."""
    batch, text_tokens, image_tokens, heads, head_dim = 2, 6, 13, 3, 16
    image = strided(batch, image_tokens, heads, head_dim, dtype, "slices")
    text = strided(batch, text_tokens, heads, head_dim, dtype, "slices")
    weights = [torch.randn(head_dim).to(dtype) for _ in range(4)]
    eps = [1e-6] * 4
    cos, sin = real_frequencies(text_tokens + image_tokens, head_dim, interleaved=True)
    freqs = ((cos[text_tokens:], sin[text_tokens:]), (cos[:text_tokens], sin[:text_tokens]))
    lengths = (text_tokens,)
    expected = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, lengths, norm="torch")
    outputs = [torch.full_like(e, float("nan")) for e in expected]
    qk_prologue._launch(image, text, weights, eps, freqs, lengths, outputs, config, norm="torch")
    check(f"flux joint {str(dtype)[6:]} config {config}", outputs, list(expected), dtype)
    descales = [cudnn_fp8_attention.descale(cudnn_fp8_attention.rms_norm_bound(weights, head_dim))] * 2
    want = qk_prologue.reference_joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales, norm="torch")
    got = [torch.full_like(e, float("nan")) for e in want[:3]]
    largest = torch.zeros(1)
    qk_prologue._launch(image, text, weights, eps, freqs, lengths, got, config, fp8=(*descales, largest),
                        norm="torch")  # fmt: skip
    equal = min(close_fp8(g, w) for g, w in zip(got[:2], want[:2]))
    assert equal > 0.9 and torch.equal(got[2], want[2]) and torch.equal(largest, want[3]), (equal, largest)
    print(f"flux joint fp8 {str(dtype)[6:]} config {config}: {equal:.4%} of float8 bytes equal at least", flush=True)


def main() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for config in CONFIGS:
            joint_case(dtype, (7, 4), 2, True, True, config)  # two groups of two rows, different lengths
            joint_case(dtype, (5,), 1, True, True, config)  # one group, all text valid but the padding
        joint_case(dtype, (3, 6), 1, False, True, CONFIGS[0])  # no norms
        joint_case(dtype, (2, 1, 6), 1, True, False, CONFIGS[0])  # no RoPE, three groups
        for freqs_batch in (None, 1, 2):
            norm_rope_case(dtype, freqs_batch, CONFIGS[1])
        for config in CONFIGS:
            norm_rope_fp8_case(dtype, config)
            joint_fp8_case(dtype, (7, 4), 2, config)
            joint_fp8_case(dtype, (5, 3, 6), 1, config, saturate=config == CONFIGS[0])
            flux_norm_rope_case(dtype, config, interleaved=True)
            flux_joint_case(dtype, config)
        flux_norm_rope_case(dtype, CONFIGS[0], interleaved=False)
    print("all cases within tolerance")


if __name__ == "__main__":
    main()
