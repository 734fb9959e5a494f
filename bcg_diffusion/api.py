"""Public entry points: :func:`accelerate`, :func:`restore`, :func:`stats`."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

from . import features
from .components import follow_components, module_eager_reason
from .config import _KNOWN_COMPONENTS, TEXT_ENCODERS, AccelerateConfig, describe_changes
from .core.hooks import diffusers_hooks, serialise_calls, unserialise_calls
from .core.runner import BCGWarning
from .group import GraphGroup, held_by, pipeline_names
from .pipelines import PipelineAdapter, adapter_for, first_transformer
from .state import (
    RESTORED_ATTR,
    STATE_ATTR,
    PipelineState,
    accelerated_state,
    attach_state,
    check_pipeline,
    mark_restored,
)
from .warmup import warm_up

__all__ = ["accelerate", "eager", "invalidate", "restore", "stats"]

logger = logging.getLogger(__name__)

P = TypeVar("P")


def _execution_device(pipe: Any) -> torch.device:
    transformer = first_transformer(pipe)
    if isinstance(transformer, torch.nn.Module):
        for parameter in transformer.parameters():
            return parameter.device
    return torch.device(getattr(pipe, "device", "cpu"))


def _with_components(pipe: Any, config: AccelerateConfig, adapter: PipelineAdapter) -> AccelerateConfig:
    """``config`` with its components named: the adapter's defaults when it leaves them to us.

    A text encoder or ControlNet that is not on the transformer's device stays eager (a graph cannot run
    it): with a warning when the user named it, with a log line when it came with the defaults. A defaulted
    one with offload or diffusers hooks stays eager too, instead of taking the whole pipeline eager with
    it (:func:`_eager_reason` does that for components the user names), and so does a defaulted text
    encoder whose class is not in the adapter's ``default_text_encoders``.
    """
    chosen = config.components is not None
    components = config.components if chosen else adapter.default_components
    for name in (*TEXT_ENCODERS, "controlnet"):
        module = getattr(pipe, name, None)
        if name not in components or not isinstance(module, torch.nn.Module):
            continue
        device = _execution_device(pipe)
        elsewhere = sorted({str(p.device) for p in module.parameters() if p.device != device})
        reason = f"it is on {elsewhere}, not on the transformer's {device}" if elsewhere else None
        if reason is None and not chosen and (hasattr(module, "_hf_hook") or diffusers_hooks(module)):
            reason = "it has offload or diffusers hooks"
        kind = type(module).__name__
        if reason is None and not chosen and name in TEXT_ENCODERS and kind not in adapter.default_text_encoders:
            reason = f"{kind} is not captured by default (name {name!r} in components= to capture it)"
        if reason is not None:
            if chosen:
                warnings.warn(f"bcg-diffusion: {name} stays eager: {reason}", BCGWarning, stacklevel=3)
            else:
                logger.info("%s stays eager: %s", name, reason)
            components = tuple(c for c in components if c != name)
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
        reason = module_eager_reason(name, getattr(pipe, name, None))
        if reason is not None:
            return reason
    return None


def _unapplied_quantization(config: AccelerateConfig) -> str:
    """What a pipeline left eager says of its ``quantize=`` ("" without one): quantization is applied only to a
    transformer that accelerate takes, so it was not applied either."""
    if config.quantize is None:
        return ""
    if config.quantize == "fp8":
        return (
            '; quantize="fp8" was not applied either: FP8 needs the transformer on a CUDA GPU with compute '
            "capability 8.9 or more (Ada, Hopper, Blackwell), and is applied only to a pipeline accelerate takes"
        )
    return (
        f"; quantize={type(config.quantize).__name__}(...) was not applied either: it is applied only to a "
        "pipeline accelerate takes"
    )


def accelerate(pipe: P, config: AccelerateConfig | None = None, **options: Any) -> P:
    """Run the pipeline's transformer, VAE decode, ControlNet and (Z-Image, FLUX.2 klein) Qwen3 text
    encoder as replayed breakable CUDA graphs.

    Returns the same pipeline object, patched in place: every call then captures one graph per input
    signature (resolution, batch, text length, CFG mode) on first use and replays it afterwards, with
    images byte-identical to eager in the default ``mode="exact"``. ``mode="fast"`` also compiles
    the transformer's repeated blocks with inductor and captures the compiled kernels (see
    :mod:`bcg_diffusion.features.compiled_blocks`). ``warmup=[(w, h), ...]`` captures before returning (see
    :func:`~bcg_diffusion.warm_up`).

    Pipelines that share components (``ZImageImg2ImgPipeline(**pipe.components)``) share their graphs:
    a module is accelerated once, whichever pipeline takes it first, and every pipeline holding it
    replays the same graphs, one pool and one lock for all of them (see :mod:`bcg_diffusion.group`).

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (Qwen-Image and Z-Image with their img2img
            and inpaint relatives are tested; others get the generic adapter with a warning) on a
            CUDA device.
        config: an :class:`AccelerateConfig`; ``options`` override its fields
            (``accelerate(pipe, debug=True)``).

    Refuses: ``None`` or a non-pipeline (TypeError), unknown or invalid options (TypeError /
    ValueError), a second ``accelerate`` with different options (ValueError: ``restore`` first), a
    pipeline sharing components with pipelines accelerated with other options, or with two groups of
    pipelines accelerated apart (ValueError). A second call with the same options returns the pipeline
    unchanged. A pipeline on CPU (without ``debug=True``) or with offload hooks is left eager with one
    warning, which also says that a ``quantize=`` was not applied. The ValueError for other options names
    only the options that differ, old → new (``mode: 'exact' → 'fast'``).

    >>> pipe = accelerate(pipe)                  # doctest: +SKIP
    >>> image = pipe("a red fox", height=512, width=512).images[0]   # doctest: +SKIP
    >>> stats(pipe)["captures"]                  # doctest: +SKIP
    """
    check_pipeline(pipe, "accelerate")
    config = AccelerateConfig.from_options(config, options)
    existing: PipelineState | None = getattr(pipe, STATE_ATTR, None)
    adapter = existing.adapter if existing is not None else adapter_for(pipe)
    config = _with_components(pipe, config, adapter)
    if existing is not None:
        if existing.config == config:
            logger.info("accelerate(): pipeline already accelerated with these options; nothing to do")
            return pipe
        raise ValueError(
            f"this pipeline is already accelerated with other options ({describe_changes(existing.config, config)}); "
            "call bcg_diffusion.restore(pipe) first"
        )
    device = _execution_device(pipe)
    reason = _eager_reason(pipe, config, device)
    state = PipelineState(weakref.ref(pipe), config=config, adapter=adapter, active=reason is None, reason=reason)
    if reason is not None:
        message = f"bcg-diffusion: leaving {type(pipe).__name__} eager: {reason}{_unapplied_quantization(config)}"
        warnings.warn(message, BCGWarning, stacklevel=2)
        attach_state(pipe, state)
        return pipe

    modules = {
        name: module for name in _KNOWN_COMPONENTS if isinstance(module := getattr(pipe, name, None), torch.nn.Module)
    }
    held = {name: record for name, module in modules.items() if (record := held_by(module)) is not None}
    groups = list({id(record.group): record.group for record in held.values()}.values())
    if len(groups) > 1:
        raise ValueError(
            f"{type(pipe).__name__} holds components of pipelines accelerated apart ("
            + "; ".join(f"{name}: {', '.join(pipeline_names(record.group.members))}" for name, record in held.items())
            + "), whose graphs live in separate pools: restore those pipelines, then accelerate them and this "
            "one again, or build this one from one pipeline's components"
        )
    group = groups[0] if groups else None
    if group is not None:
        group.check_joins(pipe, config, adapter)
    else:
        group = GraphGroup(config, adapter, device)
    state.group = group
    with group.lock:
        try:
            taken = group.take(state, {n: m for n, m in modules.items() if n not in held})
        except BaseException:
            group.close()  # a group of its own, with no member yet: its process-wide patches go too
            raise
        state.held = {**held, **taken}
        for record in state.held.values():
            record.holders.append(state)
        group.members.append(state)
    if not state.runners:
        warnings.warn(
            f"bcg-diffusion: {type(pipe).__name__} has none of {config.components}", BCGWarning, stacklevel=2
        )
    serialise_calls(pipe, group.lock, before_call=lambda: follow_components(state))
    attach_state(pipe, state)
    weakref.finalize(pipe, _release_collected, state).atexit = False
    if config.warmup:
        warm_up(pipe, config.warmup, cfg=config.warmup_cfg)
    return pipe


def _release_collected(state: PipelineState) -> None:
    """A pipeline was garbage-collected without ``restore``: release what it held."""
    group = state.group
    if group is None or state not in group.members:
        return
    with group.lock:
        for feature in state.features:
            feature.close()
        group.release(state)


def restore(pipe: P) -> P:
    """Undo :func:`accelerate`: put back every replaced method and patch, and free the graphs.

    Returns the same pipeline, eager again. A module that another accelerated pipeline still holds
    (they were built from shared components) stays accelerated, for every pipeline that calls it,
    ``pipe`` included: a warning names it; restoring the last holder undoes it. The pipeline keeps a
    mark of the restore, so :func:`stats` reports it inactive with the reason. On a pipeline that is not
    accelerated (never, or restored already) it warns and does nothing. If something else (an offload
    hook) wrapped a method on top of ours since, that method is left wrapped but our runner inside it
    becomes a plain call, with a warning.
    """
    check_pipeline(pipe, "restore")
    state: PipelineState | None = getattr(pipe, STATE_ATTR, None)
    if state is None:
        done = " (restored already)" if RESTORED_ATTR in vars(pipe) else ""
        warnings.warn(
            f"bcg-diffusion: restore(): this pipeline is not accelerated{done}; nothing to undo",
            BCGWarning,
            stacklevel=2,
        )
        return pipe
    group = state.group
    kept = []
    if group is not None:
        with group.lock:
            state.patches.undo()
            for feature in state.features:  # after its patches, as Feature.close promises
                feature.close()
            unserialise_calls(pipe)
            kept = group.release(state)
    reason = "restored: bcg_diffusion.restore(pipe) undid accelerate; accelerate it again to use graphs"
    names = ", ".join(f"{record.component} (held by {', '.join(pipeline_names(record.holders))})" for record in kept)
    if kept:
        reason += f"; its shared modules {names} stay accelerated, for its calls too"
    mark_restored(pipe, state, reason)
    if kept:
        warnings.warn(
            f"bcg-diffusion: restore(): {type(pipe).__name__} shares modules that another accelerated pipeline "
            f"still holds, which stay accelerated, for its calls too: {names}; restore those pipelines as well "
            "to make them eager",
            BCGWarning,
            stacklevel=2,
        )
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return pipe


def invalidate(pipe: Any) -> None:
    """Drop every graph of the pipeline's accelerated components; each signature captures again at its
    next call.

    For changes no check can see: a module-level global or a closure that a forward reads, a class
    attribute, an attribute of a non-module object (an attention processor), a value changed between
    the steps of one call. Plain attributes of the components' modules, their parameters, buffers and
    submodules are checked at every pipeline call and need no call (see ``docs/limits.md``). Modules
    this pipeline shares with others lose their graphs for those pipelines too.

    >>> mymodel.SCALE = 2.0            # a global the transformer's forward reads   # doctest: +SKIP
    >>> invalidate(pipe)               # doctest: +SKIP

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    state = accelerated_state(pipe, "invalidate")
    for runner in state.runners.values():
        runner.invalidate("invalidate(pipe)")


