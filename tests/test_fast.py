"""Fast mode on CPU: compiled blocks through the whole runner path (debug mode), its patches, its caches.

Inductor compiles for the CPU here (needs a C++ compiler); the GPU side is ``test_fast_cuda.py``.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from _cases import run_case
from _checks import assert_graphs_ran, needs_compiler
from torch._dynamo.utils import counters

from bcg_diffusion import AccelerateConfig, accelerate, eager, restore, stats
from bcg_diffusion.core import graphs as graphs_module
from bcg_diffusion.core.graphs import _ExternalTensorTracker, call_untracked
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.core.runner import BCGWarning
from bcg_diffusion.features.compiled_blocks import compile_repeated_blocks, load_compile_cache, save_compile_cache
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import attention
from bcg_diffusion.patches.rope import QWEN_REAL_ROPE_PATCH, apply_rotary_emb_qwen

heavy = pytest.mark.heavy  # compiles with inductor on CPU (seconds each even for a one-line function, when cold)


def test_fast_mode_options_are_validated():
    assert AccelerateConfig(mode="fast", compile_cache_dir="/tmp/x").compile_cache_dir == "/tmp/x"
    with pytest.raises(ValueError, match="mode='fast' only"):
        AccelerateConfig(compile_cache_dir="/tmp/x")
    with pytest.raises(TypeError, match="compile_cache_dir must be a path"):
        AccelerateConfig(mode="fast", compile_cache_dir=3)


class _FakeCapture:
    """A CUDA capture's tracker and its way of calling compiled regions, without a stream."""

    call_compiled = graphs_module._BreakableCapture.call_compiled

    def __init__(self) -> None:
        self.tracker = _ExternalTensorTracker(capture_stream=None)


@needs_compiler
@heavy
def test_compiled_code_runs_through_call_untracked_while_the_tracker_records():
    compiled = torch.compile(lambda x: (x * 2).sin(), fullgraph=True)
    x = torch.randn(8)
    capture = _FakeCapture()
    token = graphs_module._ACTIVE.set(capture)
    try:
        with capture.tracker:
            capture.tracker.recording = True
            result = call_untracked(compiled, x)
            assert torch.utils._python_dispatch._get_current_dispatch_mode() is capture.tracker  # re-entered
            with pytest.raises(RuntimeError):
                compiled(torch.randn(9))  # what call_untracked exists for: a compile under the mode refuses
    finally:
        graphs_module._ACTIVE.reset(token)
    torch.testing.assert_close(result, (x * 2).sin())  # inductor's sin may round differently from eager's


def test_views_reach_compiled_blocks_detached():
    from bcg_diffusion.features.compiled_blocks import _unviewed

    table = torch.randn(4, 6)
    view = table[:, :3]
    detached = _unviewed(view)
    assert detached._base is None and detached.data_ptr() == view.data_ptr() and torch.equal(detached, view)
    assert _unviewed(table) is table and _unviewed(None) is None and _unviewed(3) == 3
    trained = torch.randn(4, 6, requires_grad=True)[:, :3]
    assert _unviewed(trained) is trained  # autograd history kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rope_matches_the_complex_original(dtype):
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen as diffusers_rope

    assert diffusers_rope is not apply_rotary_emb_qwen  # the module global stays diffusers'
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 4, 32, generator=generator).to(dtype)
    freqs = torch.polar(torch.ones(37, 16), torch.randn(37, 16, generator=generator) * 10)
    expected = diffusers_rope(x, freqs, use_real=False)
    got = apply_rotary_emb_qwen(x, freqs, use_real=False)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # Same rotation; only the rounding of the float32 products may differ (by one bf16 step at most).
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * 4, rtol=tolerance)
    heads_first = x.transpose(1, 2)  # the real path (other models) is delegated unchanged
    cos_sin = (torch.randn(37, 32), torch.randn(37, 32))
    assert torch.equal(apply_rotary_emb_qwen(heads_first, cos_sin), diffusers_rope(heads_first, cos_sin))


def test_scoped_rope_patch_touches_one_model_only():
    first = build_pipeline("qwen-image", "tiny", device="cpu").transformer
    second = build_pipeline("qwen-image", "tiny", device="cpu").transformer
    processors = [m.processor for m in first.modules() if "processor" in m.__dict__]
    patches = MethodPatches()
    count = QWEN_REAL_ROPE_PATCH.apply(first, patches)
    assert count == len(first.transformer_blocks) > 0
    patched = [m.processor for m in first.modules() if "processor" in m.__dict__]
    assert all(p.__call__.__globals__["apply_rotary_emb_qwen"] is apply_rotary_emb_qwen for p in patched)
    untouched = [m.processor for m in second.modules() if "processor" in m.__dict__]
    assert all(p.__call__.__globals__["apply_rotary_emb_qwen"] is not apply_rotary_emb_qwen for p in untouched)
    patches.undo()
    assert [m.processor for m in first.modules() if "processor" in m.__dict__] == processors


