"""Our attention kernels and fast mode's FP8 attention on a GPU (marker: cuda).

* The Triton kernels (bf16 and FP8, both tile readers) against float32 attention at the shapes fast
  mode meets (odd token counts included), and deterministic: the same bytes on every call.
* The GELU epilogue computes diffusers' tanh GELU.
* The activation-to-FP8 kernels (``kernels/activation_fp8.py``) against their references (diffusers' GELU or
  Z-Image's SwiGLU, then torchao's row scales and cast) at the models' feed-forward widths, and deterministic.
* The block-glue kernels (``kernels/block_glue.py``) against their references (Z-Image's norms, modulation
  and gated residuals, then torchao's row scales and cast) at Z-Image's width, and deterministic.
* cuDNN's FP8 attention (``kernels/cudnn_fp8_attention.py``, where nvidia-cudnn-frontend is installed)
  against its float32 reference and float32 attention, odd token counts included, and deterministic.
* Attention's prologue writing cuDNN's FP8 inputs (``joint_qkv_fp8``, ``norm_rope_fp8``): its bf16
  outputs quantized by PyTorch but for a rare element, the value's largest magnitude PyTorch's; Qwen-Image's processor with
  it compiled whole, near the bf16 prologue quantized before attention, its CUDA graph replaying it.
* ``accelerate(pipe, mode="fast", attention="fp8")`` on full-size Z-Image (tiny models have heads of
  16, which the kernels do not take), with each FP8 kernel: the attention modules use it, the graphs
  give the same bytes as the compiled blocks without graphs, and the image stays near bf16 fast mode's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import cuda_pipeline, qwen_attention_on_gpu, run_case
from _checks import compiled_and_replayed

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.features.fp8_attention import choose
from bcg_diffusion.kernels import activation_fp8, block_glue
from bcg_diffusion.kernels import attention as kernels
from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8
from bcg_diffusion.patches.attention import KERNEL_ATTRIBUTE
from bcg_diffusion.patches.gelu import gelu_in_epilogue

pytestmark = pytest.mark.cuda

needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs compute capability 8.9+",
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


@needs_fp8
@pytest.mark.parametrize("reader", ["tma", "pointers"])
@pytest.mark.parametrize("shape", [(1, 1000, 3, 128), (2, 4136, 2, 128), (1, 333, 4, 64)], ids=str)
def test_kernels_match_float32_attention_and_are_deterministic(shape, reader, monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for kind in ("bf16", "fp8"):
        monkeypatch.setitem(kernels._CONFIGS, kind, (reader, *kernels._CONFIGS[kind][1:]))
    reference = _reference(q, k, v)
    for fn, bound in ((kernels.attention, 0.01), (kernels.fp8_attention, 0.08)):
        out = fn(q, k, v)
        assert out.shape == shape and out.dtype == torch.bfloat16 and out.is_contiguous()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        assert error < bound, (fn.__name__, error)
        assert torch.equal(fn(q, k, v), out), f"{fn.__name__} is not deterministic"
    # Strided inputs (a slice of a wider tensor) read in place.
    wide = torch.randn(shape[0], shape[1], shape[2], 2 * shape[3], device="cuda", dtype=torch.bfloat16)
    sliced = wide[..., : shape[3]]
    error = (kernels.attention(sliced, k, v).float() - _reference(sliced, k, v)).norm() / reference.norm()
    assert error < 0.01


def _cudnn_fp8_reason() -> str | None:
    return cudnn_fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no GPU"


@pytest.mark.parametrize("shape", [(1, 4160, 24, 128), (1, 4133, 2, 128), (2, 1000, 3, 128)], ids=str)
def test_cudnn_fp8_attention_matches_its_reference_and_is_deterministic(shape):
    reason = _cudnn_fp8_reason()
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    weight = torch.rand(128, device="cuda") + 0.5
    q, k = (F.normalize(torch.randn(shape, device="cuda"), dim=-1) * 128**0.5 * weight for _ in range(2))
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 4
    bound = cudnn_fp8.rms_norm_bound([weight], 128)
    out = cudnn_fp8.attention(q, k, v, bound, bound)
    assert out.shape == shape and out.dtype == torch.bfloat16
    error = ((out.float() - _reference(q, k, v)).norm() / _reference(q, k, v).norm()).item()
    assert error < 0.1, error
    assert torch.equal(cudnn_fp8.attention(q, k, v, bound, bound), out), "not deterministic"
    # The kernel alone against its float32 reference, on the same FP8 inputs.
    quantized = [cudnn_fp8._quantize(t, b) for t, b in ((q, bound), (k, bound), (v, None))]
    scales = cudnn_fp8.pack_scales(*(d for _, d in quantized))
    inputs = [t for t, _ in quantized]
    kernel = torch.ops.bcg_diffusion.cudnn_fp8_attention(*inputs, scales, 128**-0.5).float()
    expected = cudnn_fp8.reference(*inputs, scales, 128**-0.5).float()
    assert ((kernel - expected).norm() / expected.norm()).item() < 0.05
    assert cudnn_fp8.refusals() == {}, "cuDNN refused a shape: its calls computed the reference, not the kernel"


def test_gelu_epilogue_is_diffusers_tanh_gelu():
    from diffusers.models.activations import GELU

    torch.manual_seed(0)
    module = GELU(64, 256, approximate="tanh").cuda()
    x = torch.randn(3, 50, 64, device="cuda")
    tanh, exact = module(x), F.gelu(module.proj(x))
    ours = gelu_in_epilogue(module)(x)
    assert (ours - tanh).abs().max() < 1e-5 < (ours - exact).abs().max()


@needs_fp8
@pytest.mark.parametrize("kernel", ["cudnn", "triton"])
def test_fast_mode_fp8_attention_equals_its_compiled_blocks_and_stays_near_bf16(kernel):
    if kernel == "cudnn" and _cudnn_fp8_reason() is not None:
        pytest.skip(_cudnn_fp8_reason())
    with cuda_pipeline("z-image", "random-full") as pipe:
        fast_bf16 = None
        accelerate(pipe, mode="fast")
        try:
            fast_bf16 = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
        finally:
            restore(pipe)
        assert choose(pipe.transformer, kernel) > 0
        accelerate(pipe, mode="fast", attention="fp8")
        try:
            report = stats(pipe)
            assert report["attention"] == "fp8" and report["fp8_attention_modules"] > 0, report
            assert report["fp8_attention_kernels"] == {kernel: report["fp8_attention_modules"]}, report
            name = {"cudnn": "cudnn-fp8", "triton": "fp8"}[kernel]
            assert sum(getattr(m, KERNEL_ATTRIBUTE, None) == name for m in pipe.transformer.modules()) > 0
            image = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
            with eager(pipe):
                reference = run_case(pipe, "z-image", "no_cfg", height=512, width=512)
            assert torch.equal(image, reference)
            assert torch.equal(run_case(pipe, "z-image", "no_cfg", height=512, width=512), image)
            mse = (image.float() - fast_bf16.float()).pow(2).mean().item()
            psnr = 10 * torch.log10(torch.tensor(1.0 / max(mse, 1e-12))).item()
            print(f"\nZ-Image 512², FP8 attention ({kernel}) against bf16 fast mode: PSNR {psnr:.1f} dB")
            assert psnr > 15, psnr  # a wrong kernel gives noise (under 10 dB); the figure is reported
            assert cudnn_fp8.refusals() == {}, "cuDNN refused a shape: those calls computed the reference"
        finally:
            restore(pipe)
        assert not any(hasattr(m, KERNEL_ATTRIBUTE) for m in pipe.transformer.modules())


# -- attention's fused prologue (bcg_diffusion.kernels.qk_prologue) ----------------------------------------


def _frequencies(*shape: int) -> torch.Tensor:
    angles = torch.rand(*shape, device="cuda") * 6.28
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def _assert_near_reference(got: list[torch.Tensor], expected: list[torch.Tensor], label: str) -> None:
    """bf16: the kernel's float32 sums and rsqrt round differently from PyTorch's, which moves each of the
    two bf16 roundings before RoPE (the normed value, then its product with the weight) by one step at
    most, and rarely. The rotation carries such a step into both outputs of the pair, whose magnitude is at
    most sqrt(2) times the head's largest output: so the bound is two bf16 steps of the head's largest
    value, not of each output (one near zero by cancellation moves by far more than a step of its own;
    run 88 saw 0.03125 on a key whose head's largest value was under 4)."""
    for index, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, (label, index)
        difference = (g.float() - e.float()).abs()
        step = e.float().abs().amax(dim=-1, keepdim=True).clamp(min=2**-10) * 2**-6
        assert bool((difference <= step).all()), (label, index, difference.max().item())
        moved = (difference > 0).float().mean().item()
        assert moved < 0.02, (label, index, moved)


def _assert_quantized_near(got: torch.Tensor, expected: torch.Tensor, descale: torch.Tensor, label: str) -> None:
    """``got`` (float8 e4m3 at ``descale``) is ``expected`` (the bf16 prologue's output) quantized by
    ``cudnn_fp8_attention.quantize``, save a few elements per million. The FP8 build of the prologue
    kernel rounds a rare norm differently from the bf16 build, as each build does against PyTorch (run
    148: 2 to 6 elements of 13 million per tensor; not floating-point contraction, run 154), so an
    element may move by :func:`_assert_near_reference`'s bound before it is quantized. Each element is
    then within that bound plus half a step of e4m3 (3 mantissa bits; subnormal steps of
    ``descale * 2**-9``) of ``expected``, and its bytes differ from ``quantize(expected)`` rarely."""
    value, reference = got.float() * descale, expected.float()
    moved = reference.abs().amax(dim=-1, keepdim=True).clamp(min=2**-10) * 2**-6
    half_step = (reference.abs() + moved) * 2**-4 + descale * 2**-10
    difference = (value - reference).abs()
    assert bool((difference <= moved + half_step).all()), (label, difference.max().item())
    exact = cudnn_fp8.quantize(expected, descale).view(torch.uint8)
    differ = (got.view(torch.uint8) != exact).float().mean().item()
    assert differ < 1e-4, (label, differ)


@pytest.mark.parametrize("layout", ["contiguous", "fused qkv"])
def test_qk_prologue_kernel_matches_its_reference_and_is_deterministic(layout):
    """Qwen-Image 1024² in fast mode's CFG batch (2 rows, 205 text tokens of which 160 and 205 valid,
    4096 image tokens, 24 heads of 128) and Z-Image 1024² (4160 tokens, 30 heads)."""
    from bcg_diffusion.kernels import qk_prologue

    torch.manual_seed(0)
    batch, text_tokens, image_tokens, heads, head_dim = 2, 205, 4096, 24, 128
    lengths = (160, 205)

    def projections(tokens: int) -> list[torch.Tensor]:
        if layout == "contiguous":
            return [torch.randn(batch, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        wide = torch.randn(batch, tokens, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        return list(wide.unbind(2))  # strided views, as a fused QKV projection gives them

    image, text = projections(image_tokens), projections(text_tokens)
    weights = [(torch.randn(head_dim, device="cuda") * 0.5 + 1).to(torch.bfloat16) for _ in range(4)]
    eps = [1e-6] * 4
    freqs = (_frequencies(image_tokens, head_dim // 2), _frequencies(text_tokens, head_dim // 2))
    expected = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, lengths)
    got = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths)
    again = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths)
    slices = [qk_prologue.group_slices(t, lengths, text_tokens) for t in (*got, *expected, *again)]
    got_slices, expected_slices, again_slices = sum(slices[:3], []), sum(slices[3:6], []), sum(slices[6:], [])
    _assert_near_reference(got_slices, expected_slices, "joint")
    assert all(torch.equal(a, b) for a, b in zip(got_slices, again_slices)), "the kernel is not deterministic"
    assert all(torch.equal(a, b) for a, b in zip(got_slices[4:], expected_slices[4:]))  # the value: copied

    tokens, heads = 4160, 30
    query, key = (torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    z_freqs = _frequencies(1, tokens, head_dim // 2)
    expected = qk_prologue.reference_norm_rope(query, key, weights[:2], [1e-5] * 2, z_freqs)
    got = qk_prologue.norm_rope(query, key, weights[:2], [1e-5] * 2, z_freqs)
    _assert_near_reference(list(got), list(expected), "norm_rope")
    again = qk_prologue.norm_rope(query, key, weights[:2], [1e-5] * 2, z_freqs)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "the kernel is not deterministic"


def test_qk_prologue_takes_fluxs_norms_and_frequencies():
    """FLUX.1 1024² (512 text and 4096 image tokens, 24 heads of 128), as ``patches.flux_attention`` calls the
    kernel: ``torch.nn.RMSNorm``'s rounding and diffusers' real ``(cos, sin)`` frequencies (pairs alike), for
    a double-stream block (``joint_qkv``, one group, each stream's frequencies a slice of the joint ones) and a
    single-stream one (``norm_rope`` over the 4608 joined tokens). Near the reference, deterministic; in FP8,
    its bf16 outputs quantized at the norms' bounds."""
    from bcg_diffusion.kernels import qk_prologue

    torch.manual_seed(0)
    text_tokens, image_tokens, heads, head_dim = 512, 4096, 24, 128
    tokens = text_tokens + image_tokens
    angles = (torch.rand(tokens, head_dim // 2, device="cuda") * 6.28).repeat_interleave(2, dim=1)
    cos, sin = angles.cos(), angles.sin()
    freqs = ((cos[text_tokens:], sin[text_tokens:]), (cos[:text_tokens], sin[:text_tokens]))
    weights = [(torch.randn(head_dim, device="cuda") * 0.5 + 1).to(torch.bfloat16) for _ in range(4)]
    eps = [1e-6] * 4

    def projections(count: int) -> list[torch.Tensor]:
        return [torch.randn(1, count, heads, head_dim, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3)]

    image, text, joined = projections(image_tokens), projections(text_tokens), projections(tokens)
    lengths = (text_tokens,)
    expected = qk_prologue.reference_joint_qkv(image, text, weights, eps, freqs, lengths, norm="torch")
    got = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths, norm="torch")
    _assert_near_reference(list(got[:2]), list(expected[:2]), "flux joint")
    assert torch.equal(got[2], expected[2])  # the value: copied
    again = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths, norm="torch")
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "the kernel is not deterministic"
    single = qk_prologue.norm_rope(*joined[:2], weights[:2], eps[:2], (cos, sin), norm="torch")
    reference = qk_prologue.reference_norm_rope(*joined[:2], weights[:2], eps[:2], (cos, sin), norm="torch")
    _assert_near_reference(list(single), list(reference), "flux norm_rope")

    bounds = [cudnn_fp8.rms_norm_bound(weights[i::2], head_dim) for i in (0, 1)]
    descales = [cudnn_fp8.descale(bound) for bound in bounds]
    joint = qk_prologue.joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales, norm="torch")
    for got8, bf16, descale in zip((joint.query, joint.key), got, descales):
        _assert_quantized_near(got8, bf16, descale, "flux joint_qkv_fp8")
    assert torch.equal(joint.value, got[2])
    assert torch.equal(joint.value_largest, got[2].abs().amax().float().reshape(1))
    single_bounds = [cudnn_fp8.descale(cudnn_fp8.rms_norm_bound([w], head_dim)) for w in weights[:2]]
    *single8, largest = qk_prologue.norm_rope_fp8(
        *joined, weights[:2], eps[:2], (cos, sin), *single_bounds, norm="torch"
    )
    for got8, bf16, descale in zip(single8, single, single_bounds):
        _assert_quantized_near(got8, bf16, descale, "flux norm_rope_fp8")
    assert torch.equal(largest, joined[2].abs().amax().float())


def test_qk_prologue_fp8_outputs_are_its_bf16_outputs_quantized():
    """``joint_qkv_fp8`` at Qwen-Image 1024² in fast mode's CFG batch: its query and key are
    ``joint_qkv``'s quantized by ``cudnn_fp8_attention.quantize`` (times the descale's correctly rounded
    reciprocal, cast to e4m3 as PyTorch does) save a rare element (:func:`_assert_quantized_near`); the
    value is copied; each group's largest value magnitude is PyTorch's ``amax`` of the group's slice to the
    bit; the same bytes on every call; a NaN in one group's value is that group's largest, not the
    other's. Then ``norm_rope_fp8`` at Z-Image 1024² against ``norm_rope`` quantized, likewise."""
    from bcg_diffusion.kernels import qk_prologue

    torch.manual_seed(0)
    batch, text_tokens, image_tokens, heads, head_dim = 2, 205, 4096, 24, 128
    lengths = (160, 205)
    image, text = (
        [torch.randn(batch, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for tokens in (image_tokens, text_tokens)
    )
    text[2][1, 200, 3, 5] = 30.0  # the second group's largest value, in its text
    weights = [(torch.randn(head_dim, device="cuda") * 0.5 + 1).to(torch.bfloat16) for _ in range(4)]
    eps = [1e-6] * 4
    freqs = (_frequencies(image_tokens, head_dim // 2), _frequencies(text_tokens, head_dim // 2))
    bounds = (cudnn_fp8.rms_norm_bound(weights[0::2], head_dim), cudnn_fp8.rms_norm_bound(weights[1::2], head_dim))
    descales = [cudnn_fp8.descale(bound) for bound in bounds]
    plain = qk_prologue.joint_qkv(image, text, weights, eps, freqs, lengths)
    joint = qk_prologue.joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales)
    assert joint.query.dtype == joint.key.dtype == torch.float8_e4m3fn and joint.value.dtype == torch.bfloat16
    for got, bf16, descale in ((joint.query, plain[0], descales[0]), (joint.key, plain[1], descales[1])):
        for g, e in zip(*(qk_prologue.group_slices(t, lengths, text_tokens) for t in (got, bf16))):
            _assert_quantized_near(g, e, descale, "joint_qkv_fp8")
    values = qk_prologue.group_slices(plain[2], lengths, text_tokens)
    for g, e in zip(qk_prologue.group_slices(joint.value, lengths, text_tokens), values):
        assert torch.equal(g, e)
    expected_largest = torch.stack([v.abs().amax().float() for v in values])
    assert torch.equal(joint.value_largest, expected_largest) and expected_largest[1] == 30.0
    again = qk_prologue.joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales)
    for a, b in zip(again[:3], joint[:3]):
        # Each group's slice: the rows before a shorter prompt's text are padding the kernel never
        # writes (attention never reads them), so they hold whatever the allocator left there.
        for sa, sb in zip(*(qk_prologue.group_slices(t.view(torch.uint8), lengths, text_tokens) for t in (a, b))):
            assert torch.equal(sa, sb), "the kernel is not deterministic"
    image[2][0, 7, 2, 9] = float("nan")
    largest = qk_prologue.joint_qkv_fp8(image, text, weights, eps, freqs, lengths, *descales).value_largest
    assert largest[0].isnan() and largest[1] == 30.0, largest

    # Z-Image 1024² (4160 tokens, 30 heads; query, key and value views of one product): norm_rope_fp8
    # against norm_rope quantized, and the value's largest magnitude.
    qkv = torch.randn(1, 4160, 3, 30, head_dim, device="cuda", dtype=torch.bfloat16)
    query, key, value = qkv.unbind(2)
    z_freqs = _frequencies(1, 4160, head_dim // 2)
    plain = qk_prologue.norm_rope(query, key, weights[:2], [1e-5] * 2, z_freqs)
    *quantized, largest = qk_prologue.norm_rope_fp8(query, key, value, weights[:2], [1e-5] * 2, z_freqs, *descales)
    for got, bf16, descale in zip(quantized, plain, descales):
        _assert_quantized_near(got, bf16, descale, "norm_rope_fp8")
    assert torch.equal(largest, value.abs().amax().float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_prologue_fp8_with_two_rows_per_group(dtype):
    """``joint_qkv_fp8`` on a CFG batch of two prompts (two groups of two rows, the batch a pipeline makes
    for ``num_images_per_prompt=2``), in bf16 and fp16: each group's largest value magnitude covers both
    its rows and only them, and the query and key are ``joint_qkv``'s quantized, as for one row (run 148
    saw 1 and 2 elements of a million differ in fp16)."""
    from bcg_diffusion.kernels import qk_prologue

    torch.manual_seed(0)
    batch, text_tokens, image_tokens, heads, head_dim, lengths = 4, 77, 1024, 4, 128, (50, 77)
    image, text = (
        [torch.randn(batch, tokens, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3)]
        for tokens in (image_tokens, text_tokens)
    )
    image[2][1, 9, 1, 3] = 20.0  # group 0's largest value, in its second row
    image[2][2, 5, 0, 0] = -25.0  # group 1's, in its first row
    weights = [(torch.randn(head_dim, device="cuda") * 0.5 + 1).to(dtype) for _ in range(4)]
    freqs = (_frequencies(image_tokens, head_dim // 2), _frequencies(text_tokens, head_dim // 2))
    bounds = (cudnn_fp8.rms_norm_bound(weights[0::2], head_dim), cudnn_fp8.rms_norm_bound(weights[1::2], head_dim))
    descales = [cudnn_fp8.descale(bound) for bound in bounds]
    plain = qk_prologue.joint_qkv(image, text, weights, [1e-6] * 4, freqs, lengths)
    joint = qk_prologue.joint_qkv_fp8(image, text, weights, [1e-6] * 4, freqs, lengths, *descales)
    for got, bf16, descale in ((joint.query, plain[0], descales[0]), (joint.key, plain[1], descales[1])):
        for g, e in zip(*(qk_prologue.group_slices(t, lengths, text_tokens) for t in (got, bf16))):
            _assert_quantized_near(g, e, descale, f"joint_qkv_fp8 {dtype}")
    values = qk_prologue.group_slices(plain[2], lengths, text_tokens)
    assert torch.equal(joint.value_largest, torch.stack([v.abs().amax().float() for v in values]))
    assert joint.value_largest.tolist() == [20.0, 25.0]


def test_qwen_processor_with_cudnn_fp8_attention_from_the_fp8_prologue_compiles_and_replays():
    """One attention module of Qwen-Image's shape (3072 wide, 24 heads of 128) with cuDNN's FP8 attention
    and the fused prologue (which then writes the query and key in float8), compiled whole: near the same
    processor with the compiled prologue (bf16 tensors quantized before attention), and a CUDA graph of
    the compiled function replays its bytes."""
    from bcg_diffusion.kernels import qk_prologue
    from bcg_diffusion.patches.attention import QK_PROLOGUE_ATTRIBUTE, qwen_joint_attention_per_group

    if _cudnn_fp8_reason() is not None:
        pytest.skip(_cudnn_fp8_reason())
    attn, hidden, text, args = qwen_attention_on_gpu()
    setattr(attn, KERNEL_ATTRIBUTE, "cudnn-fp8")
    calls = []
    original = qk_prologue.joint_qkv_fp8
    qk_prologue.joint_qkv_fp8 = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, "compiled")
            reference = qwen_joint_attention_per_group(*args)
            assert not calls
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
            eager_fp8 = qwen_joint_attention_per_group(*args)
            assert calls
            # Smaller values than at capture: the value's largest magnitude must be reduced afresh at each
            # replay (its buffer zeroed inside the graph), not kept from the capture's larger one.
            compiled, replayed, captured, smaller = compiled_and_replayed(
                qwen_joint_attention_per_group, args, lambda: (hidden.mul_(0.25), text.mul_(0.25))
            )
    finally:
        qk_prologue.joint_qkv_fp8 = original
    assert all(torch.equal(c, e) for c, e in zip(replayed, compiled, strict=True))
    assert all(torch.equal(c, e) for c, e in zip(captured, smaller, strict=True))
    errors = [
        max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outputs, reference))
        for outputs in (eager_fp8, compiled)
    ]
    print(f"\nrelative error against the bf16 prologue quantized before attention: {errors}")
    assert max(errors) < 2e-2, errors
    assert cudnn_fp8.refusals() == {}


def test_qwen_processor_compiled_with_the_fused_prologue_stays_near_the_compiled_one():
    """One attention module of Qwen-Image's shape (3072 wide), bf16, compiled by inductor with the
    switch on and off, against the processor uncompiled: the operator stays inside the compiled graph
    (no graph break) and both stay as near the uncompiled output. (Inductor's own path skips the bf16
    roundings between norm and RoPE that diffusers, and the kernel, make: on a CPU it moves the output
    by 0.0066 relative, the fused one by 0.)"""
    from bcg_diffusion.patches.attention import QK_PROLOGUE_ATTRIBUTE, qwen_joint_attention_per_group

    attn, _, _, args = qwen_attention_on_gpu()
    with torch.no_grad():
        setattr(attn, QK_PROLOGUE_ATTRIBUTE, "compiled")
        reference = qwen_joint_attention_per_group(*args)
        errors = {}
        for switch in ("compiled", "fused"):
            setattr(attn, QK_PROLOGUE_ATTRIBUTE, switch)
            torch._dynamo.reset()
            outputs = torch.compile(qwen_joint_attention_per_group, fullgraph=True)(*args)
            errors[switch] = max(
                ((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outputs, reference)
            )
    print(f"\nrelative error against the uncompiled processor: {errors}")
    assert errors["fused"] < 2e-2 and errors["compiled"] < 2e-2, errors


@needs_fp8
@pytest.mark.parametrize("activation", ["gelu", "gelu-head", "swiglu"])
@pytest.mark.parametrize("rows", [1, 333, 8192])
def test_activation_fp8_kernels_match_their_references_and_are_deterministic(rows, activation):
    torch.manual_seed(0)
    columns = 10240 if activation == "swiglu" else 12288  # Z-Image's feed-forward width, Qwen-Image's and FLUX's
    wide = torch.randn(2, rows, columns + 64, device="cuda", dtype=torch.bfloat16) * 3
    tensors = [wide[0, :, :columns], wide[1, :, :columns]]  # rows strided like a slice of a wider output
    if activation == "gelu-head":  # FLUX.1's single block: its attention output (3,072 wide) joined first
        head = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16) * 6

        def kernel(hidden):
            return activation_fp8.gelu_fp8(hidden, head=head)

        def reference(hidden):
            return activation_fp8.reference_gelu_fp8(hidden, head=head)

        tensors = tensors[:1]
    elif activation == "gelu":
        tensors = tensors[:1]
        kernel, reference = activation_fp8.gelu_fp8, activation_fp8.reference_gelu_fp8
    else:
        kernel, reference = activation_fp8.swiglu_fp8, activation_fp8.reference_swiglu_fp8
    assert activation_fp8.unavailable(tensors[0].device) is None
    data, scale = kernel(*tensors)
    expected_data, expected_scale = reference(*tensors)
    # The kernel's activation and its division by the scale are a few float32 ulps from the reference's,
    # which can move the rounded activation by one bf16 step and the float8 value by one step.
    torch.testing.assert_close(scale, expected_scale, rtol=2**-7, atol=0)
    got, want = (data.float() * scale), (expected_data.float() * expected_scale)
    # one float8 step: 2^-3 of the value, or the smallest subnormal's 2^-9 of the scale below the normals
    bound = torch.maximum(got.abs(), want.abs()) * 2**-3 + torch.maximum(scale, expected_scale) * 2**-9
    assert torch.all((got - want).abs() <= bound), ((got - want).abs() - bound).max()
    equal = (data.view(torch.uint8) == expected_data.view(torch.uint8)).float().mean().item()
    assert equal > 0.99, equal
    again = kernel(*tensors)
    assert torch.equal(again[0].view(torch.uint8), data.view(torch.uint8)) and torch.equal(again[1], scale)


def _fp8_close(data, scale, expected_data, expected_scale) -> float:
    """Assert float8 rows near the reference's (values times their row scales): every value within two float8
    steps, all but one in 10,000 within one; return the share of equal bytes."""
    # A norm's sum in another order, the GPU's rsqrt and tanh: a value before quantization can move by a
    # bf16 step at each of its roundings (residual, norm, weight, modulation), and a row's largest with it.
    # Where the residual's sum cancels (x + gate * branch near 0), a step of its terms is all that is left:
    # hence a floor of a bf16 step of the row's largest value (its scale times 448, float8's largest).
    torch.testing.assert_close(scale, expected_scale, rtol=2**-5, atol=0)
    got, want = (data.float() * scale), (expected_data.float() * expected_scale)
    largest, row_scale = torch.maximum(got.abs(), want.abs()), torch.maximum(scale, expected_scale)
    floor = row_scale * 448 * 2**-8
    difference = (got - want).abs()
    worst = (difference - largest * 2**-2 - floor).flatten().argmax()
    where = f"worst at {worst.item()}: {got.flatten()[worst].item()} against {want.flatten()[worst].item()}"
    assert torch.all(difference <= largest * 2**-2 + floor), where
    beyond_one_step = (difference > largest * (2**-3 + 2**-5) + floor).float().mean().item()
    assert beyond_one_step < 1e-4, (beyond_one_step, where)
    return (data.view(torch.uint8) == expected_data.view(torch.uint8)).float().mean().item()


@needs_fp8
@pytest.mark.parametrize("tokens", [1, 1088, 4160])
@pytest.mark.parametrize("batch", [1, 2])
def test_block_glue_kernels_match_their_references_and_are_deterministic(batch, tokens):
    torch.manual_seed(0)
    width = 3840  # Z-Image's
    x, branch = (torch.randn(batch, tokens, width, device="cuda", dtype=torch.bfloat16) * 2 for _ in range(2))
    weights = [1 + 0.1 * torch.randn(width, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    modulation = 0.5 * torch.randn(batch, 4 * width, device="cuda", dtype=torch.bfloat16)
    gate, scale = modulation[:, :width], modulation[:, 2 * width : 3 * width]  # rows of one product
    assert block_glue.unavailable(x.device) is None
    fp8 = torch.float8_e4m3fn

    first = block_glue.modulated_norm_fp8(x, weights[0], 1e-5, scale)
    equal = [_fp8_close(*first, *block_glue.reference_modulated_norm_fp8(x, weights[0], 1e-5, scale, fp8))]
    second = block_glue.gated_residual_fp8(x, branch, weights[1], 1e-6, gate, weights[0], 1e-5, scale)
    want = block_glue.reference_gated_residual_fp8(x, branch, weights[1], 1e-6, gate, weights[0], 1e-5, scale, fp8)
    # the stream: one bf16 step at most (the norm's sum in another order, the GPU's rsqrt and tanh)
    torch.testing.assert_close(second[0], want[0], rtol=2**-7, atol=2**-7)
    equal.append(_fp8_close(*second[1:], *want[1:]))
    third = block_glue.gated_residual(x, branch, weights[1], 1e-6, gate)
    torch.testing.assert_close(third, block_glue.reference_gated_residual(x, branch, weights[1], 1e-6, gate),
                               rtol=2**-7, atol=2**-7)  # fmt: skip
    assert min(equal) > 0.98, equal
    again = block_glue.gated_residual_fp8(x, branch, weights[1], 1e-6, gate, weights[0], 1e-5, scale)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(again, second, strict=True))
    print(f"\n{batch}x{tokens}: float8 bytes equal to the reference {equal}")


@needs_fp8
@pytest.mark.parametrize("tokens", [64, 4096])
@pytest.mark.parametrize("batch", [1, 2])
def test_qwen_block_glue_kernels_match_their_references_and_are_deterministic(batch, tokens):
    torch.manual_seed(0)
    width = 3072  # Qwen-Image's
    x, branch = (torch.randn(batch, tokens, width, device="cuda", dtype=torch.bfloat16) * 2 + 1 for _ in range(2))
    modulation = 0.5 * torch.randn(batch, 6 * width, device="cuda", dtype=torch.bfloat16)
    shift, scale, gate = (modulation[:, i * width : (i + 1) * width] for i in range(3))  # rows of one product
    fp8 = torch.float8_e4m3fn

    first = block_glue.modulated_layer_norm_fp8(x, 1e-6, scale, shift)
    equal = [_fp8_close(*first, *block_glue.reference_modulated_layer_norm_fp8(x, 1e-6, scale, shift, fp8))]
    second = block_glue.gated_add_layer_norm_fp8(x, branch, gate, 1e-6, scale, shift)
    want = block_glue.reference_gated_add_layer_norm_fp8(x, branch, gate, 1e-6, scale, shift, fp8)
    assert torch.equal(second[0], want[0])  # a product and a sum, each rounded as PyTorch rounds it
    equal.append(_fp8_close(*second[1:], *want[1:]))
    assert torch.equal(block_glue.gated_add(x, branch, gate), block_glue.reference_gated_add(x, branch, gate))
    assert min(equal) > 0.98, equal
    again = block_glue.gated_add_layer_norm_fp8(x, branch, gate, 1e-6, scale, shift)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(again, second, strict=True))
    print(f"\n{batch}x{tokens}: float8 bytes equal to the reference {equal}")
