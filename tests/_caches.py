"""diffusers' cache configs the step-caching tests run with (CPU and GPU alike)."""

from __future__ import annotations

from typing import Any

import torch
from _cases import LONG, SHORT, run_case
from _checks import assert_graphs_ran, assert_report_ran
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.core import graphs
from bcg_diffusion.core.tree import flatten
from bcg_diffusion.features.step_caching import SkipCounter, disable_cache, enable_cache, kinds

CACHES = ("first-block", "taylorseer", "magcache")
# FirstBlockCache's threshold compares relative residual changes, near 1 with random weights: the
# first of these that gives both decisions on a pipeline is used, so that every test sees both paths.
FBC_THRESHOLDS = (1.0, 1.2, 1.5, 2.0, 3.0)


def cache_config(kind: str, steps: int, threshold: float = 1.0) -> Any:
    """A config whose schedule skips some steps and computes others over ``steps`` steps."""
    if kind == "first-block":
        return FirstBlockCacheConfig(threshold=threshold)
    if kind == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)
    if kind == "magcache":
        # Ratios of 1 keep the accumulated error at 0: a static schedule of up to 2 skips in a row.
        return MagCacheConfig(mag_ratios=[1.0] * steps, num_inference_steps=steps, max_skip_steps=2, threshold=0.5)
    raise ValueError(kind)


def mixed_threshold(pipe: Any, pipeline: str, case: str, *, steps: int, height: int, width: int) -> float:
    """The first FirstBlockCache threshold of :data:`FBC_THRESHOLDS` under which eager both skips and
    computes some calls of this case."""
    return _first_mixed_threshold(
        pipe,
        lambda: run_case(pipe, pipeline, case, height=height, width=width, steps=steps),
        f"{pipeline}/{case}",
    )


def _first_mixed_threshold(pipe: Any, run: Any, label: str) -> float:
    """The first threshold of :data:`FBC_THRESHOLDS` under which eager FirstBlockCache both skips and computes
    some of the transformer calls ``run()`` makes."""
    for threshold in FBC_THRESHOLDS:
        enable_cache(pipe, FirstBlockCacheConfig(threshold=threshold))
        counter = SkipCounter(pipe.transformer)
        try:
            run()
        finally:
            counter.remove()
            disable_cache(pipe)
        if 0 < counter.skipped < counter.calls:
            return threshold
    raise AssertionError(f"no threshold in {FBC_THRESHOLDS} gives both decisions on {label}")


# ------------------------------------------------------------------------------ interleaved calls
# One pipeline called with two resolutions, two prompts and CFG on and off, interleaved: each of the first
# four calls is a combination the pipeline has not seen (new graphs, new cache buffers beside the old ones),
# the last four repeat them (replays only). Entries: (size index, prompt index, CFG on).
MIXED_CALLS = ((0, 0, True), (1, 1, False), (0, 1, False), (1, 0, True))
MIXED_SEQUENCE = MIXED_CALLS + MIXED_CALLS
MIXED_PROMPTS = (SHORT, LONG)
MIXED_CFG = {  # pipeline -> (CFG off, CFG on): Qwen-Image's true CFG (two calls per step), Z-Image's batched CFG
    "qwen-image": ({"true_cfg_scale": 1.0}, {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}),
    "z-image": ({"guidance_scale": 0.0}, {"negative_prompt": "blurry", "guidance_scale": 4.0}),
}
MIXED_STEPS = 8

# MagCache with ratios that move: the accumulated error is not 0, and it decides. Step 0 computes (retention);
# after it the ratio's product drifts from 1 and its error accumulates: steps 1-2 skip, step 3 computes (error
# 0.116 > 0.1), 4 skips, 5 computes (0.141), 6-7 skip. max_skip_steps=8 never binds, so every computed step
# after the first is the error's decision (ratios of 1 would skip steps 1-7).
MAG_RATIOS = (1.0, 0.99, 1.08, 0.97, 1.01, 1.12, 0.98, 1.0)
MAG_SCHEDULE = (True, False, False, True, False, True, False, False)  # computed, per step


