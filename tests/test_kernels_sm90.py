"""Every Triton kernel of ours compiled for an H100/H200 (sm_90) on a CPU, and the instructions it rounds with.

Triton's interpreter (the ``_*_interpret.py`` scripts) runs a kernel's source on a CPU, but not Triton's
compiler: a kernel can pass there and fail to compile for the GPU, and the compiler can change arithmetic
the source spells out (it fused a product and the sum after it into one bf16 FMA in the block glue, one
rounding where PyTorch has two: found on the GPU in run 144). Here each kernel is compiled as the library
launches it (its host code run on CPU tensors, the launch recorded: ``_sm90.py``) to PTX and a cubin, and
the PTX is checked for what the kernel's contract depends on.
"""

from __future__ import annotations

import re

import pytest
import torch
from _sm90 import compile_sm90, launches, ptxas, registers_and_spills

from bcg_diffusion.kernels import activation_fp8, block_glue, group_norm, qk_prologue, untested_triton, vae_glue
from bcg_diffusion.kernels import attention as attention_kernels

pytestmark = pytest.mark.skipif(
    ptxas() is None or untested_triton() is not None,
    reason="needs Triton 3.6 with the ptxas its wheel bundles (the library keeps its kernels off under another "
    'release): pip install "triton==3.6.0"',
)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _count(ptx: str, instruction: str) -> int:
    """How often ``instruction`` (or its two-lane form, ``...x2``) occurs in ``ptx``."""
    return len(re.findall(re.escape(instruction) + r"(?:x2)?\s", ptx))


def _compiled(recorded: list) -> list[str]:
    """The PTX of each recorded launch, each also assembled to a cubin (ptxas accepted it)."""
    out = []
    for fn, args, kwargs in recorded:
        asm = compile_sm90(fn, args, kwargs)
        assert len(asm["cubin"]) > 0, fn.__name__
        out.append(asm["ptx"])
    return out


# -- attention's prologue ---------------------------------------------------------------------------------


