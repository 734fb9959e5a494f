"""Step caching with the runner path in debug mode (CPU): every diffusers cache we support keeps the
runner on, gives eager's bytes with the same cache, and follows enable / disable / restore.

Debug mode re-runs the hooks' Python on every call, so what only a replay can get wrong (a decision or
a kept tensor the graphs did not carry) is tested on the GPU (``test_step_cache_cuda.py``); the state
machinery itself (buffers, rewind, records) is tested here directly.
"""

from __future__ import annotations

import pytest
import torch
from _caches import (
    CACHES,
    DIT_KINDS,
    cache_config,
    cachedit_options,
    check_cachedit_calls,
    check_captures_per_call,
    check_interleaved_calls,
    counting_config,
    dit_threshold,
    mixed_threshold,
)
from _cases import run_case
from _checks import assert_graphs_ran, needs_compiler
from diffusers import FirstBlockCacheConfig, MagCacheConfig
from diffusers.hooks.hooks import HookRegistry, ModelHook, StateManager

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.core.runner import PathHints
from bcg_diffusion.core.tree import flatten, unflatten
from bcg_diffusion.features.step_caching import CacheState, SkipCounter, cachedit, disable_cache, enable_cache, kinds
from bcg_diffusion.features.step_caching.state import DEFAULT_CONTEXT
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


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_a_call_captures_a_graph_per_decision_not_per_step(name, cache):
    # Issue 36: 10 steps with CFG, decisions that vary, two sizes. At most two transformer graphs per argument
    # signature and call (here, without branches, one per key: FirstBlockCache's skip path is a branch, which
    # only a GPU captures); before, every step's state keyed graphs of its own: 20/20/6 on Qwen-Image
    # (TaylorSeer/MagCache/FirstBlockCache), 10/10/3 on Z-Image. ReplayCheck: the graph of a key is right at
    # every step that uses it.
    print("\n" + check_captures_per_call(_pipe(name), _pipe(name), name, cache, ((32, 32), (48, 32)), debug=True))


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_magcache_that_starts_over_mid_call_keeps_eager_bytes(name):
    # Configured for 6 steps, called with 10: diffusers resets MagCache's state after its 6th step, dropping the
    # residual a computed step just kept, and the next steps start over (retention, then decisions again).
    sizes = ((32, 32), (48, 32))
    print(
        "\n" + check_captures_per_call(_pipe(name), _pipe(name), name, "magcache", sizes, config_steps=6, debug=True)
    )


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


# The methods step caching gives each kind of hook (bcg_diffusion.features.step_caching.kinds.install).
OUR_METHODS = {
    "first-block": ("transformer_blocks.0", "fbc_leader_block_hook", "_should_compute_remaining_blocks"),
    "magcache": ("transformer_blocks.1", "mag_cache_block_hook", "_advance_step"),  # the tail's
    "taylorseer": ("transformer_blocks.0.attn", "taylorseer_cache", "_measure_should_compute"),
}


@pytest.mark.parametrize("cache", CACHES)
def test_restore_gives_the_hooks_their_own_methods_back(cache):
    pipe = _pipe("qwen-image")
    pipe.transformer.enable_cache(cache_config(cache, STEPS))
    accelerate(pipe, debug=True)
    _run(pipe, "qwen-image")
    where, name, method = OUR_METHODS[cache]
    hook = pipe.transformer.get_submodule(where)._diffusers_hook.hooks[name]
    assert method in vars(hook) and "_bcg_patched" in vars(hook)
    restore(pipe)
    assert method not in vars(hook) and "_bcg_patched" not in vars(hook)
    disable_cache(pipe)
    pipe.transformer.enable_cache(cache_config(cache, STEPS))  # new hooks, and new methods of ours on them
    accelerate(pipe, debug=True)
    _run(pipe, "qwen-image")
    old, hook = hook, pipe.transformer.get_submodule(where)._diffusers_hook.hooks[name]
    assert hook is not old and method in vars(hook)
    disable_cache(pipe)  # taken off while accelerated: our methods leave the hooks at the next call
    _run(pipe, "qwen-image")
    assert method not in vars(hook)
    restore(pipe)


