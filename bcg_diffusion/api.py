"""Public entry points: :func:`accelerate`, :func:`restore`, :func:`stats`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from . import fast, parallel
from .budget import SignatureBudget
from .cfg_batch import CfgBatcher
from .config import AccelerateConfig
from .graphs import GraphPool
from .hooks import MethodPatches, diffusers_hooks, serialise_calls, unserialise_calls, watch_component
from .patches import FunctionPatch
from .patches.attention import TEXT_LENGTHS_KWARG
from .patches.collectives import COLLECTIVES_PATCH, MASK_GATHER_PATCH
from .patches.group_norm import VAE_GROUP_NORM_PATCH, patch_group_norms
from .patches.text_encoder import CAUSAL_MASK_PATCH
from .pipelines import PipelineAdapter, adapter_for
from .runner import BCGWarning, GraphRunner
from .text_trim import TrimmedTextEncoder

__all__ = ["accelerate", "eager", "restore", "stats"]

logger = logging.getLogger(__name__)

P = TypeVar("P")

_STATE_ATTR = "_bcg_state"


@dataclass
class _PipelineState:
    config: AccelerateConfig
    adapter: PipelineAdapter
    active: bool
    reason: str | None = None
    pool: GraphPool | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    runners: dict[str, GraphRunner] = field(default_factory=dict)
    patches_made: MethodPatches = field(default_factory=MethodPatches)
    patches: list[FunctionPatch] = field(default_factory=list)
    compiled: fast.CompiledBlocks | None = None
    budget: SignatureBudget | None = None
    scoped_patches: list[str] = field(default_factory=list)  # fast-mode patches applied to this model only
    compiles_saved: int = 0  # state.compiled.compiles when the portable compile cache was last written
    layout: parallel.ParallelLayout | None = None  # the transformer's context parallelism, if any
    consensus: parallel.CaptureConsensus | None = None  # keeps the ranks' captures in step
    batch_cfg: bool = False  # fast mode: batch true CFG's two transformer calls per step
    cfg_batcher: CfgBatcher | None = None
    text_trim: TrimmedTextEncoder | None = None  # fast mode: the text encoder skips the prompts' padding


def _check_pipeline(pipe: Any, caller: str) -> None:
    if pipe is None:
        raise TypeError(f"{caller}() needs a diffusers pipeline, got None")
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(
            f"{caller}() needs a diffusers DiffusionPipeline, got {type(pipe).__module__}.{type(pipe).__name__}"
        )


def _accelerated_state(pipe: Any, caller: str) -> _PipelineState:
    _check_pipeline(pipe, caller)
    state: _PipelineState | None = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{caller}(): this pipeline was not accelerated (call bcg_diffusion.accelerate(pipe) first)")
    return state


def _execution_device(pipe: Any) -> torch.device:
    transformer = getattr(pipe, "transformer", None)
    if isinstance(transformer, torch.nn.Module):
        for parameter in transformer.parameters():
            return parameter.device
    return torch.device(getattr(pipe, "device", "cpu"))


def _with_components(pipe: Any, config: AccelerateConfig, adapter: PipelineAdapter) -> AccelerateConfig:
    """``config`` with its components named: the adapter's defaults when it leaves them to us.

    A text encoder that is not on the transformer's device stays eager (a graph cannot run it): with a
    warning when the user named it, with a log line when it came with the defaults. A defaulted one
    with offload or diffusers hooks stays eager too, instead of taking the whole pipeline eager with
    it (:func:`_eager_reason` does that for components the user names).
    """
    chosen = config.components is not None
    components = config.components if chosen else adapter.default_components
    encoder = getattr(pipe, "text_encoder", None)
    if "text_encoder" in components and isinstance(encoder, torch.nn.Module):
        device = _execution_device(pipe)
        elsewhere = sorted({str(p.device) for p in encoder.parameters() if p.device != device})
        reason = f"it is on {elsewhere}, not on the transformer's {device}" if elsewhere else None
        if reason is None and not chosen and (hasattr(encoder, "_hf_hook") or diffusers_hooks(encoder)):
            reason = "it has offload or diffusers hooks"
        if reason is not None:
            if chosen:
                warnings.warn(f"bcg-diffusion: the text encoder stays eager: {reason}", BCGWarning, stacklevel=3)
            else:
                logger.info("the text encoder stays eager: %s", reason)
            components = tuple(c for c in components if c != "text_encoder")
    return dataclasses.replace(config, components=components) if components != config.components else config


def _eager_reason(pipe: Any, config: AccelerateConfig, device: torch.device) -> str | None:
    """Why this pipeline must stay eager (None when graphs can be used). Debug mode skips only the
    device checks: it mirrors the graph path, so what would break a graph keeps it eager too."""
    if not config.debug:
        if device.type != "cuda":
            return (
                f"the pipeline is on {device}, CUDA graphs need a CUDA device (use debug=True to test the runner path)"
            )
        if not torch.cuda.is_available():
            return "CUDA is not available"
    for name in config.components:
        module = getattr(pipe, name, None)
        if module is not None and hasattr(module, "_hf_hook"):
            return (
                f"{name} has accelerate offload hooks (enable_*_cpu_offload): graphs need weights resident on the GPU"
            )
        hooks = diffusers_hooks(module) if isinstance(module, torch.nn.Module) else []
        if hooks:
            return (
                f"{name} has diffusers hooks {hooks} (caching, layerwise casting or group offloading decide on the "
                "host or move weights every forward); remove them, or accept eager speed"
            )
    return None


def accelerate(pipe: P, config: AccelerateConfig | None = None, **options: Any) -> P:
    """Run the pipeline's transformer, VAE decode and (Z-Image) text encoder as replayed breakable
    CUDA graphs.

    Returns the same pipeline object, patched in place: every call then captures one graph per input
    signature (resolution, batch, text length, CFG mode) on first use and replays it afterwards, with
    images byte-identical to eager in the default ``mode="exact"``. ``mode="fast"`` also compiles
    the transformer's repeated blocks with inductor and captures the compiled kernels (see
    :mod:`bcg_diffusion.fast`). ``warmup=[(w, h), ...]`` captures before returning (see
    :func:`~bcg_diffusion.warm_up`).

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (Qwen-Image and Z-Image are tested; others
            get the generic adapter with a warning) on a CUDA device.
        config: an :class:`AccelerateConfig`; ``options`` override its fields
            (``accelerate(pipe, debug=True)``).

    Refuses: ``None`` or a non-pipeline (TypeError), unknown or invalid options (TypeError /
    ValueError), a second ``accelerate`` with different options (ValueError: ``restore`` first). A
    second call with the same options returns the pipeline unchanged. A pipeline on CPU (without
    ``debug=True``) or with offload hooks is left eager with one warning.

    >>> pipe = accelerate(pipe)                  # doctest: +SKIP
    >>> image = pipe("a red fox", height=512, width=512).images[0]   # doctest: +SKIP
    >>> stats(pipe)["captures"]                  # doctest: +SKIP
    """
    _check_pipeline(pipe, "accelerate")
    config = AccelerateConfig.from_options(config, options)
    existing: _PipelineState | None = getattr(pipe, _STATE_ATTR, None)
    adapter = existing.adapter if existing is not None else adapter_for(pipe)
    config = _with_components(pipe, config, adapter)
    if existing is not None:
        if existing.config == config:
            logger.info("accelerate(): pipeline already accelerated with these options; nothing to do")
            return pipe
        raise ValueError(
            "this pipeline is already accelerated with different options "
            f"({existing.config} vs {config}); call bcg_diffusion.restore(pipe) first"
        )
    device = _execution_device(pipe)
    reason = _eager_reason(pipe, config, device)
    state = _PipelineState(config=config, adapter=adapter, active=reason is None, reason=reason)
    if reason is not None:
        warnings.warn(f"bcg-diffusion: leaving {type(pipe).__name__} eager: {reason}", BCGWarning, stacklevel=2)
        object.__setattr__(pipe, _STATE_ATTR, state)
        return pipe

    if not config.debug:
        state.pool = GraphPool(device)
    if config.max_signatures is not None:
        state.budget = SignatureBudget(config.max_signatures)
    patches = adapter.patches + ((CAUSAL_MASK_PATCH,) if "text_encoder" in config.components else ())
    state.layout = parallel.layout_of(getattr(pipe, "transformer", None))
    if state.layout is not None:
        state.consensus = parallel.CaptureConsensus(state.layout.group)
        patches += (COLLECTIVES_PATCH, MASK_GATHER_PATCH)
    for patch in patches:
        if patch.apply():
            state.patches.append(patch)
    adapter.install(pipe, state.patches_made)
    if config.text_buckets is not None:
        try:
            adapter.install_text_buckets(pipe, config.text_buckets, state.patches_made)
        except ValueError as exc:
            warnings.warn(f"bcg-diffusion: text_buckets ignored: {exc}", BCGWarning, stacklevel=2)
    if config.mode == "fast":
        _compile_blocks(pipe, state)
        state.batch_cfg = _batch_cfg(pipe, config, state)
    for component in config.components:
        method = adapter.targets.get(component)
        module = getattr(pipe, component, None)
        if method is None or module is None:
            continue
        _install(state, component, module, method)
    if config.mode == "fast":
        _trim_text_encoder(pipe, state)
        _patch_vae_group_norms(pipe, state)
    if not state.runners:
        warnings.warn(
            f"bcg-diffusion: {type(pipe).__name__} has none of {config.components}", BCGWarning, stacklevel=2
        )
    serialise_calls(pipe, state.lock)
    object.__setattr__(pipe, _STATE_ATTR, state)
    if config.warmup:
        from .warmup import warm_up

        warm_up(pipe, config.warmup, cfg=config.warmup_cfg)
    return pipe


def _compile_blocks(pipe: Any, state: _PipelineState) -> None:
    """Fast mode: compile the transformer's repeated blocks (before its runner is installed, so that
    warm-up compiles and captures record the compiled kernels). Without blocks to compile, the
    pipeline keeps exact-mode graphs and says so."""
    transformer = getattr(pipe, "transformer", None)
    if state.layout is not None:
        # Compiled blocks would trace diffusers' collectives into their code, and so into our graphs.
        warnings.warn(
            "bcg-diffusion: mode='fast' does not support context parallelism yet (compiled blocks would "
            "hold the collectives, which must stay eager breaks); using exact-mode graphs",
            BCGWarning,
            stacklevel=3,
        )
        return
    if state.config.compile_cache_dir is not None:
        fast.use_compile_cache_dir(state.config.compile_cache_dir)
    try:
        if "transformer" not in state.config.components or not isinstance(transformer, torch.nn.Module):
            raise ValueError("fast mode compiles the transformer, which is not among the accelerated components")
        for patch in state.adapter.fast_patches:
            try:
                if patch.apply(transformer, state.patches_made):
                    state.scoped_patches.append(patch.name)
            except ValueError as exc:
                warnings.warn(f"bcg-diffusion: fast-mode patch {patch.name} skipped: {exc}", BCGWarning, stacklevel=3)
        state.compiled = fast.compile_repeated_blocks(transformer, state.patches_made)
    except ValueError as exc:
        warnings.warn(
            f"bcg-diffusion: mode='fast' falls back to graphs of the eager blocks (not compiled): {exc}",
            BCGWarning,
            stacklevel=3,
        )
        return
    logger.info("fast mode: compiling %d blocks of %s", len(state.compiled.names), type(transformer).__name__)


def _batch_cfg(pipe: Any, config: AccelerateConfig, state: _PipelineState) -> bool:
    """Whether fast mode batches true CFG's calls here: asked for (or left at None), supported by the
    adapter for this very pipeline class (relatives such as the Edit variants call differently), and
    not under context parallelism (fast mode keeps exact graphs there)."""
    if config.batch_cfg is False:
        return False
    if state.adapter.cfg_batch is not None and state.adapter.is_tested(pipe) and state.layout is None:
        return True
    if config.batch_cfg:
        where = "with context parallelism" if state.layout is not None else f"for {type(pipe).__name__}"
        warnings.warn(
            f"bcg-diffusion: batch_cfg is not supported {where}; its CFG calls run one by one",
            BCGWarning,
            stacklevel=3,
        )
    return False


def _trim_text_encoder(pipe: Any, state: _PipelineState) -> None:
    """Fast mode: where the adapter says the pipeline pads prompts for a causal text encoder, wrap the
    encoder's forward (accelerated or not) so that it skips that padding (see :mod:`.text_trim`)."""
    multiple = state.adapter.text_trim_multiple
    encoder = getattr(pipe, "text_encoder", None)
    if multiple is None or not isinstance(encoder, torch.nn.Module) or not state.adapter.is_tested(pipe):
        return
    state.text_trim = TrimmedTextEncoder(encoder.forward, multiple)
    state.patches_made.replace(encoder, "forward", state.text_trim)


