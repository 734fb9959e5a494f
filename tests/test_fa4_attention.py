"""``attention="fa4"`` on a CPU: FlashAttention-4's operator and its checks, the option's refusals and warning,
and on each tiny published pipeline in fast mode the kernel reached by every attention module (a stand-in
for the GPU kernel, which does not run here), the graphs' bytes equal to the compiled blocks without graphs,
and ``restore`` giving the processors back. The kernel itself runs in ``tests/test_fa4_attention_cuda.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import run_cfg_case, tiny_pipeline

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.kernels import fa4_attention
from bcg_diffusion.patches import dispatched_attention
from bcg_diffusion.patches.attention import KERNEL_ATTRIBUTE
from bench.coverage import _call
from bench.coverage_models import TINY

PIPELINES = ("FLUX.1", "FLUX.2 klein", "Wan 2.1 T2V", "Qwen-Image Edit Plus", "z-image", "HunyuanImage")


def _pipeline(name):
    """A tiny pipeline and a function that runs it: the published ones from the coverage builders, Z-Image (fast
    mode's own processor) from the package's."""
    if name == "z-image":
        pipe = tiny_pipeline(name)
        return pipe, lambda: run_cfg_case(pipe, name)
    pipe, inputs = TINY[name]()
    return pipe, lambda: _call(pipe, inputs)


def _qkv(dtype=torch.bfloat16, head_dim=128, tokens=16):
    torch.manual_seed(0)
    return tuple(torch.randn(1, tokens, 2, head_dim, dtype=dtype) for _ in range(3))


def test_operator_computes_sdpa_on_the_cpu_and_its_fake_matches():
    q, k, v = _qkv()
    out = fa4_attention.attention(q, k, v)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert torch.equal(out, expected.transpose(1, 2)) and out.is_contiguous() and out.dtype == q.dtype
    assert torch.equal(fa4_attention.attention(q, k, v, scale=0.5), fa4_attention.reference(q, k, v, 0.5))
    torch.library.opcheck(torch.ops.bcg_diffusion.fa4_attention.default, (q, k, v, 0.125))


def test_operator_refuses_what_the_kernel_does_not_take():
    q, k, v = _qkv()
    assert fa4_attention.unsupported(q, k, v) is None
    assert "head size 64" in fa4_attention.unsupported(*_qkv(head_dim=64))
    assert "dtype" in fa4_attention.unsupported(*_qkv(dtype=torch.float32))
    assert "disagree" in fa4_attention.unsupported(q, k[:, :8], v)
    with pytest.raises(ValueError, match="FlashAttention-4 cannot take these tensors: head size 64"):
        fa4_attention.attention(*_qkv(head_dim=64))


def test_unavailable_names_the_device_the_gpu_and_the_package(monkeypatch):
    assert "not a CUDA GPU" in fa4_attention.unavailable(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "9.x and 10.x, not 8.x" in fa4_attention.unavailable(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4_attention, "_import_error", lambda: "flash-attn-4 cannot be imported (...)")
    assert fa4_attention.unavailable(cuda) == "flash-attn-4 cannot be imported (...)"
    monkeypatch.setattr(fa4_attention, "_import_error", lambda: None)
    assert fa4_attention.unavailable(cuda) is None


def test_a_missing_package_is_named_with_its_install_command(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flash_attn(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    fa4_attention._import_error.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_flash_attn)
    try:
        reason = fa4_attention._import_error()
    finally:
        fa4_attention._import_error.cache_clear()
    assert reason.startswith("flash-attn-4 cannot be imported (ModuleNotFoundError") and "bcg-diffusion[fa4]" in reason


def test_the_option_is_fast_modes_and_warns_where_it_cannot_apply():
    pipe, inputs = TINY["FLUX.1"]()
    with pytest.raises(ValueError, match="applies to mode='fast' only"):
        accelerate(pipe, attention="fa4")
    with pytest.raises(ValueError, match=r"attention must be one of \('fp8', 'fa4'\)"):
        accelerate(pipe, mode="fast", attention="fa3")
    with pytest.warns(BCGWarning, match="attention='fa4' not applied: the model is on cpu, not a CUDA GPU"):
        accelerate(pipe, mode="fast", attention="fa4", debug=True)
    try:
        report = stats(pipe)
        assert report["attention"] is None and report["fa4_attention_modules"] == 0, report
    finally:
        restore(pipe)


# Whether each call of the stand-in had key lengths (a mask that hides keys), in the order they came.
_FAKE_CALLS: list[bool] = []


def _fake_fa4(query, key, value, scale=None, key_lengths=None):
    """What the test puts in the GPU kernel's place: attention on the query rounded to half its bits, so its
    result differs from PyTorch's (the kernel was reached) and is deterministic. Records its eager calls (debug
    mode's recording of each signature runs the blocks' eager forwards): a list changed inside compiled code would
    recompile the block on every call."""
    if not torch.compiler.is_compiling():
        _FAKE_CALLS.append(key_lengths is not None)
    query = query.to(torch.float8_e5m2).to(query.dtype)
    return fa4_attention.reference(query, key, value, scale or query.shape[-1] ** -0.5, key_lengths)


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
@pytest.mark.parametrize("name", PIPELINES)
def test_fa4_reaches_every_attention_module_and_graphs_equal_its_compiled_blocks(name, monkeypatch):
    monkeypatch.setattr(fa4_attention, "unavailable", lambda device: None)
    monkeypatch.setattr(fa4_attention, "unsupported", lambda q, k, v: None)  # the tiny models' float32, small heads
    monkeypatch.setattr(fa4_attention, "attention", _fake_fa4)
    _FAKE_CALLS.clear()
    pipe, call = _pipeline(name)
    with torch.no_grad():
        pytorchs = call()
    modules = dispatched_attention.attention_modules(pipe.transformer)
    processors = {module: module.processor for module in modules}
    accelerate(pipe, mode="fast", attention="fa4", debug=True)
    try:
        report = stats(pipe)
        assert report["attention"] == "fa4" and report["fa4_attention_modules"] == len(modules) > 0, report
        for module in modules:  # the generic dispatch's copy, or fast mode's own processor told the kernel
            if dispatched_attention.own_processor(module):
                assert getattr(module, KERNEL_ATTRIBUTE) == "fa4"
            else:
                assert getattr(module.processor, dispatched_attention.KERNEL_OF_CLASS) == "fa4"
        fast = call()
        with eager(pipe):  # the compiled blocks without graphs: what fast mode must equal
            reference = call()
        assert torch.equal(fast, reference)
        assert not torch.equal(fast, pytorchs) and _FAKE_CALLS  # the stand-in ran
        # HunyuanImage's joint attention hides the text's padding: its calls reach the kernel with key lengths
        assert any(_FAKE_CALLS) == (name == "HunyuanImage"), _FAKE_CALLS
        after = stats(pipe)
        assert after["compile_failure"] is None and after["compiles"] > 0 and after["eager_fallbacks"] == 0, after
    finally:
        restore(pipe)
    assert all(module.processor is processor for module, processor in processors.items())
    assert not any(KERNEL_ATTRIBUTE in module.__dict__ for module in modules)


@pytest.mark.heavy  # compiles the tiny blocks with inductor on the CPU
def test_fa4_reaches_both_experts_of_wan22(monkeypatch):
    monkeypatch.setattr(fa4_attention, "unavailable", lambda device: None)
    monkeypatch.setattr(fa4_attention, "unsupported", lambda q, k, v: None)
    monkeypatch.setattr(fa4_attention, "attention", _fake_fa4)
    pipe, call = _pipeline("Wan 2.2 T2V")
    experts = (pipe.transformer, pipe.transformer_2)
    modules = [dispatched_attention.attention_modules(expert) for expert in experts]
    processors = {module: module.processor for found in modules for module in found}
    accelerate(pipe, mode="fast", attention="fa4", debug=True)
    try:
        report = stats(pipe)
        second = report["experts"]["transformer_2"]
        assert report["fa4_attention_modules"] == len(modules[0]) > 0, report
        assert second["attention"] == "fa4" and second["fa4_attention_modules"] == len(modules[1]) > 0, second
        assert all(getattr(m.processor, dispatched_attention.KERNEL_OF_CLASS) == "fa4" for m in processors)
        fast = call()
        with eager(pipe):
            assert torch.equal(fast, call())
    finally:
        restore(pipe)
    assert all(module.processor is processor for module, processor in processors.items())