def test_a_mirror_of_magcache_that_decides_otherwise_fails_loudly(monkeypatch):
    # MagCache's decision is computed before the call by our mirror of diffusers' code; every run of the hooks
    # checks the state they leave against it, so a diffusers that decides otherwise cannot replay wrong steps.
    pipe = _pipe("z-image")
    enable_cache(pipe, cache_config("magcache", STEPS))
    accelerate(pipe, debug=True)
    decide = kinds._mag_head_decision
    monkeypatch.setattr(kinds, "_mag_head_decision", lambda config, state: not decide(config, state))
    try:
        with pytest.raises(RuntimeError, match="mirror of their decision"):
            _run(pipe, "z-image")
    finally:
        restore(pipe)


def test_taylorseer_steps_run_again_after_restart_as_they_ran_once():
    # When a replay's break returns another value, the runner runs the call's breaks again (another path) after
    # CacheState.restart(). TaylorSeer's breaks advance its step and update its factors: a second run of a step
    # must give the same output and leave the same state as one run. Every step runs twice here.
    pipe, reference = _pipe("z-image"), _pipe("z-image")
    calls = []
    handle = reference.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(_cloned((args, kwargs))), with_kwargs=True
    )
    _run(reference, "z-image")
    handle.remove()
    config = counting_config("taylorseer", STEPS)  # updates with first- and second-order factors, predictions
    enable_cache(pipe, config)
    enable_cache(reference, config)
    state = CacheState(pipe.transformer)
    decisions = set()
    try:
        with torch.no_grad():
            for index, (args, kwargs) in enumerate(calls):
                expected = reference.transformer(*_cloned(args), **_cloned(kwargs))
                with pipe.transformer.cache_context(DEFAULT_CONTEXT):  # what the runner's call finds set
                    state.key()
                    pipe.transformer(*_cloned(args), **_cloned(kwargs))
                    state.restart()
                    out = pipe.transformer(*_cloned(args), **_cloned(kwargs))
                assert _equal(out, expected), index
                hook = pipe.transformer.layers[0].attention._diffusers_hook.hooks["taylorseer_cache"]
                ours, theirs = (
                    m.layers[0]
                    .attention._diffusers_hook.hooks["taylorseer_cache"]
                    .state_manager._state_cache[DEFAULT_CONTEXT]
                    for m in (pipe.transformer, reference.transformer)
                )
                decisions.add(ours.last_update_step == ours.current_step)
                assert (ours.current_step, ours.last_update_step) == (theirs.current_step, theirs.last_update_step)
                assert _equal(ours.taylor_factors, theirs.taylor_factors), index
        assert decisions == {True, False}, "every step computed, or every step predicted"
        assert "_measure_should_compute" in vars(hook)
    finally:
        state.close()
        disable_cache(pipe)
        disable_cache(reference)


def _cloned(value):
    return unflatten(flatten(value)[1], [t.clone() for t in flatten(value)[0]])


def _equal(a, b):
    (la, sa), (lb, sb) = flatten(a), flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb))


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
        assert report["compiled_blocks"] > 0 and report["compiles"] > 0, report
        # MagCache decides on host values: true CFG runs batched in one joint cache context (cfg_join) after the
        # first step of each of the three calls, eager(pipe)'s included.
        assert (report["cfg_batched"], report["cfg_batch_dropped"]) == (3 * (STEPS - 1), 0), report
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


def _cache_dit(pipe, kind="static"):
    cache_dit = pytest.importorskip("cache_dit")
    cache_dit.enable_cache(pipe, **cachedit_options(kind, STEPS))
    return cache_dit


DIT_SIZES = ((32, 32), (48, 32))


