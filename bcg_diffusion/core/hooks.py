"""Instance-level patches that keep graphs honest: what drops them, what suspends them, and the lock
that serialises calls of one pipeline. Every patch is recorded and undone by :meth:`MethodPatches.undo`.

Instance attributes are used because everything that matters looks methods up on the instance:
``nn.Module.__call__`` finds ``self.forward``, pipelines call ``self.vae.decode`` and
``model.fuse_lora()``. Python looks ``__call__`` up on the type, so the pipeline lock needs a subclass.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .python_state import call_scope, current_scope, is_skipped, plain
from .runner import BCGWarning, GraphRunner

__all__ = [
    "MethodPatches",
    "PipelineCall",
    "baked_state",
    "current_call",
    "diffusers_hooks",
    "private_copy",
    "register_graph_safe_hooks",
    "serialise_calls",
    "unserialise_calls",
    "watch_component",
]

logger = logging.getLogger(__name__)

_MISSING = object()

# Methods of an accelerated component after which its graphs are stale: they replace weights (device,
# dtype, LoRA injection and removal), change Python values the kernels were captured with (adapter
# scales, attention backends), or install hooks. ``_apply`` is what .to(), .half(), .cuda() all call.
INVALIDATING_METHODS = (
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
# (None: no such method): layerwise casting and group offloading replace the weights around every
# forward. While such hooks are on, the component runs eagerly. (Cache hooks are followed: see
# bcg_diffusion.features.step_caching; enable_cache and disable_cache need no patch, the signature keys see them.)
SUSPENDING_METHODS: dict[str, str | None] = {
    "enable_layerwise_casting": None,
    "enable_group_offload": None,
}


@dataclass
class _Patch:
    owner: Any
    name: str
    previous: Any  # the instance attribute we shadowed, or _MISSING
    wrapper: Any


@dataclass
class MethodPatches:
    """Instance attributes we set, in order, so they can be undone in reverse."""

    _patches: list[_Patch] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._patches)

    def replace(self, owner: Any, name: str, wrapper: Any) -> None:
        previous = owner.__dict__.get(name, _MISSING)
        object.__setattr__(owner, name, wrapper)
        self._patches.append(_Patch(owner, name, previous, wrapper))

    def undo(self) -> None:
        """Put back what each patch shadowed. A method wrapped again by someone else since is left as it
        is, with a warning (its inner runner has been closed by then, so it is a plain call)."""
        for patch in reversed(self._patches):
            if patch.owner.__dict__.get(patch.name, _MISSING) is not patch.wrapper:
                warnings.warn(
                    f"bcg-diffusion: restore(): {type(patch.owner).__name__}.{patch.name} was wrapped again after "
                    "accelerate(); leaving that wrapper in place",
                    BCGWarning,
                    stacklevel=3,
                )
            elif patch.previous is _MISSING:
                del patch.owner.__dict__[patch.name]
            else:
                object.__setattr__(patch.owner, patch.name, patch.previous)
        self._patches.clear()


# Names (prefixes) of the diffusers hooks that graphs can hold, registered by the features that make
# them safe: context parallelism (its collectives run as eager breaks) and step caching (it carries the
# caches' decisions and state through the graphs). Every other diffusers hook keeps a component eager.
_GRAPH_SAFE_HOOKS: set[str] = set()


def register_graph_safe_hooks(*prefixes: str) -> None:
    """Let graphs hold the diffusers hooks whose names start with one of ``prefixes``: the caller (a
    feature) makes what they do safe to capture. Idempotent.

    >>> register_graph_safe_hooks("fbc_leader_block_hook", "fbc_block_hook")  # doctest: +SKIP
    """
    _GRAPH_SAFE_HOOKS.update(prefixes)


def diffusers_hooks(module: torch.nn.Module) -> list[str]:
    """Names of the diffusers hooks on ``module``'s tree that graphs cannot hold (FasterCache, layerwise
    casting, group offload...): every hook but those registered by :func:`register_graph_safe_hooks`."""
    names: set[str] = set()
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        if registry is not None:
            names.update(getattr(registry, "hooks", {}))
    safe = tuple(_GRAPH_SAFE_HOOKS)
    return sorted(name for name in names if not name.startswith(safe))


def _invalidating(method: Callable[..., Any], runner: GraphRunner, reason: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:  # even a half-done change (an exception midway) may have touched the weights
            runner.invalidate(reason)

    return wrapper


# Where a hot swap copies new LoRA weights into the tensors the graphs read (diffusers'
# ``load_lora_adapter(..., hotswap=True)`` after ``enable_lora_hotswap(target_rank=...)``), the graphs
# stay valid: they read weights where they live. Whether it did is checked, not assumed.
HOTSWAP_METHODS = ("load_lora_adapter",)


def baked_state(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """What a graph of ``module`` may have baked in: every parameter's and buffer's storage address and
    layout, and every plain attribute of every submodule (LoRA scalings, ranks, active adapters...).
    Two snapshots are equal when a change left every graph valid (values written in place)."""
    state: dict[tuple[str, str], Any] = {}
    for name, submodule in module.named_modules():
        for key, tensor in (*submodule._parameters.items(), *submodule._buffers.items()):
            state[(name, key)] = plain(tensor)
        for key, value in submodule.__dict__.items():
            if key in ("_parameters", "_buffers", "_modules") or key.startswith("_bcg"):
                continue
            token = plain(value)
            if not is_skipped(token):
                state[(name, key)] = token
    return state


def _hotswap_aware(method: Callable[..., Any], runner: GraphRunner, reason: str) -> Callable[..., Any]:
    """Like :func:`_invalidating`, except that a ``hotswap=True`` call that changed nothing a graph
    bakes in (see :func:`baked_state`) keeps the graphs: counted in ``runner.counters.hotswaps``."""
    module = getattr(method, "__self__", None)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("hotswap") or module is None:
            try:
                return method(*args, **kwargs)
            finally:
                runner.invalidate(reason)
        before = baked_state(module)
        changed = True
        try:
            result = method(*args, **kwargs)
            after = baked_state(module)
            changed = before != after
            if changed:
                differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
                logger.info(
                    "%s: the hot swap changed %s (first of %d); graphs dropped", reason, differ[0], len(differ)
                )
            return result
        finally:
            if changed:
                runner.invalidate(f"{reason} (hotswap)")
            else:
                runner.hotswapped()

    return wrapper


def _suspending(method: Callable[..., Any], runner: GraphRunner, reason: str | None) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        runner.invalidate(reason or f"{method.__name__}()")
        runner.suspended = reason
        return result

    return wrapper


def watch_component(patches: MethodPatches, component: str, module: torch.nn.Module, runner: GraphRunner) -> None:
    """Make every method in :data:`INVALIDATING_METHODS` drop ``runner``'s graphs (a hot swap of LoRA
    weights in place excepted, see :data:`HOTSWAP_METHODS`), and every method in
    :data:`SUSPENDING_METHODS` make it run eagerly until the matching removal (or ``restore``)."""
    for name in INVALIDATING_METHODS:
        if callable(getattr(module, name, None)):
            wrap = _hotswap_aware if name in HOTSWAP_METHODS else _invalidating
            patches.replace(module, name, wrap(getattr(module, name), runner, f"{component}.{name}()"))
    for enable, disable in SUSPENDING_METHODS.items():
        if not callable(getattr(module, enable, None)):
            continue
        undo = f"; {component}.{disable}() brings the graphs back" if disable else "; restore(pipe) to stop"
        reason = f"{component}.{enable}() installed hooks a graph cannot follow{undo}"
        patches.replace(module, enable, _suspending(getattr(module, enable), runner, reason))
        if disable and callable(getattr(module, disable, None)):
            patches.replace(module, disable, _suspending(getattr(module, disable), runner, None))


@dataclass(frozen=True)
class PipelineCall:
    """One call of an accelerated pipeline in progress: the pipeline and the arguments it was given."""

    pipe: Any
    args: tuple
    kwargs: dict[str, Any]


def current_call() -> PipelineCall | None:
    """The accelerated pipeline call running in this thread (the innermost one), or None outside one.

    Components shared by several pipelines use it to tell which pipeline calls them (its own
    scheduler, its own arguments)."""
    scope = current_scope()
    return scope[1] if scope is not None and isinstance(scope[1], PipelineCall) else None


def serialise_calls(pipe: Any, lock: threading.RLock, before_call: Callable[[], None] | None = None) -> None:
    """Make concurrent calls of this pipeline object run one at a time.

    A diffusers pipeline keeps per-call state on itself (the scheduler's step index, guidance scale,
    the current timestep), so two threads calling one pipeline corrupt each other even eagerly, and
    with graphs they would also share static buffers. The instance gets a subclass of its own class,
    with the same name (``save_pretrained`` records it), whose ``__call__`` holds ``lock`` and runs in
    a :func:`~bcg_diffusion.core.python_state.call_scope` (runners check the Python state their graphs
    read once per scope; :func:`current_call` returns the call). ``before_call``, if given, runs first in
    each call, under the lock (:func:`bcg_diffusion.components.follow_components`).
    """
    original = type(pipe)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock, call_scope(PipelineCall(self, args, kwargs)):
            if before_call is not None:
                before_call()
            return original.__call__(self, *args, **kwargs)

    functools.update_wrapper(__call__, original.__call__)
    namespace = {"__call__": __call__, "__module__": original.__module__, "__qualname__": original.__qualname__}
    serialised = type(original.__name__, (original,), namespace)
    serialised._bcg_original_class = original  # type: ignore[attr-defined]
    object.__setattr__(pipe, "__class__", serialised)


def unserialise_calls(pipe: Any) -> None:
    """Undo :func:`serialise_calls` (warns if the class was changed again since)."""
    original = type(pipe).__dict__.get("_bcg_original_class")
    if original is not None:
        object.__setattr__(pipe, "__class__", original)
    else:
        warnings.warn(
            "bcg-diffusion: restore(): the pipeline's class was changed after accelerate(); leaving it as it is",
            BCGWarning,
            stacklevel=3,
        )


def private_copy(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own. Dynamo caches compiled code per code object, so
    the blocks of one pipeline share their compiles, while another pipeline or a peer's
    ``compile_repeated_blocks`` neither reuses nor evicts them (and the benchmark's first calls stay
    fair)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(copy, function)