def varying_magcache_config() -> MagCacheConfig:
    """MagCache over :data:`MIXED_STEPS` steps whose decisions follow :data:`MAG_SCHEDULE` (see above)."""
    return MagCacheConfig(
        mag_ratios=list(MAG_RATIOS),
        num_inference_steps=MIXED_STEPS,
        threshold=0.1,
        max_skip_steps=MIXED_STEPS,
        retention_ratio=0.1,
    )


def mixed_call(pipe: Any, pipeline: str, call: tuple[int, int, bool], sizes: tuple[tuple[int, int], ...]) -> Any:
    """One call of :data:`MIXED_CALLS` (``sizes``: two (height, width)): the image as a CPU tensor."""
    size, prompt, cfg = call
    height, width = sizes[size]
    out = pipe(
        prompt=MIXED_PROMPTS[prompt],
        **MIXED_CFG[pipeline][cfg],
        height=height,
        width=width,
        num_inference_steps=MIXED_STEPS,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
    )
    return out.images.detach().cpu()


class SkipLog(SkipCounter):
    """A :class:`SkipCounter` that also keeps each transformer call's decision, in order (True: computed)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.decisions: list[bool] = []
        super().__init__(module)

    def _count(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        calls, skipped = self.calls, self.skipped
        super()._count(module, args, output)
        if self.calls > calls:
            self.decisions.append(self.skipped == skipped)


class BlockCalls:
    """Counts the calls of the ``to_q`` linear in the transformer's last block (eager only: a replay runs no
    hooks). It runs when a transformer call computes, and not when a cache skips: FirstBlockCache and MagCache
    skip the blocks, TaylorSeer predicts the attention's output. A count of the work really done, beside the
    caches' own state that :class:`SkipLog` reads."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        blocks = getattr(transformer, "transformer_blocks", None) or transformer.layers
        to_q = next(m for name, m in blocks[-1].named_modules() if name.endswith("to_q"))
        self.calls = 0
        self._handle = to_q.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


def _mixed_config(kind: str, threshold: float) -> Any:
    return varying_magcache_config() if kind == "magcache" else cache_config(kind, MIXED_STEPS, threshold)


def check_interleaved_calls(
    reference: Any,
    pipe: Any,
    pipeline: str,
    kind: str,
    sizes: tuple[tuple[int, int], ...],
    **accelerate_kwargs: Any,
) -> str:
    """:data:`MIXED_SEQUENCE` on ``reference`` (eager) and on ``pipe`` (built the same way, accelerated with
    ``accelerate_kwargs``), both with the same cache ``kind``; asserts:

    - eager: the cache skipped some transformer calls and computed others, by its own state and by the work
      done (:class:`BlockCalls`); a repeated call gives the same bytes (the cache resets between calls); for
      MagCache, each call's decisions follow :data:`MAG_SCHEDULE`;
    - accelerated: each call byte-equal to eager's, with eager's decisions; the first four calls captured
      with nothing run eagerly, and each repeat ran on replays of the transformer's own graphs alone (no
      capture, no fallback, no miss: ``assert_graphs_ran``).

    Returns a line for the log.
    """
    threshold = 1.0
    if kind == "first-block":
        threshold = _threshold_for_calls(reference, pipeline, sizes)
    enable_cache(reference, _mixed_config(kind, threshold))
    log, blocks = SkipLog(reference.transformer), BlockCalls(reference.transformer)
    expected, decisions = [], []
    try:
        for call in MIXED_SEQUENCE:
            start = len(log.decisions)
            expected.append(mixed_call(reference, pipeline, call, sizes))
            decisions.append(log.decisions[start:])
    finally:
        log.remove()
        blocks.remove()
        disable_cache(reference)
    computed = sum(map(sum, decisions))
    assert 0 < log.skipped < log.calls, f"eager: skipped {log.skipped} of {log.calls} transformer calls"
    assert blocks.calls == computed, f"eager: the last block ran {blocks.calls} times, the cache computed {computed}"
    half = len(MIXED_CALLS)
    for i in range(half):
        assert torch.equal(expected[i], expected[i + half]), f"eager: call {i + half} differs from call {i}"
    if kind == "magcache":
        for call, made in zip(MIXED_SEQUENCE, decisions):
            per_step = len(made) // MIXED_STEPS  # Qwen-Image's true CFG: cond and uncond, each with its own state
            assert per_step * MIXED_STEPS == len(made), (call, made)
            assert made == [d for d in MAG_SCHEDULE for _ in range(per_step)], (call, made)

    enable_cache(pipe, _mixed_config(kind, threshold))
    accelerate(pipe, **accelerate_kwargs)
    log = SkipLog(pipe.transformer)
    check = ReplayCheck(pipe) if accelerate_kwargs.get("debug") else None
    try:
        for i, call in enumerate(MIXED_SEQUENCE):
            start = len(log.decisions)
            image = mixed_call(pipe, pipeline, call, sizes)
            assert torch.equal(image, expected[i]), f"call {i} {call}: not eager's bytes"
            assert log.decisions[start:] == decisions[i], f"call {i} {call}: {log.decisions[start:]} != {decisions[i]}"
            if i == half - 1:
                # Every combination seen. A cache state keys its own graphs, so a first call may capture every
                # step and replay none: the warm-up calls must have captured, with nothing run eagerly.
                report = stats(pipe)
                transformer = report["components"]["transformer"]
                assert transformer["captures"] > 0 and transformer["eager_fallbacks"] == 0, transformer
                assert not [s for s in report["signatures"] if s["status"] == "failed"], report["signatures"]
            elif i >= half:  # a repeat: replays alone, the transformer's own, no capture, no fallback
                report = assert_graphs_ran(pipe, report, captures=False, components=("transformer",))
        assert report["cache_hooks"] and report["cache_states"] > 0, report
        if check is not None:
            assert check.compared > 0, "no run was compared with an earlier one of its key"
    finally:
        log.remove()
        if check is not None:
            check.remove()
        restore(pipe)
        disable_cache(pipe)
    return (
        f"{pipeline}/{kind}: skipped {log.skipped}/{log.calls} (threshold {threshold}), "
        f"captures {report['captures']}, replays {report['replays']}, states {report['cache_states']}, "
        f"branches {report['cache_branches']}"
    )