@pytest.mark.parametrize(
    ("name", "kind"),
    [(n, k) for n in ("qwen-image", "z-image") for k in DIT_KINDS if (n, k) != ("z-image", "dynamic")],
)
def test_cache_dit_runs_inside_the_graphs_with_eager_bytes(name, kind):
    # Cache-DiT's DBCache enabled before accelerate: the blocks run on the graphs (its host logic in eager
    # breaks), every call gives eager's bytes with the same Cache-DiT options, a new (size, prompt) captures at
    # most compute + reuse per argument signature, a repeat none, and ReplayCheck emulates the replays.
    pytest.importorskip("cache_dit")
    threshold = dit_threshold(lambda: _pipe(name), name, DIT_SIZES) if kind == "dynamic" else 1.0
    line = check_cachedit_calls(lambda: _pipe(name), name, kind, DIT_SIZES, threshold=threshold, debug=True)
    print(line)


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_cache_dit_enabled_after_accelerate_keeps_the_graphs(name):
    pytest.importorskip("cache_dit")
    with pytest.warns(BCGWarning, match="wrapped again"):  # restore: Cache-DiT wrapped our forward
        print(check_cachedit_calls(lambda: _pipe(name), name, "static", DIT_SIZES, when="after", debug=True))


def test_cache_dit_breaks_undo_their_steps_on_restart():
    # A replay that switches paths after the breaks ran (a changed decision) runs them again: restart puts
    # Cache-DiT's contexts back as key() found them, so the step counters do not advance twice.
    pipe = _pipe("z-image")
    _cache_dit(pipe)
    accelerate(pipe, debug=True)
    try:
        _run(pipe, "z-image")
        state = next(f for f in pipe._bcg_state.all_features() if f.name == "step caching").state
        manager = pipe.transformer._context_manager
        context = next(iter(manager._cached_context_manager.values()))
        state.key()
        steps, cached = context.transformer_executed_steps, list(context.cached_steps)
        manager.set_context(context.name)
        manager.mark_step_begin()
        manager.add_cached_step()
        assert context.transformer_executed_steps == steps + 1 and len(context.cached_steps) == len(cached) + 1
        token = state.checkpoint()
        state.restart()
        assert context.transformer_executed_steps == steps and context.cached_steps == cached
        state.rewind(token)
        assert context.transformer_executed_steps == steps + 1
    finally:
        restore(pipe)


def test_cache_dit_kept_tensors_are_copies_made_in_the_break():
    # What a set_*_buffer keeps must not be the graph's tensor, which the next replay rewrites.
    pipe = _pipe("z-image")
    _cache_dit(pipe)
    accelerate(pipe, debug=True)
    try:
        _run(pipe, "z-image")
        manager = pipe.transformer._context_manager
        context = next(iter(manager._cached_context_manager.values()))
        manager.set_context(context.name)
        residual = torch.ones(1, 4, 8)
        manager.set_Fn_buffer(residual, prefix="probe")
        kept = context.get_buffer("probe_buffer")
        assert kept is not residual and torch.equal(kept, residual)
    finally:
        restore(pipe)


def _uncarried_cache_dit(cache_dit, name, what):
    """Cache-DiT options whose blocks cannot be carried (``what``: DBPrune, or DBCache with the DMD calibrator)."""
    if what == "dbprune":
        return {"cache_config": cache_dit.DBPruneConfig(Fn_compute_blocks=1, Bn_compute_blocks=0)}
    options = cachedit_options("static", STEPS)
    options["calibrator_config"] = cache_dit.DMDCalibratorConfig()
    return options


@pytest.mark.parametrize(("name", "what"), [("qwen-image", "dbprune"), ("qwen-image", "dmd"), ("z-image", "dmd")])
def test_cache_dit_that_cannot_be_carried_runs_only_its_blocks_eagerly(name, what):
    # DBPrune and calibrators other than TaylorSeer are not carried: their cached-blocks module runs as one eager
    # break with Cache-DiT's own code, the rest of the transformer in the graphs, with eager's bytes at every call
    # (two sizes, repeats replayed). Before, the whole pipeline stayed eager. (DBPrune on Z-Image fails in
    # Cache-DiT 1.5.3 itself, eagerly: _process_block_outputs() takes 2 positional arguments but 3 were given.)
    cache_dit = pytest.importorskip("cache_dit")
    pipe, reference = _pipe(name), _pipe(name)
    for target in (pipe, reference):
        cache_dit.enable_cache(target, **_uncarried_cache_dit(cache_dit, name, what))
    sizes = ((32, 32), (48, 32), (32, 32))
    expected = [run_case(reference, name, CASE[name], height=h, width=w, steps=STEPS) for h, w in sizes]
    accelerate(pipe, debug=True)
    try:
        with pytest.warns(BCGWarning, match="its blocks run eagerly, the rest of the transformer in the graphs"):
            first = run_case(pipe, name, CASE[name], height=32, width=32, steps=STEPS)
        images = [first] + [run_case(pipe, name, CASE[name], height=h, width=w, steps=STEPS) for h, w in sizes[1:]]
        report = stats(pipe)
        transformer = report["components"]["transformer"]
        assert report["active"] and transformer["captures"] > 0 and transformer["eager_fallbacks"] == 0, report
        blocks = cachedit._cached_blocks(pipe.transformer)
        assert blocks and all(getattr(vars(b).get("forward"), "__bcg_eager_break__", False) for b in blocks)
        for index, (image, want) in enumerate(zip(images, expected, strict=True)):
            assert torch.equal(image, want), f"call {index} {sizes[index]}: not eager's"
    finally:
        restore(pipe)
    assert all("forward" not in vars(b) for b in blocks), "restore left the blocks' break on"