def _patch_vae_group_norms(pipe: Any, state: _PipelineState) -> None:
    """Fast mode: the accelerated VAE decoder's group norms take their statistics from one parallel
    reduction (see :mod:`.patches.group_norm`; rounding differs from PyTorch's kernel)."""
    vae = getattr(pipe, "vae", None)
    if "vae" not in state.config.components or not isinstance(vae, torch.nn.Module):
        return
    decoder = getattr(vae, "decoder", vae)
    if patch_group_norms(decoder, state.patches_made):
        state.scoped_patches.append(VAE_GROUP_NORM_PATCH)


def _save_compile_cache(state: _PipelineState) -> None:
    """After a call that compiled something, keep a portable copy of the compile caches (fast mode).
    The caller checks that something was compiled, so a replayed step pays one comparison."""
    directory = state.config.compile_cache_dir
    state.compiles_saved = state.compiled.compiles
    if directory is None:
        return
    try:
        fast.save_compile_cache(f"{directory}/{fast.ARTIFACTS_FILE}")
    except OSError as exc:
        warnings.warn(
            f"bcg-diffusion: could not save the compile cache in {directory}: {exc}", BCGWarning, stacklevel=3
        )


def _install(state: _PipelineState, component: str, module: torch.nn.Module, method: str) -> None:
    original = getattr(module, method)
    fn = state.adapter.runner_callable(component, original)
    state_key = state.adapter.state_key(component, module)
    if component == "transformer":
        fn, state_key = parallel.guarded(fn, state_key, module, state.layout)
    runner = GraphRunner(
        fn,
        name=component,
        pool=state.pool,
        lock=state.lock,
        debug=state.config.debug,
        warmup_runs=state.config.warmup_runs,
        capture_error_mode=state.config.capture_error_mode,
        track_external_tensors=state.config.track_external_tensors,
        state_key=state_key,
        call_key=state.adapter.call_key(component),
        capture_new=state.config.lazy_capture,
        budget=state.budget,
        consensus=state.consensus,
    )
    if component == "transformer" and state.layout is not None and state.layout.anything:
        runner.suspended = "diffusers' ulysses_anything / ring_anything gather sizes on the host (not supported)"

    prepare = state.adapter.prepare_call(component)
    call: Callable[..., Any] = runner
    if component == "transformer" and state.batch_cfg:
        accepted = {k for p in state.adapter.fast_patches if p.name in state.scoped_patches for k in p.accepts}
        lengths_key = TEXT_LENGTHS_KWARG if TEXT_LENGTHS_KWARG in accepted else None
        batcher = state.cfg_batcher = CfgBatcher(
            runner, inspect.signature(original), state.adapter.cfg_batch, text_lengths_key=lengths_key
        )

        def call(*args: Any, **kwargs: Any) -> Any:
            with state.lock:  # the batcher keeps state between calls
                return batcher(*args, **kwargs)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if prepare is not None:
            args, kwargs = prepare(args, kwargs)
        result = call(*args, **kwargs)
        if state.compiled is not None and state.compiled.compiles != state.compiles_saved:
            _save_compile_cache(state)
        return result

    functools.update_wrapper(wrapper, original)
    wrapper.__bcg_runner__ = runner  # type: ignore[attr-defined]
    state.patches_made.replace(module, method, wrapper)
    state.runners[component] = runner
    watch_component(state.patches_made, component, module, runner)


