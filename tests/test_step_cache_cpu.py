"""Step caching with the runner path in debug mode (CPU): every diffusers cache we support keeps the
runner on, gives eager's bytes with the same cache, and follows enable / disable / restore.

Debug mode re-runs the hooks' Python on every call, so what only a replay can get wrong (a decision or
a kept tensor the graphs did not carry) is tested on the GPU (``test_step_cache_cuda.py``); the state
machinery itself (buffers, rewind, records) is tested here directly.
"""

from __future__ import annotations

import pytest
import torch
from _caches import CACHES, cache_config, check_interleaved_calls, mixed_threshold
from _cases import run_case
from _checks import assert_graphs_ran, needs_compiler
from diffusers import FirstBlockCacheConfig, MagCacheConfig
from diffusers.hooks.hooks import HookRegistry, ModelHook, StateManager

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.features.step_caching import CacheState, SkipCounter, disable_cache, enable_cache
from bcg_diffusion.models import build_pipeline

CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}
STEPS = 6


def _pipe(name):
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, name):
    return run_case(pipe, name, CASE[name], height=32, width=32, steps=STEPS)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_every_cache_keeps_the_runner_and_eager_bytes(name, cache):
    pipe = _pipe(name)
    threshold = (
        mixed_threshold(pipe, name, CASE[name], steps=STEPS, height=32, width=32) if cache == "first-block" else 1
    )
    enable_cache(pipe, cache_config(cache, STEPS, threshold))
    reference = _run(pipe, name)
    accelerate(pipe, debug=True)
    counter = SkipCounter(pipe.transformer)
    try:
        for _ in range(2):
            assert torch.equal(_run(pipe, name), reference)
        report = assert_graphs_ran(pipe, components=("transformer",))
        assert report["cache_hooks"] and report["cache_states"] > 0, report
        assert 0 < counter.skipped < counter.calls, (counter.skipped, counter.calls)
    finally:
        counter.remove()
        restore(pipe)
    assert torch.equal(_run(pipe, name), reference)  # restore leaves the cache on, eager


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_interleaved_sizes_prompts_and_cfg_keep_eager_bytes_and_decisions(name, cache):
    # One pipeline, two resolutions, two prompts, CFG on and off, interleaved (_caches.MIXED_SEQUENCE); MagCache
    # with ratios whose accumulated error decides. Each call equals eager's with the same cache and decisions.
    print("\n" + check_interleaved_calls(_pipe(name), _pipe(name), name, cache, ((32, 32), (48, 32)), debug=True))


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_cache_enabled_and_disabled_while_accelerated(name):
    pipe = _pipe(name)
    plain = _run(pipe, name)
    enable_cache(pipe, cache_config("taylorseer", STEPS))
    cached = _run(pipe, name)
    disable_cache(pipe)
    accelerate(pipe, debug=True)
    state = next(f.state for f in pipe._bcg_state.all_features() if f.name == "step caching")
    keys = []
    try:
        for what, expected in [("plain", plain), ("on", cached), ("plain", plain), ("on", cached)]:
            if what == "on":
                enable_cache(pipe, cache_config("taylorseer", STEPS))
                keys.append(state.key())
            assert torch.equal(_run(pipe, name), expected), what
            if what == "on":
                disable_cache(pipe)
        # Hooks enabled again have new state managers and buffers: their signatures must not be the old
        # ones, whose graphs bake in the old buffers (on a GPU this replayed the first step's graph at
        # every step of the second enable: another image).
        assert keys[0] != keys[1]
        assert stats(pipe)["invalidations"] == 0
    finally:
        restore(pipe)


def test_restore_gives_the_hooks_their_own_decisions_back():
    pipe = _pipe("qwen-image")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    accelerate(pipe, debug=True)
    _run(pipe, "qwen-image")
    head = pipe.transformer.transformer_blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    assert getattr(head._should_compute_remaining_blocks, "__bcg_eager_break__", False)
    restore(pipe)
    assert "_should_compute_remaining_blocks" not in vars(head) and "_bcg_decision" not in vars(head)