def test_cache_dit_under_parallelism_keeps_the_pipeline_eager_with_the_reason(monkeypatch):
    cache_dit = pytest.importorskip("cache_dit")
    pipe = _pipe("qwen-image")
    cache_dit.enable_cache(pipe, **cachedit_options("static", STEPS))
    monkeypatch.setattr(pipe.transformer, "_is_parallelized", True, raising=False)
    with pytest.warns(BCGWarning, match="parallelism"):
        accelerate(pipe, debug=True)
    try:
        assert not stats(pipe)["active"] and "parallelism" in stats(pipe)["reason"]
    finally:
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


def test_path_hints_start_where_the_same_hint_ended():
    hints = PathHints(limit=3)
    assert hints.start(None, "last") == "last" and hints.start(("a", 1), "last") == "last"
    hints.taken(("a", 1), "reuse")
    hints.taken(None, "ignored")
    assert hints.start(("a", 1), "compute") == "reuse" and hints.start(("a", 2), "compute") == "compute"
    for step in range(2, 5):  # past the limit: starts afresh rather than growing
        hints.taken(("a", step), "compute")
    assert hints.start(("a", 1), "last") == "last" and hints.start(("a", 4), "last") == "compute"


def test_cache_dit_hints_each_call_by_its_place_in_the_pipeline_call():
    # The runner starts a replay in the path the last call with the same hint took (a static mask alternates
    # compute and reuse: without hints, H200 run 88 switched paths on 350 of 399 replays). The hint is each
    # context's count of transformer calls, made afresh at each pipeline call: distinct within a call, the same
    # sequence at the next call.
    cache_dit = pytest.importorskip("cache_dit")
    pipe = _pipe("qwen-image")
    cache_dit.enable_cache(pipe, **cachedit_options("static", STEPS))
    accelerate(pipe, debug=True)
    try:
        state = next(f.state for f in pipe._bcg_state.all_features() if f.name == "step caching")
        seen: list = []
        original = state.path_hint
        state.path_hint = lambda: seen.append(original()) or seen[-1]
        calls = []
        for _ in range(3):
            seen.clear()
            _run(pipe, "qwen-image")
            calls.append(list(seen))
        assert calls[1] and calls[1] == calls[2], calls
        assert len(set(calls[1])) == len(calls[1]) and all(h is not None for h in calls[1]), calls[1]
    finally:
        restore(pipe)


def test_a_cache_turned_off_gives_back_the_graphs_captured_without_it():
    # diffusers' hooks wrap a block's forward on the instance and leave its bound class forward when they go:
    # neither is a forward of the user's, so the state check drops nothing when a cache is turned on or off.
    pipe = _pipe("z-image")
    accelerate(pipe, debug=True)
    try:
        _run(pipe, "z-image")
        before = assert_graphs_ran(pipe, captures=True)
        enable_cache(pipe, cache_config("taylorseer", STEPS))
        _run(pipe, "z-image")
        disable_cache(pipe)
        _run(pipe, "z-image")
        after = stats(pipe)
        assert after["state_changes"] == before["state_changes"] == 0
        plain = [s for s in after["signatures"] if s["component"] == "transformer" and "outer=" not in s["state"]]
        assert plain and all(s["replays"] > 0 for s in plain), plain
    finally:
        restore(pipe)
