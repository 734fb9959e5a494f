"""Public entry points: :func:`accelerate`, :func:`restore`, :func:`stats`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .config import AccelerateConfig
from .graphs import GraphPool
from .patches import FunctionPatch
from .pipelines import PipelineAdapter, adapter_for
from .runner import BCGWarning, GraphRunner

__all__ = ["accelerate", "eager", "restore", "stats"]

logger = logging.getLogger(__name__)

P = TypeVar("P")

_STATE_ATTR = "_bcg_state"
_MISSING = object()

# Methods of an accelerated component after which its graphs are stale: they replace weights (device,
# dtype, LoRA injection and removal), change Python values the kernels were captured with (adapter
# scales, attention backends), or install hooks. ``_apply`` is what .to(), .half(), .cuda() all call.
_INVALIDATING_METHODS = (
    "_apply",
    "load_state_dict",
    "load_lora_adapter",
    "add_adapter",
    "set_adapter",
    "set_adapters",
    "delete_adapters",
    "fuse_lora",
    "unfuse_lora",
    "unload_lora",
    "enable_lora",
    "disable_lora",
    "enable_adapters",
    "disable_adapters",
    "set_attention_backend",
    "reset_attention_backend",
    "set_attn_processor",
    "set_default_attn_processor",
)
# Methods that install diffusers hooks a graph cannot follow, mapped to the method that removes them
# (None: no such method). Caching hooks (FirstBlockCache...) decide on the host, every step, whether to
# skip blocks, so a graph would freeze one decision; layerwise casting and group offloading replace the
# weights around every forward. While such hooks are on, the component runs eagerly.
_SUSPENDING_METHODS = {
    "enable_cache": "disable_cache",
    "enable_layerwise_casting": None,
    "enable_group_offload": None,
}


def _diffusers_hooks(module: torch.nn.Module) -> list[str]:
    """Names of the diffusers hooks (cache, layerwise casting, group offload...) on ``module``'s tree."""
    names: set[str] = set()
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        if registry is not None:
            names.update(getattr(registry, "hooks", {}))
    return sorted(names)


@dataclass
class _Installed:
    """One replaced method: where it lives, what was there before, and the wrapper we put there."""

    module: torch.nn.Module
    method: str
    previous: Any  # the instance attribute we shadowed, or _MISSING
    wrapper: Any


@dataclass
class _PipelineState:
    config: AccelerateConfig
    adapter: PipelineAdapter
    active: bool
    reason: str | None = None
    pool: GraphPool | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    runners: dict[str, GraphRunner] = field(default_factory=dict)
    installed: list[_Installed] = field(default_factory=list)
    patches: list[FunctionPatch] = field(default_factory=list)


def _check_pipeline(pipe: Any, caller: str) -> None:
    if pipe is None:
        raise TypeError(f"{caller}() needs a diffusers pipeline, got None")
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(
            f"{caller}() needs a diffusers DiffusionPipeline, got {type(pipe).__module__}.{type(pipe).__name__}"
        )


def _execution_device(pipe: Any) -> torch.device:
    transformer = getattr(pipe, "transformer", None)
    if isinstance(transformer, torch.nn.Module):
        for parameter in transformer.parameters():
            return parameter.device
    return torch.device(getattr(pipe, "device", "cpu"))


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
        hooks = _diffusers_hooks(module) if isinstance(module, torch.nn.Module) else []
        if hooks:
            return (
                f"{name} has diffusers hooks {hooks} (caching, layerwise casting or group offloading decide on the "
                "host or move weights every forward); remove them, or accept eager speed"
            )
    return None