def _prologue_launches(fp8: bool) -> list:
    batch, text_tokens, image_tokens, heads, head_dim = 2, 7, 13, 3, 128
    image = [torch.randn(batch, image_tokens, heads, head_dim, dtype=BF16) for _ in range(3)]
    text = [torch.randn(batch, text_tokens, heads, head_dim, dtype=BF16) for _ in range(3)]
    weights = [torch.randn(head_dim, dtype=BF16) for _ in range(4)]
    freqs = (torch.randn(image_tokens, head_dim // 2, 2), torch.randn(text_tokens, head_dim // 2, 2))
    lengths = (7, 4)
    from bcg_diffusion.kernels import _qk_prologue_triton as kernels

    query, key, value = image[0][:1], image[1][:1], image[2][:1]  # Z-Image's: no text stream
    z_freqs = torch.randn(1, image_tokens, head_dim // 2, 2)
    cos, sin = torch.randn(2, text_tokens + image_tokens, head_dim)  # FLUX's: torch's norm, (cos, sin)
    flux_freqs = ((cos[text_tokens:], sin[text_tokens:]), (cos[:text_tokens], sin[:text_tokens]))
    with launches(kernels, "qk_prologue") as recorded:
        if fp8:
            joint = qk_prologue._joint_fp8_empty(image[0], text_tokens, len(lengths))
            descales = (torch.tensor(0.02), torch.tensor(0.03))
            qk_prologue._launch(image, text, weights, [1e-6] * 4, freqs, lengths, joint[:3], fp8=(*descales, joint[3]))
            *z_outputs, largest = qk_prologue._norm_rope_fp8_empty(query)
            qk_prologue._launch((query, key, value), None, weights[:2], [1e-5] * 2, (z_freqs, None), [0],
                                (*z_outputs, None), fp8=(*descales, largest))  # fmt: skip
            joint = qk_prologue._joint_fp8_empty(image[0], text_tokens, 1)
            qk_prologue._launch(image, text, weights, [1e-6] * 4, flux_freqs, (text_tokens,), joint[:3],
                                fp8=(*descales, joint[3]), norm="torch")  # fmt: skip
            qk_prologue._launch((query, key, value), None, weights[:2], [1e-6] * 2, (flux_freqs[0], None), [0],
                                (*z_outputs, None), fp8=(*descales, largest), norm="torch")  # fmt: skip
        else:
            outputs = qk_prologue._joint_empty(image[0], text_tokens)
            qk_prologue._launch(image, text, weights, [1e-6] * 4, freqs, lengths, outputs)
            z_outputs = (torch.empty_like(query), torch.empty_like(key), None)
            qk_prologue._launch((query, key, None), None, weights[:2], [1e-5] * 2, (z_freqs, None), [0], z_outputs)
            qk_prologue._launch(image, text, weights, [1e-6] * 4, flux_freqs, (text_tokens,), outputs, norm="torch")
            qk_prologue._launch((query, key, None), None, weights[:2], [1e-6] * 2, (flux_freqs[0], None), [0],
                                z_outputs, norm="torch")  # fmt: skip
    return recorded


def test_the_attention_prologue_compiles_and_writes_float8_as_pytorch_rounds():
    """bf16 (Qwen-Image's joint tensors, Z-Image's norm and RoPE, FLUX's two): no float8, no atomics. FP8 (all): the
    query and key multiplied by their descales' reciprocals, each taken once with correct rounding
    (``div.rn``, as PyTorch's ``reciprocal``: one per store in the source, four in all, where dividing each
    element took 128) and cast to e4m3 rounding to nearest even, saturating (``cvt.rn.satfinite``,
    PyTorch's cast after its clamp); the value's largest magnitude folded in by an integer atomic max on
    its bits (not Triton's float atomic max, which older releases made drop NaN)."""
    for ptx in _compiled(_prologue_launches(fp8=False)):
        assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == 0 and "atom." not in ptx
    for ptx in _compiled(_prologue_launches(fp8=True)):  # Qwen-Image's joint tensors, Z-Image's, FLUX's
        assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") > 0 and 0 < _count(ptx, "div.rn.f32") <= 4
        assert "atom.global.gpu.acq_rel.max.s32" in ptx and "min.u32" not in ptx  # an integer max, no float one


# -- the block glue ---------------------------------------------------------------------------------------


def _block_glue_launches(enable_fp_fusion: bool = False) -> list:
    """Z-Image's three passes and Qwen-Image's three, at widths that mask (1,000) and do not (3,072); at 3,072,
    Qwen-Image's three again with per-token modulation (Qwen-Image-Edit-2511's)."""
    from bcg_diffusion.kernels import _block_glue_triton as kernels

    recorded = []
    for width in (1000, 3072):
        x, branch = (torch.randn(2, 5, width, dtype=BF16) for _ in range(2))
        weights = [torch.randn(width, dtype=BF16) for _ in range(2)]
        modulation = torch.randn(2, 3 * width, dtype=BF16)
        shift, scale, gate = (modulation[:, i * width : (i + 1) * width] for i in range(3))
        with launches(kernels, "block_glue_rows") as launched:
            for block, extra in ((block_glue._ZIMAGE, dict(branch_weight=weights[1], branch_eps=1e-6, weight=weights[0])),
                                 (block_glue._QWEN, dict(shift=shift))):  # fmt: skip
                norm = {k: v for k, v in extra.items() if k in ("weight", "shift")}
                residual = {k: v for k, v in extra.items() if k.startswith("branch_")}
                data, scales = block_glue._fp8_empty(x, FP8)
                block_glue._launch(x, block, eps=1e-6, scale=scale, data=data, scales=scales, **norm)
                block_glue._launch(x, block, branch=branch, gate=gate, stream=torch.empty_like(x), **residual)
                block_glue._launch(x, block, branch=branch, gate=gate, stream=torch.empty_like(x), eps=1e-6,
                                   scale=scale, data=data, scales=scales, **norm, **residual)  # fmt: skip
            if width == 3072:  # per token: [2B, C] modulation rows picked by an index
                index = torch.zeros(2, 5, dtype=torch.int32)
                twice = torch.randn(4, 3 * width, dtype=BF16)
                shift, scale, gate = (twice[:, i * width : (i + 1) * width] for i in range(3))
                data, scales = block_glue._fp8_empty(x, FP8)
                qwen = block_glue._QWEN
                block_glue._launch(x, qwen, eps=1e-6, scale=scale, shift=shift, data=data, scales=scales, index=index)
                block_glue._launch(x, qwen, branch=branch, gate=gate, stream=torch.empty_like(x), index=index)
                block_glue._launch(x, qwen, branch=branch, gate=gate, stream=torch.empty_like(x), eps=1e-6,
                                   scale=scale, shift=shift, data=data, scales=scales, index=index)  # fmt: skip
        recorded += launched
    for _, _, kwargs in recorded:
        kwargs["enable_fp_fusion"] = enable_fp_fusion
    return recorded


def test_the_block_glue_compiles_and_rounds_each_product_and_sum_as_pytorch_does():
    """Launched as the library launches it (``enable_fp_fusion=False``), no pass fuses a multiply and an add
    into one FMA: each rounds on its own, as PyTorch's operators do. Compiled with Triton's default, the
    gated residual's ``x + gate * branch`` becomes a bf16 FMA: the check sees the bug it guards against."""
    assert len(_block_glue_launches()) == 15
    for ptx in _compiled(_block_glue_launches()):
        # (the correctly rounded division's own fma.rn.ftz.f32 steps are libdevice's, not a contraction)
        assert _count(ptx, "fma.rn.bf16") == 0 and _count(ptx, "fma.rn.f32") == 0
        assert _count(ptx, "mul.rn.bf16") + _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") > 0
    fused = _compiled(_block_glue_launches(enable_fp_fusion=True))
    assert any(_count(ptx, "fma.rn.bf16") > 0 for ptx in fused)


# -- the rest: each compiles --------------------------------------------------------------------------------


def _activation_launches() -> list:
    from bcg_diffusion.kernels import _activation_fp8_triton as kernels

    with launches(kernels, "activation_fp8_rows") as recorded:
        for columns in (12288, 10240, 300):
            hidden, up = (torch.randn(4, columns, dtype=BF16) for _ in range(2))
            data, scale = activation_fp8._empty(hidden, FP8)
            activation_fp8._launch(hidden, data, scale)
            activation_fp8._launch(hidden, data, scale, up=up)
    return recorded


def _attention_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    from bcg_diffusion.kernels import _attention_triton as kernels

    recorded = []
    for reader in ("pointers", "tma"):
        monkeypatch.setattr(attention_kernels, "_tma_fits", lambda *tensors, reader=reader: reader == "tma")
        q, k, v = (torch.randn(1, 300, 3, 128, dtype=BF16) for _ in range(3))
        with launches(kernels, "attention_forward") as pointer, launches(kernels, "attention_forward_tma") as tma:
            attention_kernels._launch(q, k, v, v, torch.empty_like(q), (q, q, q), 0.088, fp8=False)
            q8, qs, k8, ks, v8, vs = attention_kernels.quantize_for_fp8_attention(q, k, v)
            value_view = v8[..., : k.shape[1]].permute(0, 3, 1, 2)  # as the FP8 operator views it
            attention_kernels._launch(q8, k8, v8, value_view, torch.empty_like(q), (qs, ks, vs), 0.088, fp8=True)
        recorded += pointer + tma
    return recorded


def _vae_launches() -> list:
    from bcg_diffusion.kernels import _group_norm_triton as norms
    from bcg_diffusion.kernels import _vae_glue_triton as glue

    x = torch.randn(1, 128, 12, 10, dtype=BF16).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(128, dtype=BF16), torch.randn(128, dtype=BF16)
    with (
        launches(norms, "group_partials") as partials,
        launches(norms, "group_moments") as moments,
        launches(norms, "group_apply") as apply,
        launches(glue, "residual_sum") as residual,
        launches(glue, "upsample_nearest2x") as upsample,
    ):
        group_norm._launch(x, torch.empty_like(x), 32, weight, bias, 1e-6, bias, True)
        vae_glue._launch_residual(x, x, bias, 2.0, torch.empty_like(x))
        out = torch.empty(1, 128, 24, 20, dtype=BF16).contiguous(memory_format=torch.channels_last)
        vae_glue._launch_upsample(x, out)
    return partials + moments + apply + residual + upsample


def test_no_kernel_the_library_launches_spills_registers(monkeypatch):
    """Assembled for sm_90a (``ptxas -v``), no kernel fast mode launches by default keeps values in local
    memory for want of registers: a kernel that spills reads and writes memory its bytes do not account
    for (attention's prologue at 32 and 64 rows of a program spilled up to 768 bytes a thread, and ran
    25% slower at 64, run 87). Not checked: our Triton attention's pointer reader, which spills: the bf16
    kernel's (an opt-in, 128 x 128 tiles) and the FP8 kernel's fallback for tensors its bulk copies cannot
    read (misaligned); the FP8 kernel's own reader is checked."""
    recorded = _prologue_launches(fp8=False) + _prologue_launches(fp8=True) + _block_glue_launches()
    recorded += _activation_launches() + _vae_launches()
    recorded += [r for r in _attention_launches(monkeypatch) if r[0].__name__ == "attention_forward_tma"]
    assert len(recorded) == 8 + 15 + 6 + 5 + 1
    spilling = {}
    for (fn, _, kwargs), ptx in zip(recorded, _compiled(recorded)):
        registers, stores, loads = registers_and_spills(ptx)
        if stores or loads:
            spilling[f"{fn.__name__} {kwargs.get('num_warps')} warps"] = (registers, stores, loads)
    assert not spilling, spilling


def test_every_other_kernel_compiles(monkeypatch):
    """The FP8 feed-forward's activation (GELU and SwiGLU), attention (bf16 and FP8, both tile readers), the
    VAE's group norm (its three kernels) and glue: each compiles for sm_90 as the library launches it."""
    recorded = _activation_launches() + _attention_launches(monkeypatch) + _vae_launches()
    assert len(recorded) == 6 + 4 + 5
    assert len(_compiled(recorded)) == len(recorded)