def test_first_block_cache_runs_on_z_image():
    # diffusers' block registry names Z-Image's block input hidden_states; FirstBlockCache asked for it
    # by that name and failed ("Parameter 'hidden_states' not found") before enable_cache registered it.
    pipe = _pipe("z-image")
    assert not callable(getattr(pipe.transformer, "enable_cache", None))
    enable_cache(pipe, FirstBlockCacheConfig(threshold=2.0))
    counter = SkipCounter(pipe.transformer)
    _run(pipe, "z-image")
    assert counter.skipped > 0
    counter.remove()
    disable_cache(pipe)
    assert not callable(getattr(pipe.transformer, "enable_cache", None))
    assert type(pipe.transformer).__name__ == "ZImageTransformer2DModel"


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_a_config_that_is_no_cache_names_the_ones_that_work(name):
    pipe = _pipe(name)
    original = type(pipe.transformer)
    expected = "str 'bogus' is not a diffusers cache config; pass a FirstBlockCacheConfig, TaylorSeerCacheConfig or "
    with pytest.raises(TypeError, match=expected + "MagCacheConfig"):
        enable_cache(pipe, "bogus")
    assert type(pipe.transformer) is original  # refused before anything changed: Z-Image got no cache methods
    assert not getattr(pipe.transformer, "is_cache_enabled", False)


def test_magcache_calibration_runs_eagerly_with_the_reason():
    pipe = _pipe("qwen-image")
    accelerate(pipe, debug=True)
    try:
        pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
        with pytest.warns(BCGWarning, match="calibration"):
            _run(pipe, "qwen-image")
        assert stats(pipe)["eager_fallbacks"] > 0
    finally:
        restore(pipe)


@needs_compiler
@pytest.mark.heavy  # compiles with inductor on CPU
def test_fast_mode_wraps_the_compiled_blocks_and_gives_them_back():
    torch._dynamo.reset()
    pipe = _pipe("qwen-image")
    pipe.transformer.enable_cache(cache_config("magcache", STEPS))
    reference = _run(pipe, "qwen-image")
    originals = [block._diffusers_hook._fn_refs[0].original_forward for block in pipe.transformer.transformer_blocks]
    accelerate(pipe, mode="fast", debug=True)
    try:
        image = _run(pipe, "qwen-image")  # captures every step's state
        assert torch.equal(_run(pipe, "qwen-image"), image)  # replays them
        with eager(pipe):
            assert torch.equal(_run(pipe, "qwen-image"), image)
        report = assert_graphs_ran(pipe, components=("transformer",))
        assert report["compiled_blocks"] > 0 and report["compiles"] > 0 and report["cfg_batched"] == 0, report
        assert report["eager_block_calls"] == 0, report
    finally:
        restore(pipe)
        torch._dynamo.reset()
    for block, original in zip(pipe.transformer.transformer_blocks, originals):
        inner = block._diffusers_hook._fn_refs[0].original_forward
        assert getattr(inner, "__func__", None) is type(block).forward is original.__func__  # not a compiled one
    assert torch.equal(_run(pipe, "qwen-image"), reference)


# ------------------------------------------------------------------------------------------ CacheState
class _KeepState:
    def __init__(self):
        self.step = 0
        self.kept = None  # a tensor
        self.pair = None  # [older, newer]: the newer moves to the older place each call

    def reset(self):
        self.__init__()


class _KeepHook(ModelHook):
    """A stand-in cache hook: adds what it kept to the output and keeps the new output."""

    _is_stateful = True

    def __init__(self):
        super().__init__()
        self.state_manager = StateManager(_KeepState)

    def new_forward(self, module, x):
        state = self.state_manager.get_state()
        out = self.fn_ref.original_forward(x)
        if state.kept is not None:
            out = out + state.kept
        state.step += 1
        state.kept = out * 0.5
        state.pair = [out.clone()] * 2 if state.pair is None else [state.pair[1], out.clone()]
        return out

    def reset_state(self, module):
        self.state_manager.reset()
        return module