def accelerate(pipe: P, config: AccelerateConfig | None = None, **options: Any) -> P:
    """Run the pipeline's transformer and VAE decode as replayed breakable CUDA graphs.

    Returns the same pipeline object, patched in place: every call then captures one graph per input
    signature (resolution, batch, text length, CFG mode) on first use and replays it afterwards, with
    images byte-identical to eager in the default ``mode="exact"``.

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
    if existing is not None:
        if existing.config == config:
            logger.info("accelerate(): pipeline already accelerated with these options; nothing to do")
            return pipe
        raise ValueError(
            "this pipeline is already accelerated with different options "
            f"({existing.config} vs {config}); call bcg_diffusion.restore(pipe) first"
        )
    adapter = adapter_for(pipe)
    device = _execution_device(pipe)
    reason = _eager_reason(pipe, config, device)
    state = _PipelineState(config=config, adapter=adapter, active=reason is None, reason=reason)
    if reason is not None:
        warnings.warn(f"bcg-diffusion: leaving {type(pipe).__name__} eager: {reason}", BCGWarning, stacklevel=2)
        object.__setattr__(pipe, _STATE_ATTR, state)
        return pipe

    if not config.debug:
        state.pool = GraphPool(device)
    for patch in adapter.patches:
        if patch.apply():
            state.patches.append(patch)
    for component in config.components:
        method = adapter.targets.get(component)
        module = getattr(pipe, component, None)
        if method is None or module is None:
            continue
        _install(state, component, module, method)
    if not state.runners:
        warnings.warn(
            f"bcg-diffusion: {type(pipe).__name__} has none of {config.components}", BCGWarning, stacklevel=2
        )
    _serialise_calls(pipe, state.lock)
    object.__setattr__(pipe, _STATE_ATTR, state)
    return pipe


def _serialise_calls(pipe: Any, lock: threading.RLock) -> None:
    """Make concurrent calls of this pipeline object run one at a time.

    A diffusers pipeline keeps per-call state on itself (the scheduler's step index, guidance scale,
    the current timestep), so two threads calling one pipeline corrupt each other even eagerly, and
    with graphs they would also share static buffers. ``__call__`` is looked up on the type, so the
    instance gets a subclass of its own class, with the same name (``save_pretrained`` records it),
    whose ``__call__`` holds the pipeline's lock. ``restore`` puts the original class back.
    """
    original = type(pipe)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            return original.__call__(self, *args, **kwargs)

    functools.update_wrapper(__call__, original.__call__)
    namespace = {"__call__": __call__, "__module__": original.__module__, "__qualname__": original.__qualname__}
    serialised = type(original.__name__, (original,), namespace)
    serialised._bcg_original_class = original  # type: ignore[attr-defined]
    object.__setattr__(pipe, "__class__", serialised)


def _unserialise_calls(pipe: Any) -> None:
    original = type(pipe).__dict__.get("_bcg_original_class")
    if original is not None:
        object.__setattr__(pipe, "__class__", original)
    else:
        warnings.warn(
            "bcg-diffusion: restore(): the pipeline's class was changed after accelerate(); leaving it as it is",
            BCGWarning,
            stacklevel=3,
        )


def _install(state: _PipelineState, component: str, module: torch.nn.Module, method: str) -> None:
    original = getattr(module, method)
    runner = GraphRunner(
        original,
        name=component,
        pool=state.pool,
        lock=state.lock,
        debug=state.config.debug,
        warmup_runs=state.config.warmup_runs,
        capture_error_mode=state.config.capture_error_mode,
        track_external_tensors=state.config.track_external_tensors,
        state_key=state.adapter.state_key(component, module),
    )

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return runner(*args, **kwargs)

    functools.update_wrapper(wrapper, original)
    wrapper.__bcg_runner__ = runner  # type: ignore[attr-defined]
    _set_instance_method(state, module, method, wrapper)
    state.runners[component] = runner
    for name in _INVALIDATING_METHODS:
        if callable(getattr(module, name, None)):
            _set_instance_method(
                state, module, name, _invalidating(getattr(module, name), runner, f"{component}.{name}()")
            )
    for enable, disable in _SUSPENDING_METHODS.items():
        if not callable(getattr(module, enable, None)):
            continue
        undo = f"; {component}.{disable}() brings the graphs back" if disable else "; restore(pipe) to stop"
        reason = f"{component}.{enable}() installed hooks a graph cannot follow{undo}"
        _set_instance_method(state, module, enable, _suspending(getattr(module, enable), runner, reason))
        if disable and callable(getattr(module, disable, None)):
            _set_instance_method(state, module, disable, _suspending(getattr(module, disable), runner, None))


def _set_instance_method(state: _PipelineState, module: torch.nn.Module, name: str, wrapper: Any) -> None:
    # Instance attribute: nn.Module.__call__ looks up self.forward, pipelines call self.vae.decode and
    # model.fuse_lora(), so an instance attribute is seen by all of them and removed cleanly.
    previous = module.__dict__.get(name, _MISSING)
    object.__setattr__(module, name, wrapper)
    state.installed.append(_Installed(module, name, previous, wrapper))


def _invalidating(method: Any, runner: GraphRunner, reason: str) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:  # even a half-done change (an exception midway) may have touched the weights
            runner.invalidate(reason)

    return wrapper


def _suspending(method: Any, runner: GraphRunner, reason: str | None) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        runner.invalidate(reason or "cache disabled")
        runner.suspended = reason
        return result

    return wrapper


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
        for installed in reversed(state.installed):
            current = installed.module.__dict__.get(installed.method, _MISSING)
            if current is installed.wrapper:
                if installed.previous is _MISSING:
                    del installed.module.__dict__[installed.method]
                else:
                    object.__setattr__(installed.module, installed.method, installed.previous)
            else:
                warnings.warn(
                    f"bcg-diffusion: restore(): {type(installed.module).__name__}.{installed.method} was wrapped again "
                    "after accelerate(); leaving that wrapper and turning ours into a plain call",
                    BCGWarning,
                    stacklevel=2,
                )
        for runner in state.runners.values():
            runner.close()
        if state.active:
            _unserialise_calls(pipe)
        for patch in state.patches:
            patch.revert()
        state.runners.clear()
        state.installed.clear()
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
    _check_pipeline(pipe, "eager")
    state: _PipelineState | None = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        raise ValueError("eager(): this pipeline was not accelerated; it already runs eagerly")
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
    ``captures``, ``replays``, ``eager_fallbacks``, ``invalidations`` (times the graphs were dropped
    because weights or settings changed), ``capture_seconds``, ``graph_memory_bytes`` (the
    shared pool's size now), ``signatures`` (one dict per captured signature: component, signature,
    status, reason, segments, breaks, memory_bytes, capture_seconds, replays), ``components``
    (counters per component) and ``patches``.

    Raises:
        ValueError: the pipeline was never accelerated.
    """
    _check_pipeline(pipe, "stats")
    state: _PipelineState | None = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        raise ValueError("stats(): this pipeline was not accelerated (call bcg_diffusion.accelerate(pipe) first)")
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
        "invalidations": sum(c["invalidations"] for c in components.values()),
        "capture_seconds": sum(c["capture_seconds"] for c in components.values()),
        "graph_memory_bytes": pool_bytes,
        "signatures": signatures,
        "components": components,
        "patches": [patch.name for patch in state.patches],
    }
