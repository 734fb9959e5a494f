"""Enabling a step cache on a pipeline's transformer, Z-Image's included, and counting what it skipped.

Z-Image's transformer has no ``enable_cache`` in diffusers 0.42.1: :func:`enable_cache` gives it
diffusers' own (``CacheMixin``), so the same hooks and block registry apply to it.
"""

from __future__ import annotations

import reprlib
from typing import Any

import torch

from .cfg_join import reading_context
from .state import DEFAULT_CONTEXT, hook_registries

__all__ = [
    "GRAPH_CACHE_CONFIGS",
    "SkipCounter",
    "check_cache_config",
    "disable_cache",
    "enable_cache",
    "needs_default_context",
]

_MIXED_ATTR = "_bcg_cache_mixin"  # on a class we derived with diffusers' CacheMixin: the original class
GRAPH_CACHE_CONFIGS = ("FirstBlockCacheConfig", "TaylorSeerCacheConfig", "MagCacheConfig")
"""diffusers' cache configs whose hooks run inside the graphs (``docs/caching.md``)."""
EAGER_CACHE_CONFIGS = ("FasterCacheConfig", "PyramidAttentionBroadcastConfig", "SeaCacheConfig", "TextKVCacheConfig")
"""diffusers' other cache configs: enabled as diffusers enables them, the transformer then runs eagerly."""


def enable_cache(pipe_or_module: Any, config: Any) -> None:
    """Enable one of diffusers' caches (``FirstBlockCacheConfig(...)``...) on a pipeline's transformer.

    The same as ``pipe.transformer.enable_cache(config)`` where the transformer has it (Qwen-Image).
    Z-Image's transformer has no ``enable_cache`` in diffusers 0.42.1: its instance gets a subclass of
    its own class (same name) with diffusers' ``CacheMixin``, so ``enable_cache``, ``disable_cache``,
    ``cache_context`` and diffusers' hooks and block registry apply to it unchanged, and its calls run
    in the cache context :data:`DEFAULT_CONTEXT` when the pipeline sets none (Z-Image's sets none).
    Works before or after :func:`~bcg_diffusion.accelerate`, eager or accelerated.

    Raises:
        TypeError: ``pipe_or_module`` is neither a pipeline with a transformer nor a module, or ``config`` is
            not one of diffusers' cache configs (the message names those that run inside the graphs:
            :data:`GRAPH_CACHE_CONFIGS`); nothing is changed then.
        ValueError: from diffusers, for a cache already enabled.

    >>> enable_cache(pipe, FirstBlockCacheConfig(threshold=0.2))      # doctest: +SKIP
    """
    module = getattr(pipe_or_module, "transformer", pipe_or_module)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"enable_cache needs a pipeline with a transformer or a module, got {type(module).__name__}")
    check_cache_config(config)
    if not callable(getattr(module, "enable_cache", None)):
        _add_cache_mixin(module)
    if vars(type(module)).get(_MIXED_ATTR) is not None:
        config = _zimage_defaults(module, config)
    module.enable_cache(config)


def check_cache_config(config: Any) -> None:
    """Raise TypeError unless ``config`` is one of diffusers' cache configs, naming those that run inside the
    graphs and those that run eagerly (a config this diffusers lacks is left out of both)."""
    import diffusers.hooks

    def present(names: tuple[str, ...]) -> list[type]:
        return [cls for name in names if isinstance(cls := getattr(diffusers.hooks, name, None), type)]

    eager = present(EAGER_CACHE_CONFIGS)
    if isinstance(config, tuple(present(GRAPH_CACHE_CONFIGS) + eager)):
        return
    raise TypeError(
        f"enable_cache(): {type(config).__name__} {reprlib.repr(config)} is not a diffusers cache config; pass a "
        f"{', '.join(GRAPH_CACHE_CONFIGS[:-1])} or {GRAPH_CACHE_CONFIGS[-1]} (`from diffusers import "
        f"FirstBlockCacheConfig`), whose hooks run inside the graphs ({', '.join(c.__name__ for c in eager)} are "
        "accepted too, but their transformer runs eagerly)"
    )


def disable_cache(pipe_or_module: Any) -> None:
    """Undo :func:`enable_cache`: ``transformer.disable_cache()``, and on Z-Image what it added."""
    module = getattr(pipe_or_module, "transformer", pipe_or_module)
    module.disable_cache()
    original = type(module).__dict__.get(_MIXED_ATTR)
    if original is not None:
        object.__setattr__(module, "__class__", original)
        vars(module).pop("_cache_config", None)