def _threshold_for_calls(pipe: Any, pipeline: str, sizes: tuple[tuple[int, int], ...]) -> float:
    """The first threshold of :data:`FBC_THRESHOLDS` under which eager FirstBlockCache both skips and computes
    some transformer calls over :data:`MIXED_CALLS`."""

    def run() -> None:
        for call in MIXED_CALLS:
            mixed_call(pipe, pipeline, call, sizes)

    return _first_mixed_threshold(pipe, run, f"{pipeline}'s mixed calls")


# ------------------------------------------------------------------------------ captures per call
# A cache's decisions key the transformer's graphs, its step counters do not: per argument signature, one graph
# computes and one skips, whatever the step (issue 36). Qwen-Image's true CFG calls the transformer with two
# argument signatures per step (cond and uncond prompts of different lengths), Z-Image's batched CFG with one.
COUNT_STEPS = 10
SIGNATURES = {"qwen-image": 2, "z-image": 1}
COUNT_CASE = {"qwen-image": "true_cfg", "z-image": "cfg"}
# MagCache over 10 steps with ratios whose accumulated error decides (see MAG_RATIOS); with fewer configured
# steps than the call runs, the state starts over mid-call (diffusers resets it after num_inference_steps).
MAG_RATIOS_10 = (1.0, 0.99, 1.08, 0.97, 1.01, 1.12, 0.98, 1.0, 1.06, 0.95)


def counting_config(kind: str, steps: int, threshold: float = 1.0) -> Any:
    """Configs whose decisions vary over :data:`COUNT_STEPS` steps; TaylorSeer's with second-order factors,
    so that its updates and predictions take several shapes (orders 1 to 3, offsets 1 and 2)."""
    if kind == "magcache":
        return MagCacheConfig(
            mag_ratios=list(MAG_RATIOS_10[:steps]),
            num_inference_steps=steps,
            threshold=0.1,
            max_skip_steps=COUNT_STEPS,
            retention_ratio=0.1,
        )
    if kind == "taylorseer":
        return TaylorSeerCacheConfig(
            cache_interval=3, disable_cache_before_step=2, max_order=2, taylor_factors_dtype=torch.float32
        )
    return cache_config(kind, steps, threshold)