def restore(pipe: P) -> P:
    """Undo :func:`accelerate`: put back every replaced method and patch, and free the graphs.

    Returns the same pipeline, eager again. On a pipeline that was never accelerated it warns and
    does nothing. If something else (an offload hook) wrapped a method on top of ours since, that
    method is left wrapped but our runner inside it becomes a plain call, with a warning.
    """
    _check_pipeline(pipe, "restore")
    state: _PipelineState | None = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        warnings.warn(
            "bcg-diffusion: restore(): this pipeline was not accelerated; nothing to undo", BCGWarning, stacklevel=2
        )
        return pipe
    with state.lock:
        state.patches_made.undo()
        for runner in state.runners.values():
            runner.close()
        if state.active:
            unserialise_calls(pipe)
        for patch in state.patches:
            patch.revert()
        state.runners.clear()
        state.patches.clear()
        state.pool = None
    object.__delattr__(pipe, _STATE_ATTR)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return pipe


@contextlib.contextmanager
def eager(pipe: Any) -> Iterator[Any]:
    """Inside the block, the accelerated pipeline runs its original methods; its graphs are kept.

    For side-by-side comparisons in one process (the benchmark, the demo). Holds the pipeline's lock,
    so accelerated calls from other threads wait until the block ends.

    >>> with eager(pipe):                                   # doctest: +SKIP
    ...     reference = pipe(prompt, output_type="pt").images

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    state = _accelerated_state(pipe, "eager")
    with state.lock:
        runners = list(state.runners.values())
        for runner in runners:
            runner.bypass += 1
        try:
            yield pipe
        finally:
            for runner in runners:
                runner.bypass -= 1


def stats(pipe: Any) -> dict[str, Any]:
    """Counters and per-signature records of an accelerated pipeline.

    Keys: ``active`` (graphs in use), ``reason`` (why not), ``mode``, ``debug``, ``adapter``,
    ``captures``, ``replays``, ``eager_fallbacks``, ``misses`` (calls of a signature never captured
    while ``lazy_capture`` is off; they ran eagerly), ``evictions`` (signatures dropped to stay
    within ``max_signatures``), ``invalidations`` (times the graphs were dropped because weights or
    settings changed), ``capture_seconds``, ``graph_memory_bytes`` (the shared pool's size now),
    ``compiled_blocks``, ``compiles``, ``compile_seconds`` and ``compile_failure`` (fast mode: blocks
    compiled, dynamo compiles inside them, first compiles and recompiles, the wall time of the block
    calls that compiled, and why the blocks went back to eager forwards, if they did; 0 / None in
    exact mode), ``cfg_batched`` and ``cfg_batch_dropped`` (fast
    mode: uncond calls served from a batch with their cond call, and speculated halves left unused;
    see :mod:`bcg_diffusion.cfg_batch`), ``text_encoder_trimmed`` (fast mode: text encodings run
    without the prompts' padding, see :mod:`bcg_diffusion.text_trim`), ``signatures`` (one dict per captured signature:
    component, signature, status, state (what keys it besides the arguments: attention backend,
    parallel layout...), reason, segments, breaks, memory_bytes, capture_seconds, replays),
    ``components`` (counters per component) and ``patches``.

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    state = _accelerated_state(pipe, "stats")
    with state.lock:
        components = {name: dataclasses.asdict(runner.counters) for name, runner in state.runners.items()}
        signatures = [dataclasses.asdict(r) for runner in state.runners.values() for r in runner.records()]
        pool_bytes = state.pool.reserved_bytes() if state.pool is not None else 0
    return {
        "active": state.active,
        "reason": state.reason,
        "mode": state.config.mode,
        "debug": state.config.debug,
        "adapter": state.adapter.name,
        "captures": sum(c["captures"] for c in components.values()),
        "replays": sum(c["replays"] for c in components.values()),
        "eager_fallbacks": sum(c["eager_fallbacks"] for c in components.values()),
        "misses": sum(c["misses"] for c in components.values()),
        "evictions": sum(c["evictions"] for c in components.values()),
        "invalidations": sum(c["invalidations"] for c in components.values()),
        "capture_seconds": sum(c["capture_seconds"] for c in components.values()),
        "graph_memory_bytes": pool_bytes,
        "compiled_blocks": len(state.compiled.names) if state.compiled is not None else 0,
        "compiles": state.compiled.compiles if state.compiled is not None else 0,
        "compile_seconds": state.compiled.compile_seconds if state.compiled is not None else 0.0,
        "compile_failure": state.compiled.failure if state.compiled is not None else None,
        "cfg_batched": state.cfg_batcher.batched if state.cfg_batcher is not None else 0,
        "cfg_batch_dropped": state.cfg_batcher.dropped if state.cfg_batcher is not None else 0,
        "text_encoder_trimmed": state.text_trim.trimmed if state.text_trim is not None else 0,
        "signatures": signatures,
        "components": components,
        "patches": [patch.name for patch in state.patches] + state.scoped_patches,
    }