def _add_cache_mixin(module: torch.nn.Module) -> None:
    from diffusers.models.cache_utils import CacheMixin

    if type(module).__name__ == "ZImageTransformer2DModel":
        _register_zimage_block()
    original = type(module)
    namespace = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__call__": _call_in_default_context,
        _MIXED_ATTR: original,
    }
    object.__setattr__(module, "__class__", type(original.__name__, (original, CacheMixin), namespace))
    object.__setattr__(module, "_cache_config", None)


def _register_zimage_block() -> None:
    """diffusers' block registry names Z-Image's block input ``hidden_states`` (its default); the forward
    calls it ``x``, and FirstBlockCache asks for ``hidden_states`` by that name. Registered again with
    both names (process-wide: before, any FirstBlockCache on Z-Image failed in diffusers itself)."""
    import inspect

    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    parameters = list(inspect.signature(ZImageTransformerBlock.forward).parameters)[1:]
    indices = {name: index for index, name in enumerate(parameters)}
    indices["hidden_states"] = indices["x"]
    metadata = TransformerBlockMetadata(
        return_hidden_states_index=0, return_encoder_hidden_states_index=None, hidden_states_argument_name="x"
    )
    metadata._cached_parameter_indices = indices
    TransformerBlockRegistry.register(ZImageTransformerBlock, metadata)


# TaylorSeer's default patterns name Qwen-Image's and FLUX's attention modules, none of Z-Image's.
ZIMAGE_TAYLORSEER_IDENTIFIERS = [r"^layers\.\d+\.attention$"]


def _zimage_defaults(module: torch.nn.Module, config: Any) -> Any:
    import dataclasses

    if type(config).__name__ == "TaylorSeerCacheConfig" and not (
        config.cache_identifiers or config.skip_predict_identifiers or config.use_lite_mode
    ):
        return dataclasses.replace(config, cache_identifiers=list(ZIMAGE_TAYLORSEER_IDENTIFIERS))
    return config


def _call_in_default_context(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if needs_default_context(self):
        with self.cache_context(DEFAULT_CONTEXT):
            return torch.nn.Module.__call__(self, *args, **kwargs)
    return torch.nn.Module.__call__(self, *args, **kwargs)


def needs_default_context(module: torch.nn.Module) -> bool:
    """Whether ``module`` got its cache methods from :func:`enable_cache` (Z-Image) and a cache hook on it
    has no context set: the call must then run in :data:`DEFAULT_CONTEXT`."""
    if _MIXED_ATTR not in type(module).__dict__:
        return False
    for registry in hook_registries(module):
        for hook in registry.hooks.values():
            if getattr(hook, "_is_stateful", False):
                for value in vars(hook).values():
                    if type(value).__name__ == "StateManager":
                        return value._context is None
    return False


class SkipCounter:
    """Counts the transformer calls a cache skipped (the benchmark's and tests' "fraction skipped").

    A forward hook on the transformer reads, after each call, whether the call computed its blocks:
    FirstBlockCache's and MagCache's ``should_compute``, TaylorSeer's "updated at this step". It reads
    the state the hooks (eager) or the graphs' records (accelerated) left, so it counts both alike.
    ``remove()`` takes the hook off.

    >>> counter = SkipCounter(pipe.transformer); pipe(prompt); counter.fraction   # doctest: +SKIP
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.calls = 0
        self.skipped = 0
        self._handle = module.register_forward_hook(self._count)

    @property
    def fraction(self) -> float:
        return self.skipped / self.calls if self.calls else 0.0

    def remove(self) -> None:
        self._handle.remove()

    def _count(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        computed = None
        for registry in hook_registries(self.module):
            for hook in registry.hooks.values():
                manager = getattr(hook, "state_manager", None)
                if manager is None or not manager._state_cache:
                    continue
                context = reading_context(manager)  # a batch of cond and uncond: their joint state (.cfg_join)
                state = manager._state_cache.get(context)
                if state is None:
                    continue
                if hasattr(state, "should_compute"):
                    computed = bool(state.should_compute)
                elif hasattr(state, "last_update_step"):
                    computed = computed or state.last_update_step == state.current_step
        if computed is not None:
            self.calls += 1
            self.skipped += not computed