def check_captures_per_call(
    reference: Any,
    pipe: Any,
    pipeline: str,
    kind: str,
    sizes: tuple[tuple[int, int], ...],
    *,
    config_steps: int = COUNT_STEPS,
    **accelerate_kwargs: Any,
) -> str:
    """Calls of :data:`COUNT_STEPS` steps with CFG on ``reference`` (eager) and ``pipe`` (accelerated with
    ``accelerate_kwargs``), both with the same cache ``kind``, at ``sizes[0]``, ``[0]``, ``[1]``, ``[0]``,
    ``[1]``; asserts:

    - eager: the cache both skipped and computed;
    - accelerated: every call byte-equal to eager's and run on the transformer's graphs; the first call at
      each size captured at most two transformer graphs per argument signature (captures and branches:
      at most 4 for Qwen-Image, 2 for Z-Image), the repeats none;
    - in debug mode, :class:`ReplayCheck`: a graph captured at one step would be the one replayed at the
      others, and a replay would leave eager's state.

    Returns a line for the log.
    """
    case = COUNT_CASE[pipeline]

    def call(target: Any, size: int) -> torch.Tensor:
        height, width = sizes[size]
        return run_case(target, pipeline, case, height=height, width=width, steps=COUNT_STEPS)

    threshold = 1.0
    if kind == "first-block":
        threshold = _first_mixed_threshold(reference, lambda: [call(reference, i) for i in range(2)], pipeline)
    enable_cache(reference, counting_config(kind, config_steps, threshold))
    log = SkipLog(reference.transformer)
    try:
        expected = [call(reference, i) for i in range(2)]
    finally:
        log.remove()
        disable_cache(reference)
    assert 0 < log.skipped < log.calls, f"eager: skipped {log.skipped} of {log.calls} transformer calls"

    enable_cache(pipe, counting_config(kind, config_steps, threshold))
    accelerate(pipe, **accelerate_kwargs)
    check = ReplayCheck(pipe) if accelerate_kwargs.get("debug") else None
    limit = 2 * SIGNATURES[pipeline]
    counts, seen = [], set()
    try:
        report = stats(pipe)
        for index, size in enumerate((0, 0, 1, 0, 1)):
            before = report
            image = call(pipe, size)
            assert torch.equal(image, expected[size]), f"call {index} at {sizes[size]}: not eager's bytes"
            report = stats(pipe)
            counts.append(
                _transformer_graphs(
                    report,
                    before,
                    f"call {index} at {sizes[size]}",
                    first_sight=size not in seen,
                    limit=limit,
                    why=f" ({SIGNATURES[pipeline]} argument signature(s), compute and skip each)",
                    fallbacks=False,
                )
            )
            seen.add(size)
        if check is not None:
            assert check.compared > 0, "no run was compared with an earlier one of its key"
    finally:
        if check is not None:
            check.remove()
        restore(pipe)
        disable_cache(pipe)
    compared = f", runs compared {check.compared} of {check.runs}" if check is not None else ""
    return (
        f"{pipeline}/{kind} (configured for {config_steps} steps): skipped {log.skipped}/{log.calls} in eager, "
        f"transformer graphs per call {counts}, states {report['cache_states']}, branches {report['cache_branches']}"
        f"{compared}"
    )