class _BackendChoosingBlock(torch.nn.Module):
    """Attention that picks its SDPA backend inside the block, as diffusers' ``_native_cudnn`` does
    (fast mode's Z-Image attention on Hopper); the math backend, so that it runs on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(x, x, x) + 1


@needs_compiler
@heavy
def test_blocks_choosing_their_attention_backend_stay_in_aot_autograds_cache(monkeypatch, tmp_path):
    # Before the fix, AOT autograd's cache refused such blocks (a private torch function in the
    # graph), so every new process traced them again: most of fast mode's warm start on the H200.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    holder = torch.nn.Module()
    holder.block = _BackendChoosingBlock()
    holder._repeated_blocks = ["_BackendChoosingBlock"]
    x = torch.randn(1, 2, 8, 16)
    outputs = []
    for _ in range(2):  # the second time as a new process would: nothing compiled in memory
        torch._dynamo.reset()
        counters["aot_autograd"].clear()
        patches = MethodPatches()
        compile_repeated_blocks(holder, patches)
        try:
            outputs.append(holder.block(x))
        finally:
            patches.undo()
        assert not counters["aot_autograd"].get("autograd_cache_bypass"), dict(counters["aot_autograd"])
    assert counters["aot_autograd"].get("autograd_cache_hit") == 1, dict(counters["aot_autograd"])
    assert torch.equal(outputs[1], outputs[0])  # the cached graph computes what the traced one did
    torch.testing.assert_close(outputs[0], _BackendChoosingBlock()(x))


class _NormDropoutBlock(torch.nn.Module):
    """A block with the float attributes every diffusers block has: a norm's ``eps``, a dropout's ``p``."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 1e-6
        self.dropout = torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _compiled_holder(block: torch.nn.Module) -> tuple[torch.nn.Module, MethodPatches]:
    holder = torch.nn.Module()
    holder.block = block
    holder._repeated_blocks = [type(block).__name__]
    torch._dynamo.reset()
    counters["aot_autograd"].clear()
    patches = MethodPatches()
    compile_repeated_blocks(holder, patches)
    return holder, patches


@needs_compiler
def test_blocks_with_float_attributes_are_traced_once_and_follow_a_changed_float():
    # Before the fix, dynamic=True traced the dropout's p as a symbol, which cannot stay one: dynamo
    # threw the whole trace away and traced the block again (half a warm start on the H200).
    holder, patches = _compiled_holder(_NormDropoutBlock().eval())
    x = torch.randn(2, 8, 16)
    before = counters["stats"]["unique_graphs"]
    try:
        torch.testing.assert_close(holder.block(x), _NormDropoutBlock().eval()(x))
        assert counters["aot_autograd"]["total"] == 1, dict(counters["aot_autograd"])  # no trace thrown away
        holder.block.eps = 1.0  # a float that changes is a new entry, not a stale constant
        torch.testing.assert_close(holder.block(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1.0))
        assert counters["stats"]["unique_graphs"] - before == 2
    finally:
        patches.undo()


class _LoraBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, gain: float | None = None) -> torch.Tensor:
        out = self.norm(self.proj(x))
        return out if gain is None else out * gain


@needs_compiler
def test_lora_scales_and_float_arguments_stay_inputs_of_the_compiled_block():
    # As constants, each LoRA scale set_adapters gives (a strength slider) would compile again.
    peft = pytest.importorskip("peft")
    block = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["proj"]), _LoraBlock())
    torch.nn.init.normal_(block.proj.lora_B["default"].weight)
    reference = copy.deepcopy(block)
    holder, patches = _compiled_holder(block)
    x = torch.randn(2, 8, 16)
    try:
        holder.block(x)
        compiled = counters["stats"]["unique_graphs"]
        for scale in (0.5, 0.7):
            block.proj.set_scale("default", scale)
            reference.proj.set_scale("default", scale)
            torch.testing.assert_close(holder.block(x), reference(x))
        assert counters["stats"]["unique_graphs"] == compiled
        torch.testing.assert_close(holder.block(x, gain=2.0), reference(x, gain=2.0))
        torch.testing.assert_close(holder.block(x, gain=3.0), reference(x, gain=3.0))
        assert counters["stats"]["unique_graphs"] - compiled == 1  # the gain's first call, none after
    finally:
        patches.undo()