@contextlib.contextmanager
def eager(pipe: Any) -> Iterator[Any]:
    """Inside the block, the accelerated pipeline runs its original methods; its graphs are kept.

    For side-by-side comparisons in one process (the benchmark, the demo). Holds the pipeline's lock
    (its group's: pipelines sharing components share it), so accelerated calls from other threads
    wait until the block ends. Modules it shares with other pipelines run eagerly for them too.

    >>> with eager(pipe):                                   # doctest: +SKIP
    ...     reference = pipe(prompt, output_type="pt").images

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    state = accelerated_state(pipe, "eager")
    if state.group is None:  # left eager by accelerate: nothing to bypass
        yield pipe
        return
    with state.group.lock:
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
    settings changed), ``hotswaps`` (LoRA weights hot-swapped in place, graphs kept), ``state_checks``,
    ``state_changes`` and ``state_check_seconds`` (checks of the Python values the graphs read, once per
    pipeline call per component; values found changed, whose graphs were dropped; the time the checks took:
    see :mod:`bcg_diffusion.core.python_state`), ``cache_hooks``, ``cache_states``,
    ``cache_branches`` and ``cache_branch_switches`` (step caching: see :mod:`bcg_diffusion.features.step_caching`),
    ``capture_seconds``, ``graph_memory_bytes`` (the shared pool's size now),
    ``compiled_blocks``, ``compiles``, ``compile_seconds`` and ``compile_failure`` (fast mode: blocks
    compiled, dynamo compiles inside them, first compiles and recompiles, the wall time of the block
    calls that compiled, and why the blocks went back to eager forwards, if they did; 0 / None in
    exact mode), ``cfg_batched`` and ``cfg_batch_dropped`` (fast
    mode: uncond calls served from a batch with their cond call, and speculated halves left unused;
    see :mod:`bcg_diffusion.features.cfg_batching`), ``text_encoder_trimmed`` (fast mode: text encodings run
    without the prompts' padding, see :mod:`bcg_diffusion.features.text_trimming`), ``signatures`` (one dict per captured signature:
    component, signature, status, state (what keys it besides the arguments: attention backend,
    parallel layout...), reason, segments, breaks, memory_bytes, capture_seconds, replays, paths),
    ``components`` (counters per component), ``patches`` and ``shared_with`` (the classes of the other
    accelerated pipelines that share this one's graphs; the counters of a shared module count their
    calls too). Optional features add their own keys (``bcg_diffusion.features``).

    After :func:`restore` it reports the pipeline as it is: ``active`` False, a ``reason`` saying it was
    restored, its former ``mode``, ``debug`` and ``adapter``, and zero counters.

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    state = accelerated_state(pipe, "stats", restored=True)
    group = state.group
    with group.lock if group is not None else contextlib.nullcontext():
        runners = state.runners
        components = {name: dataclasses.asdict(runner.counters) for name, runner in runners.items()}
        signatures = [dataclasses.asdict(r) for runner in runners.values() for r in runner.records()]
        pool_bytes = group.pool.reserved_bytes() if group is not None and group.pool is not None else 0
        installed = state.all_features()
        reported = features.defaults()
        experts: dict[str, dict[str, Any]] = {}
        for feature in installed:
            if feature.expert is None:
                reported.update(feature.stats())
            else:  # what a further expert's instance did (Wan 2.2's transformer_2), apart from the first's
                experts.setdefault(feature.expert, {}).update(feature.stats())
        reported["experts"] = experts
        patches = [patch.name for patch in group.function_patches] if group is not None else []
        patches += list(dict.fromkeys(name for feature in installed for name in feature.patch_names()))
        shared_with = pipeline_names(group.members, but=state) if group is not None else []
    totals = ("captures", "replays", "eager_fallbacks", "misses", "evictions", "invalidations", "hotswaps")
    totals += ("state_checks", "state_changes", "capture_seconds", "state_check_seconds", "mismatches")
    return {
        "active": state.active,
        "reason": state.reason,
        "mode": state.config.mode,
        "debug": state.config.debug,
        "adapter": state.adapter.name,
        **{key: sum(c[key] for c in components.values()) + state.retired.get(key, 0) for key in totals},
        "graph_memory_bytes": pool_bytes,
        **reported,
        "signatures": signatures,
        "components": components,
        "patches": patches,
        "shared_with": shared_with,
        "replaced_components": list(state.replaced_components),
    }