# ------------------------------------------------------------------------------ replay checks (CPU)
# Debug mode runs the hooks' Python at every call, so by itself it cannot show that a graph captured at one
# step is right at another, nor that a replay leaves the state eager leaves. ReplayCheck shows both on the CPU:
#
# - every run of the transformer (debug capture or replay) is traced, op by op, outside the eager breaks: the
#   op, its Python arguments and, per tensor, where it comes from (an earlier op of the run, a break's result, or
#   a tensor that lives across runs, by address: weights, static inputs, the cache's buffers) with its layout.
#   Two runs with the same signature key and the same break results must give the same trace: what a graph
#   captured at the first would replay at the second. Ops on host values (MagCache's accumulators, CPU tensors
#   that a capture on a GPU does not record) are left out.
# - after each run whose (key, break results) ran before, the Python state the hooks left is compared with what
#   a replay gives: the state as the call found it, then ``CacheState.apply`` with the first run's record.
#   TaylorSeer's state is left out: in a replay its breaks run diffusers' own code on the real state.


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Trace(TorchDispatchMode):
    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.ops: list[Any] = []
        self.labels: dict[int, str] = {}
        self.host = set(host)

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            where = self.labels.get(_storage(value), f"lives@{_storage(value):#x}")
            return (where, tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._describe(v) for v in value)
        if isinstance(value, dict):
            return {k: self._describe(v) for k, v in value.items()}
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        described = None if graphs._IN_BREAK.get() else self._describe((args, kwargs))
        if described is not None and func is torch.ops.aten.lift_fresh.default:
            # its argument is a tensor torch.tensor() just built from Python data, outside dispatch: a new
            # storage whose address may be one an earlier op's result had (a constant on a GPU: python_data)
            described = ("python data", tuple(args[0].shape), args[0].dtype, args[0].tolist())
        out = func(*args, **kwargs)
        if described is None:  # inside an eager break: not in a graph; its results are labelled by ReplayCheck
            return out
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(_storage(t) in self.host for t in inputs):
            self.host.update(_storage(t) for t in made)  # host arithmetic: not in a graph
            return out
        index = len(self.ops)
        self.ops.append((str(func), described))
        for j, tensor in enumerate(made):
            self.labels[_storage(tensor)] = f"op {index}.{j}"
            self.host.discard(_storage(tensor))
        return out


class ReplayCheck:
    """Installs the checks above on an accelerated (debug mode) pipeline's transformer; ``remove()`` takes
    them off. ``runs`` and ``compared`` count the runs traced and the runs compared with an earlier one."""

    def __init__(self, pipe: Any) -> None:
        feature = next(f for f in pipe._bcg_state.all_features() if f.name == "step caching")
        self.runner, self.cache = feature.target.runner, feature.state
        assert self.runner.debug, "ReplayCheck emulates replays in debug mode; a GPU replays for real"
        # (key, argument spec, break results) -> (the reference trace, the first run's record, runs seen)
        self.first: dict[Any, tuple[list[Any], Any, int]] = {}
        self.runs = self.compared = 0
        self._key, self._start, self._breaks, self._trace = None, None, [], None
        self._taylor_step = self.cache.taylor_step
        self.cache.key = self._keyed
        self.runner._run = self._run
        self.cache.taylor_step = self._noting(self._taylor_step)
        self._fbc = kinds._fbc_decision
        kinds._fbc_decision = self._noting(self._fbc)
        self._dit = self.cache.cachedit.call  # Cache-DiT's breaks (its context manager's methods)
        self.cache.cachedit.call = self._noting(self._dit)

    def remove(self) -> None:
        vars(self.cache).pop("key", None)
        vars(self.runner).pop("_run", None)
        self.cache.taylor_step = self._taylor_step
        kinds._fbc_decision = self._fbc
        self.cache.cachedit.call = self._dit

    def _noting(self, brk: Any) -> Any:
        def noted(*args: Any) -> Any:
            result = brk(*args)
            leaves, spec = flatten(result)
            if self._trace is not None:  # a graph reads a break's tensors from bridges: by the break's place
                for j, tensor in enumerate(leaves):
                    self._trace.labels[_storage(tensor)] = f"break {len(self._breaks)}.{j}"
            self._breaks.append(spec)
            return result

        return noted

    def _keyed(self) -> Any:
        self._key = type(self.cache).key(self.cache)
        self._start = self.cache.checkpoint()
        return self._key

    def _host(self) -> set[int]:
        """The storages of host values: MagCache's ratios and the accumulators its states hold now."""
        host = set()
        for holder in self.cache._holders.values():
            config = getattr(holder.hook, "config", None)
            if isinstance(getattr(config, "mag_ratios", None), torch.Tensor):
                host.add(_storage(config.mag_ratios))
            planned = [getattr(holder.plan, "host", {})]  # MagCache's plan, checked against the state after a run
            for values in [*(vars(state) for state in holder.manager._state_cache.values()), *planned]:
                for name in ("accumulated_ratio", "accumulated_err"):
                    if isinstance(values.get(name), torch.Tensor):
                        host.add(_storage(values[name]))
        return host

    def _run(self, args: tuple, kwargs: dict) -> Any:
        self._breaks = []
        graphs._FINDERS[0] += 1  # breaks then say that they run (graphs._IN_BREAK)
        try:
            with _Trace(self._host()) as trace:
                self._trace = trace
                result = type(self.runner)._run(self.runner, args, kwargs)
        finally:
            graphs._FINDERS[0] -= 1
            self._trace = None
        self.runs += 1
        key = (self._key, flatten((args, kwargs))[1], tuple(self._breaks))
        first = self.first.get(key)
        if first is None:
            self.first[key] = (trace.ops, self.cache.record(), 1)
            return result
        ops, record, seen = first
        if seen == 1 and trace.ops != ops:
            # The first run of a key may initialise what later runs reuse (Qwen-Image's RoPE tables, in an
            # lru_cache): on a GPU, warm-ups run before the capture. The second run is the reference then.
            ops = trace.ops
        assert trace.ops == ops, _first_difference(ops, trace.ops)
        self.first[key] = (ops, record, seen + 1)
        self._compare_with_apply(record)
        self.compared += 1
        return result

    def _compare_with_apply(self, record: Any) -> None:
        holders = [h for h in self.cache._holders.values() if h.kind.name != "TaylorSeer"]
        left = {id(h): _state_items(h) for h in holders}
        after = self.cache.checkpoint()
        self.cache.rewind(self._start)
        self.cache.apply(record)
        replayed = {id(h): _state_items(h) for h in holders}
        self.cache.rewind(after)
        for holder in holders:
            a, b = left[id(holder)], replayed[id(holder)]
            assert a.keys() == b.keys(), (holder.kind.name, a.keys(), b.keys())
            wrong = [name for name in a if not _same_value(a[name], b[name])]
            assert not wrong, (
                f"{holder.kind.name}: a replay would leave {[(n, b[n]) for n in wrong]}, eager {[(n, a[n]) for n in wrong]}"
            )