@needs_compiler
@heavy
@pytest.mark.parametrize("name", ["z-image", "qwen-image"])
def test_fast_debug_mode_equals_its_compiled_reference(name):
    pipe = build_pipeline(name, "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    case = "cfg" if name == "z-image" else "true_cfg"
    expected = run_case(pipe, name, case, height=64, width=64)
    accelerate(pipe, mode="fast", debug=True)
    try:
        counters["aot_autograd"].clear()
        first = run_case(pipe, name, case, height=64, width=64)
        # Every compiled block is a graph AOT autograd's cache keeps, so later processes start warm
        # (Z-Image's RoPE used to carry an autocast context the cache refuses).
        assert not counters["aot_autograd"].get("autograd_cache_bypass"), dict(counters["aot_autograd"])
        with eager(pipe):
            reference = run_case(pipe, name, case, height=64, width=64)
        assert torch.equal(first, reference)
        assert torch.equal(run_case(pipe, name, case, height=64, width=64), first)
        # Both compared calls ran graphs: the first captured, the last replayed.
        assert_graphs_ran(pipe, captures=True)
        report = stats(pipe)
        assert report["compiled_blocks"] > 0 and report["compiles"] > 0 and report["eager_fallbacks"] == 0
        # One compile per structural variant (Z-Image: modulated blocks and not; Qwen-Image: its CFG
        # batch only, the first step batched too), none for an input that is a view in one call and not
        # in another (3 and 4 compiles before fast.py detached such views).
        assert report["compiles"] <= (1 if name == "qwen-image" else 2), report["compiles"]
        if name == "qwen-image":
            assert QWEN_REAL_ROPE_PATCH.name in report["patches"]
            assert report["cfg_batched"] == 6 and report["cfg_batch_dropped"] == 0  # both steps of each call
        torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)  # float32: only rounding differs
    finally:
        restore(pipe)
    assert torch.equal(run_case(pipe, name, case, height=64, width=64), expected)


@needs_compiler
@heavy
@pytest.mark.parametrize(
    "attribute, value, preset",
    [
        (attention.QK_PROLOGUE_ATTRIBUTE, "fused", {}),
        (attention.KERNEL_ATTRIBUTE, "dispatch", {}),
        # read where the fused prologue runs with cuDNN's FP8 attention chosen (on a CPU: the references)
        (
            attention.FP8_PROLOGUE_ATTRIBUTE,
            False,
            {attention.QK_PROLOGUE_ATTRIBUTE: "fused", attention.KERNEL_ATTRIBUTE: "cudnn-fp8"},
        ),
    ],
)
def test_a_choice_set_on_an_attention_module_after_capture_drops_the_graphs_that_read_it(
    attribute, value, preset, caplog
):
    # Fast mode's choices live on the modules as "_bcg_..." attributes; the check of the Python state
    # once skipped every such name, so a choice made after a capture replayed the old one.
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    for name, preset_value in preset.items():
        setattr(pipe.transformer.layers[0].attention, name, preset_value)
    accelerate(pipe, mode="fast", debug=True)
    try:
        run_case(pipe, "z-image", "cfg", height=64, width=64)
        before = stats(pipe)["components"]["transformer"]["state_changes"]
        setattr(pipe.transformer.layers[0].attention, attribute, value)
        with caplog.at_level(logging.INFO, logger="bcg_diffusion"):
            run_case(pipe, "z-image", "cfg", height=64, width=64)
        assert stats(pipe)["components"]["transformer"]["state_changes"] > before
        assert f"layers.0.attention.{attribute}: unset -> {value!r} since its capture" in caplog.text
    finally:
        restore(pipe)


def test_fast_mode_without_repeated_blocks_keeps_exact_graphs():
    pipe = build_pipeline("z-image", "tiny", device="cpu")
    pipe.transformer._repeated_blocks = []
    with pytest.warns(BCGWarning, match="falls back to graphs of the eager blocks"):
        accelerate(pipe, mode="fast", debug=True)
    try:
        assert stats(pipe)["compiled_blocks"] == 0
    finally:
        restore(pipe)


@needs_compiler
@heavy
def test_compile_cache_artifacts_round_trip(tmp_path):
    compiled = torch.compile(lambda x: x.cos() + 1, fullgraph=True)
    compiled(torch.randn(4))
    file = tmp_path / "artifacts.bin"
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        pytest.skip("this torch has no portable compile cache API")
    assert save_compile_cache(file) and file.stat().st_size > 0
    assert load_compile_cache(file)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not load_compile_cache(garbage)
    assert any("ignoring compile cache" in str(w.message) for w in caught)
    assert not load_compile_cache(tmp_path / "missing.bin")