def _keeping_module():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    hook = _KeepHook()
    HookRegistry.check_if_exists_or_initialize(module[0]).register_hook(hook, "keep")
    HookRegistry.check_if_exists_or_initialize(module)  # what enable_cache and cache_context make
    hook.state_manager.set_context(type("C", (), {"name": "cond"})())
    return module, hook


def test_cache_state_refuses_hooks_it_does_not_know():
    module, _ = _keeping_module()
    with pytest.raises(TypeError, match="not supported"):
        CacheState(module).key()


def test_cache_state_buffers_rewind_and_records(monkeypatch):
    import bcg_diffusion.features.step_caching.state as step_cache

    monkeypatch.setattr(step_cache, "SUPPORTED_HOOKS", ("keep",))
    module, hook = _keeping_module()
    state = CacheState(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        first = state.key()
        module(x)
        state.persist()
        kept = hook.state_manager.get_state()
        buffers = (kept.kept, *kept.pair)
        assert state.key() != first  # step and tensors now in the state
        token = state.checkpoint()
        before = (kept.step, kept.kept.clone(), [t.clone() for t in kept.pair])
        for _ in range(2):  # every run from the same state gives the same result and the same buffers
            state.rewind(token)
            out = module(x)
            state.persist()
            now = hook.state_manager.get_state()
            assert (now.kept, *now.pair) == buffers or all(a is b for a, b in zip((now.kept, *now.pair), buffers))
        state.rewind(token)
        assert kept.step == before[0] and torch.equal(kept.kept, before[1])
        assert all(torch.equal(a, b) for a, b in zip(kept.pair, before[2]))
        again = module(x)
        state.persist()
        assert torch.equal(again, out)
        recorded = state.record()
        hook.state_manager._state_cache.clear()  # a replay runs no Python: apply() puts the state back
        state.apply(recorded)
        restored = hook.state_manager.get_state()
        assert restored.step == before[0] + 1 and restored.kept is buffers[0]
        # the pair's newer value moved to the older place without being overwritten first
        assert torch.equal(restored.pair[0], before[2][1])


def _cache_dit(pipe):
    cache_dit = pytest.importorskip("cache_dit")
    # tiny models have 2 blocks: Cache-DiT's defaults compute the first 8
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0))


def test_cache_dit_before_accelerate_leaves_the_pipeline_eager_with_the_reason():
    pipe = _pipe("qwen-image")
    _cache_dit(pipe)
    reference = _run(pipe, "qwen-image")
    with pytest.warns(BCGWarning, match="Cache-DiT"):
        accelerate(pipe, debug=True)
    try:
        assert not stats(pipe)["active"] and "Cache-DiT" in stats(pipe)["reason"]
        assert torch.equal(_run(pipe, "qwen-image"), reference)
    finally:
        restore(pipe)


def test_cache_dit_after_accelerate_runs_eagerly_with_the_reason():
    pipe = _pipe("qwen-image")
    accelerate(pipe, debug=True)
    try:
        _run(pipe, "qwen-image")
        _cache_dit(pipe)
        with pytest.warns(BCGWarning, match="Cache-DiT"):
            _run(pipe, "qwen-image")
        assert stats(pipe)["components"]["transformer"]["eager_fallbacks"] > 0
    finally:
        with pytest.warns(BCGWarning, match="wrapped again"):  # Cache-DiT wrapped our forward
            restore(pipe)


def test_hooks_applied_behind_diffusers_back_stop_the_capture_with_a_clear_error():
    from diffusers.hooks import apply_first_block_cache

    pipe = _pipe("qwen-image")
    accelerate(pipe, debug=True)
    try:
        _run(pipe, "qwen-image")  # diffusers caches the (empty) list of hooked modules
        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=1.0))  # does not refresh it
        with pytest.raises(Exception, match="without enable_cache|No cache context"):
            run_case(pipe, "qwen-image", CASE["qwen-image"], height=48, width=48, steps=STEPS)  # a new signature
    finally:
        restore(pipe)