def _state_items(holder: Any) -> dict[str, Any]:
    state = holder.state()
    return {} if state is None else dict(vars(state))


def _same_value(a: Any, b: Any) -> bool:
    """Tensors kept by the cache must be the same objects (its buffers); host values equal in type and value."""
    la, sa = flatten(a)
    lb, sb = flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    return all(x is y or (x.device.type == "cpu" and x.dim() == 0 and torch.equal(x, y)) for x, y in zip(la, lb))


def _first_difference(old: list[Any], new: list[Any]) -> str:
    for index, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return f"op {index} differs from the first run with this key and path: {a} against {b}"
    return f"{len(old)} ops in the first run with this key and path, {len(new)} now"


# ------------------------------------------------------------------------------------------- Cache-DiT
# Cache-DiT's DBCache on the tiny pipelines (2 blocks): Fn=1 block computes every step, the other is cached.
# "static": a step computation mask alone decides (computing 5 of 8 steps); "dynamic": the mask's cache steps are
# decided by the residual difference against a threshold (random weights: near 1, see DIT_THRESHOLDS; Cache-DiT
# reuses without reading it from 1 up; on tiny Z-Image every difference is above 1: Qwen-Image only);
# "taylorseer": the static mask with the TaylorSeer calibrator forecasting the cached residual.
DIT_KINDS = ("static", "dynamic", "taylorseer")
DIT_STEPS = 8
DIT_MASK = (1, 1, 0, 1, 0, 0, 1, 0)
DIT_THRESHOLDS = (0.9, 0.95, 0.99)


def cachedit_options(kind: str, steps: int = DIT_STEPS, threshold: float = 1.0) -> dict[str, Any]:
    """``cache_dit.enable_cache`` keyword arguments for ``kind`` of :data:`DIT_KINDS` (fresh objects each call:
    Cache-DiT keeps and edits them)."""
    import cache_dit

    mask = list(DIT_MASK) * (steps // len(DIT_MASK) + 1)
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=1,
        num_inference_steps=steps,
        residual_diff_threshold=threshold,
        steps_computation_mask=mask[:steps],
        steps_computation_policy="dynamic" if kind == "dynamic" else "static",
    )
    options: dict[str, Any] = {"cache_config": config}
    if kind == "taylorseer":
        options["calibrator_config"] = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1)
    return options


