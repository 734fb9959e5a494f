"""Masks that hide keys only (a prompt's padding), taken by cuDNN's FP8 attention and FlashAttention-4 as key
counts (``kernels.key_padding``), on a CPU: which masks are recognised, the gather that puts the visible keys
first, each kernel's operator (its CPU reference) against PyTorch's masked attention, how the dispatch routes
masked calls, and on tiny HunyuanImage and HunyuanVideo in fast mode with cuDNN's FP8 attention: their masked calls
reach the kernel and the graphs replay the compiled blocks' bytes. The kernels themselves run in
``tests/test_key_padding_cuda.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn as diffusers_dispatch

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.features import fp8_attention
from bcg_diffusion.kernels import cudnn_fp8_attention, fa4_attention, key_padding
from bcg_diffusion.patches import dispatched_attention
from bench.coverage import _call
from bench.coverage_models import TINY


def _qkv(batch=2, tokens=24, heads=2, head_dim=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, heads, head_dim, generator=generator).to(torch.bfloat16) for _ in range(3))


def _scattered_mask(tokens=24):
    """Two batch rows that hide different, scattered keys: the visible ones do not come first."""
    visible = torch.ones(2, tokens, dtype=torch.bool)
    visible[0, 3:7] = False
    visible[0, -2:] = False
    visible[1, ::3] = False
    return visible[:, None, None, :]


def _sdpa(query, key, value, mask=None):
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (query, key, value)), attn_mask=mask)
    return out.transpose(1, 2)


def test_only_masks_that_hide_keys_are_recognised():
    key = torch.zeros(2, 24, 2, 8)
    mask = _scattered_mask()
    assert torch.equal(key_padding.visible_keys(mask, key), mask[:, 0, 0])
    shared = mask[:1]  # one row for the whole batch
    assert key_padding.visible_keys(shared, key).shape == (2, 24)
    refused = {
        "additive": torch.zeros(2, 1, 1, 24),
        "per query": torch.ones(2, 1, 24, 24, dtype=torch.bool),
        "per head": torch.ones(2, 2, 1, 24, dtype=torch.bool),
        "another length": torch.ones(2, 1, 1, 23, dtype=torch.bool),
        "another batch": torch.ones(3, 1, 1, 24, dtype=torch.bool),
        "two dimensions": torch.ones(2, 24, dtype=torch.bool),
    }
    for name, other in refused.items():
        assert key_padding.visible_keys(other, key) is None, name
    assert key_padding.visible_keys(None, key) is None


def test_visible_keys_come_first_in_their_order_and_are_counted():
    tokens = 24
    key = torch.arange(2 * tokens, dtype=torch.float32).reshape(2, tokens, 1, 1).expand(2, tokens, 2, 4)
    visible = _scattered_mask(tokens)[:, 0, 0]
    packed_key, packed_value, lengths = key_padding.visible_first(key, key + 0.5, visible)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [18, 16]
    for row in range(2):
        order = torch.cat([torch.nonzero(visible[row]).flatten(), torch.nonzero(~visible[row]).flatten()])
        assert torch.equal(packed_key[row, :, 0, 0], key[row, order, 0, 0])
        assert torch.equal(packed_value[row], packed_key[row] + 0.5)
    assert torch.equal(key_padding.reference_mask(lengths, tokens)[:, 0, 0], torch.arange(tokens) < lengths[:, None])
    with pytest.raises(ValueError, match=r"key_lengths must be int32 of shape \(2,\)"):
        key_padding.check_lengths(lengths.long(), 2)


def test_fa4_with_key_lengths_is_pytorchs_masked_attention_and_ignores_hidden_keys():
    q, k, v = _qkv()
    lengths = torch.tensor([20, 9], dtype=torch.int32)
    out = fa4_attention.attention(q, k, v, key_lengths=lengths)
    expected = _sdpa(q, k, v, key_padding.reference_mask(lengths, 24))
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=0)
    hidden = key_padding.reference_mask(lengths, 24)[:, 0, 0, :, None, None]
    k2, v2 = (torch.where(hidden, t, t * 100) for t in (k, v))  # only the hidden keys change
    assert torch.equal(fa4_attention.attention(q, k2, v2, key_lengths=lengths), out)
    torch.library.opcheck(torch.ops.bcg_diffusion.fa4_attention.default, (q, k, v, 0.125, lengths))
    with pytest.raises(ValueError, match="key_lengths must be int32"):
        fa4_attention.attention(q, k, v, key_lengths=lengths[:1])


def test_cudnn_fp8_with_key_lengths_is_near_masked_attention_and_ignores_hidden_keys():
    q, k, v = _qkv()
    lengths = torch.tensor([20, 9], dtype=torch.int32)
    out = cudnn_fp8_attention.attention(q, k, v, key_lengths=lengths)
    expected = _sdpa(q, k, v, key_padding.reference_mask(lengths, 24))
    error = (out.float() - expected).abs().mean()
    assert error < 0.03 and (_sdpa(q, k, v) - expected).abs().mean() > 4 * error  # FP8's error, not a mask's
    hidden = key_padding.reference_mask(lengths, 24)[:, 0, 0, :, None, None]
    k2 = torch.where(hidden, k, -k)  # the hidden keys change, within the same largest magnitude
    assert torch.equal(cudnn_fp8_attention.attention(q, k2, v, key_lengths=lengths), out)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    scales = cudnn_fp8_attention.pack_scales(*(torch.tensor(1.0) for _ in range(3)))
    op = torch.ops.bcg_diffusion.cudnn_fp8_attention.default  # float8 has no CPU comparisons: its fake only
    torch.library.opcheck(op, (q8, k8, v8, scales, 0.125, lengths), test_utils="test_faketensor")
    with pytest.raises(ValueError, match="key_lengths must be int32"):
        cudnn_fp8_attention.attention(q, k, v, key_lengths=lengths.long())


@pytest.mark.parametrize("kernel", ["cudnn-fp8", "fa4"])
def test_a_mask_that_hides_keys_reaches_the_kernels_that_take_key_lengths(kernel):
    q, k, v = _qkv()
    mask = _scattered_mask()
    dispatch = dispatched_attention.kernel_dispatch(kernel)
    out = dispatch(q, k, v, attn_mask=mask)
    error = (out.float() - _sdpa(q, k, v, mask)).abs().mean()
    assert error < (0.03 if kernel == "cudnn-fp8" else 2e-3), error
    assert not torch.equal(out, diffusers_dispatch(q, k, v, attn_mask=mask))  # the kernel, not PyTorch
    assert torch.equal(dispatch(q, k, v, mask), out)  # positional
    per_query = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    assert torch.equal(dispatch(q, k, v, attn_mask=per_query), diffusers_dispatch(q, k, v, attn_mask=per_query))


def test_our_triton_kernel_leaves_masked_calls_to_pytorch(monkeypatch):
    """Measured slower with key lengths than PyTorch's bf16 attention (HunyuanImage 2.1, run 220)."""
    called = []
    monkeypatch.setattr(dispatched_attention.triton_kernels, "unsupported", lambda q, k, v: None)
    monkeypatch.setattr(dispatched_attention.triton_kernels, "fp8_attention", lambda *a, **k: called.append(1))
    q, k, v = _qkv()
    mask = _scattered_mask()
    out = dispatched_attention.kernel_dispatch("fp8")(q, k, v, attn_mask=mask)
    assert torch.equal(out, diffusers_dispatch(q, k, v, attn_mask=mask)) and not called


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
@pytest.mark.parametrize("name", ["HunyuanImage", "HunyuanVideo"])  # each pads its prompt and hides the padding
def test_masked_joint_attention_reaches_cudnns_fp8_attention_with_key_lengths_in_fast_mode(name, monkeypatch):
    monkeypatch.setattr(fp8_attention, "unavailable", lambda device: None)
    monkeypatch.setattr(fp8_attention.cudnn_fp8_attention, "unavailable", lambda device: None)
    monkeypatch.setattr(cudnn_fp8_attention, "unsupported", lambda q, k, v: None)  # tiny: float32, heads of 8
    lengths_seen = []

    def stand_in(query, key, value, *, scale=None, key_lengths=None):
        """The kernel's place: attention on the query rounded through float8 (the kernel was reached), the keys
        past each row's length hidden. Records whether its eager calls had lengths (debug mode's recording runs
        the blocks' eager forwards; a list changed inside compiled code would recompile the block every call)."""
        if not torch.compiler.is_compiling():
            lengths_seen.append(key_lengths is not None)
        query = query.to(torch.float8_e4m3fn).to(query.dtype)
        return fa4_attention.reference(query, key, value, scale or query.shape[-1] ** -0.5, key_lengths)

    monkeypatch.setattr(cudnn_fp8_attention, "attention", stand_in)
    pipe, inputs = TINY[name]()
    accelerate(pipe, mode="fast", debug=True)
    try:
        bf16 = _call(pipe, inputs)
    finally:
        restore(pipe)
    accelerate(pipe, mode="fast", attention="fp8", debug=True)
    try:
        report = stats(pipe)
        assert (
            report["fp8_attention_kernels"] == {"cudnn": report["fp8_attention_modules"]}
            and report["fp8_attention_modules"] > 0
        )
        fast = _call(pipe, inputs)
        with eager(pipe):  # the compiled blocks without graphs: what fast mode must equal
            assert torch.equal(fast, _call(pipe, inputs))
        assert lengths_seen and all(lengths_seen), lengths_seen  # every joint attention: masked, with key lengths
        assert not torch.equal(fast, bf16)
        after = stats(pipe)
        assert after["compile_failure"] is None and after["eager_fallbacks"] == 0, after
    finally:
        restore(pipe)