def cachedit_cached(pipe: Any) -> tuple[int, int]:
    """(transformer calls Cache-DiT reused the cache for, all transformer calls) in the pipeline's last call."""
    cached = calls = 0
    for context in pipe.transformer._context_manager._cached_context_manager.values():
        cached += len(context.cached_steps) + len(context.cfg_cached_steps)
        calls += context.transformer_executed_steps
    return cached, calls


def dit_threshold(make_pipe: Any, pipeline: str, sizes: tuple[tuple[int, int], ...]) -> float:
    """The first threshold of :data:`DIT_THRESHOLDS` under which eager Cache-DiT ("dynamic") both reuses the cache
    on some of the mask's cache steps and computes others."""
    import cache_dit

    for threshold in DIT_THRESHOLDS:
        pipe = make_pipe()
        cache_dit.enable_cache(pipe, **cachedit_options("dynamic", threshold=threshold))
        _dit_call(pipe, pipeline, sizes, 0, 0)
        cached, calls = cachedit_cached(pipe)
        # the mask computes 4 of 8 steps itself: a dynamic decision computed some of the other 4
        if 0 < cached < calls // 2:
            return threshold
    raise AssertionError(f"no threshold in {DIT_THRESHOLDS} gives both decisions on {pipeline}")


DIT_CALLS = ((0, 0), (0, 1), (1, 0), (0, 0), (1, 1), (1, 0))  # (size index, prompt index): first sights, repeats


def check_cachedit_calls(
    make_pipe: Any,
    pipeline: str,
    kind: str,
    sizes: tuple[tuple[int, int], ...],
    *,
    when: str = "before",
    threshold: float = 1.0,
    **accelerate_kwargs: Any,
) -> str:
    """Calls of :data:`DIT_STEPS` steps with CFG, at two sizes and two prompts (:data:`DIT_CALLS`), on an eager
    pipeline and an accelerated one with the same Cache-DiT options (``kind``), enabled ``before`` or ``after``
    ``accelerate``. Asserts: eager reused the cache on some calls and not others; every accelerated call gives
    eager's bytes on the transformer's graphs, with no eager fallback; a call that meets a new (size, prompt)
    captures at most two graphs per argument signature (compute, reuse), a repeat none; in debug mode,
    :class:`ReplayCheck` compared runs. Returns a line for the log (the captures per call)."""
    import cache_dit

    reference = make_pipe()
    cache_dit.enable_cache(reference, **cachedit_options(kind, threshold=threshold))
    expected, reused = {}, []
    for size, prompt in DIT_CALLS[:3] + DIT_CALLS[4:5]:
        expected[size, prompt] = _dit_call(reference, pipeline, sizes, size, prompt)
        reused.append(cachedit_cached(reference))
    assert all(0 < cached < calls for cached, calls in reused), f"eager Cache-DiT reused (cached, calls) {reused}"

    pipe = make_pipe()
    if when == "before":
        cache_dit.enable_cache(pipe, **cachedit_options(kind, threshold=threshold))
    accelerate(pipe, **accelerate_kwargs)
    if when == "after":
        _dit_call(pipe, pipeline, sizes, 0, 0)  # graphs without the cache first
        cache_dit.enable_cache(pipe, **cachedit_options(kind, threshold=threshold))
    check = ReplayCheck(pipe) if accelerate_kwargs.get("debug") else None
    limit = 2 * SIGNATURES[pipeline]
    counts, seen = [], set()
    try:
        report = stats(pipe)
        for index, (size, prompt) in enumerate(DIT_CALLS):
            before = report
            image = _dit_call(pipe, pipeline, sizes, size, prompt)
            assert torch.equal(image, expected[size, prompt]), (
                f"call {index} {sizes[size]}, prompt {prompt}: not eager's"
            )
            assert cachedit_cached(pipe) == reused[list(expected).index((size, prompt))]
            report = stats(pipe)
            first = (size, prompt) not in seen
            counts.append(_transformer_graphs(report, before, f"call {index}", first_sight=first, limit=limit))
            seen.add((size, prompt))
        if check is not None:
            assert check.compared > 0, "no run was compared with an earlier one of its key"
    finally:
        if check is not None:
            check.remove()
        restore(pipe)
    compared = f", runs compared {check.compared} of {check.runs}" if check is not None else ""
    return (
        f"{pipeline}/cache-dit {kind} ({when} accelerate): reused (cached, calls) {reused} in eager, transformer "
        f"graphs per call {counts}, branches {report['cache_branches']}{compared}"
    )


def _transformer_graphs(
    report: dict[str, Any],
    before: dict[str, Any],
    where: str,
    *,
    first_sight: bool,
    limit: int,
    why: str = "",
    fallbacks: bool = True,
) -> int:
    """The transformer graphs one call captured (captures plus cache branches, from ``before`` to ``report``).
    Asserts that a call meeting its shape for the first time captured between 1 and ``limit`` (``why``: what
    the limit counts) and a repeat none, that the graphs ran (:func:`assert_report_ran`), and with
    ``fallbacks`` that the call ran no eager fallback."""
    new, old = report["components"]["transformer"], before["components"]["transformer"]
    if fallbacks:
        assert new["eager_fallbacks"] == old["eager_fallbacks"], f"{where} ran eagerly: {report['reason']}"
    captured = new["captures"] - old["captures"] + report["cache_branches"] - before["cache_branches"]
    if first_sight:
        assert 0 < captured <= limit, f"{where}: {captured} transformer graphs, more than {limit}{why}"
    else:
        assert captured == 0, f"{where} captured {captured} graphs again"
    assert_report_ran(report, before, captures=first_sight, components=("transformer",))
    return captured


def _dit_call(pipe: Any, pipeline: str, sizes: tuple[tuple[int, int], ...], size: int, prompt: int) -> torch.Tensor:
    return mixed_call(pipe, pipeline, (size, prompt, True), sizes)


# ------------------------------------------------------------------------ CFG batching under a cache
# Fast mode batches Qwen-Image's true CFG calls in one joint cache context (step_caching.cfg_join). The prompt and
# a negative prompt of the same token length (no padding in the batch) or of another (padded and masked).
CFG_PROMPT = "a red fox in the snow"  # 11 tokens on the tiny tokenizer
SAME_LENGTH_NEGATIVE = "a blue cat on the grass"  # 11 tokens
OTHER_LENGTH_NEGATIVE = "blurry, low quality"  # 20 tokens


def cfg_decisions(pipe: Any, negative: str, *, steps: int, size: tuple[int, int]) -> tuple[torch.Tensor, list[bool]]:
    """A true-CFG Qwen-Image call: the image (CPU) and each transformer call's decision (True: computed), in order."""
    log = SkipLog(pipe.transformer)
    try:
        out = pipe(
            prompt=CFG_PROMPT,
            negative_prompt=negative,
            true_cfg_scale=4.0,
            height=size[0],
            width=size[1],
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="pt",
        )
        return out.images.detach().cpu(), log.decisions
    finally:
        log.remove()


def stop_batching_at(monkeypatch: Any, how: str, call: int, steps: int) -> None:
    """Make the CFG batcher's ``call``-th call of each pipeline call of ``steps`` steps (from 1, counting both calls
    of every step) run alone: ``drop``, an uncond call finds its speculated half computed for other inputs;
    ``alone``, a cond call is unbatchable."""
    from bcg_diffusion.features import cfg_batching

    counter = {"calls": 0}
    original_call = cfg_batching.CfgBatcher.__call__
    name = "_mismatch" if how == "drop" else "_unbatchable"
    original = getattr(cfg_batching.CfgBatcher, name)

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter["calls"] += 1
        return original_call(self, *args, **kwargs)

    def forced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counter["calls"] % (2 * steps) == call:
            return "forced by the test"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cfg_batching.CfgBatcher, "__call__", counting)
    monkeypatch.setattr(cfg_batching.CfgBatcher, name, forced)
