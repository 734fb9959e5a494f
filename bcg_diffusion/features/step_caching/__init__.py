"""Step caching: diffusers' cache hooks on the transformer keep their graphs.

How their decisions and state are carried through the graphs is :mod:`.state`, and per cache (what
each decides, writes and keeps; graphs keyed by decision, not by step) :mod:`.kinds`; enabling a cache
on any pipeline (Z-Image's included) and counting what it skipped is :mod:`.enable`; running a batch of
true CFG's cond and uncond calls (fast mode's CFG batching) in one cache context is :mod:`.cfg_join`.

Always installed on an accelerated transformer: a cache may be enabled before ``accelerate`` or at
any time after, and disabled again; the signature keys follow the hooks that are on. Fast mode
compiles the blocks' own forwards: a cache enabled before ``accelerate`` is taken off while they
compile and put back (with the same config) so that its hooks wrap the compiled blocks from outside,
and the same is done in reverse on ``restore``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ...core.hooks import MethodPatches, register_graph_safe_hooks
from ...core.runner import BCGWarning
from ..base import Feature, Setup, Target
from .cachedit import cache_dit_enabled
from .cachedit import code_refused as cache_dit_code_refused
from .cachedit import unsupported as cache_dit_unsupported
from .cfg_join import JOINT_CONTEXT, CfgJoin
from .enable import SkipCounter, disable_cache, enable_cache
from .state import SUPPORTED_HOOKS, CacheState, cache_hooks, has_cache_hooks

__all__ = [
    "JOINT_CONTEXT",
    "CacheState",
    "CfgJoin",
    "SkipCounter",
    "StepCaching",
    "cache_dit_enabled",
    "cache_dit_code_refused",
    "cache_dit_unsupported",
    "cache_hooks",
    "disable_cache",
    "enable_cache",
    "has_cache_hooks",
]

# The carried caches' hooks can stay on a module whose forward graphs hold.
register_graph_safe_hooks(*SUPPORTED_HOOKS)


class StepCaching(Feature):
    name = "step caching"
    component = "transformer"
    # Wan 2.2's second expert carries its own cache hooks (enable_cache(pipe.transformer_2, config)); without
    # this its graphs froze the cache's first decisions and the images parted from eager's with that cache.
    experts = True
    defaults = {"cache_hooks": [], "cache_states": 0, "cache_branches": 0, "cache_branch_switches": 0}

    def __init__(self, setup: Setup) -> None:
        self.module = setup.modules["transformer"]
        self.state = CacheState(self.module)
        self.fast = setup.config.mode == "fast"
        self.reenable: Any = None  # the cache config taken off while fast mode compiled the blocks
        self.target: Target | None = None

    @classmethod
    def create(cls, setup: Setup) -> StepCaching | None:
        return cls(setup) if "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        if self.fast and cache_hooks(self.module):
            self.reenable = self._take_off("accelerate")

    def _take_off(self, when: str) -> Any:
        config = getattr(self.module, "_cache_config", None)
        if config is None:
            warnings.warn(
                f"bcg-diffusion: at {when}, cache hooks {cache_hooks(self.module)} were applied without "
                "enable_cache(); fast mode compiles the blocks under them as they are. Enable the cache with "
                "transformer.enable_cache(config) (or bcg_diffusion.enable_cache) instead",
                BCGWarning,
                stacklevel=5,
            )
            return None
        self.module.disable_cache()
        return config

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        if self.reenable is not None:
            self.module.enable_cache(self.reenable)
            self.reenable = None

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != "transformer":
            return call
        self.target = target
        runner = target.runner
        runner.outer_state = self.state
        state = self.state
        state.on_removed = lambda managers: runner.drop(
            lambda key: key is not None and state.mentions(key, managers), "cache hooks removed"
        )
        return call  # Z-Image's default cache context is set by the class enable_cache gives it, before this

    def stats(self) -> dict[str, Any]:
        counters = self.target.runner.counters if self.target is not None else None
        return {
            "cache_hooks": cache_hooks(self.module),
            "cache_states": self._states(),
            "cache_branches": counters.branches if counters else 0,
            "cache_branch_switches": counters.branch_switches if counters else 0,
        }

    def _states(self) -> int:
        """Distinct cache states among the transformer's captured signatures (their outer-state keys)."""
        if self.target is None:
            return 0
        return len({key for key in self.target.runner.outer_keys() if key})

    def before_undo(self) -> None:
        if self.fast and cache_hooks(self.module):
            self.reenable = self._take_off("restore")

    def close(self) -> None:
        self.state.close()
        if self.reenable is not None:
            self.module.enable_cache(self.reenable)
            self.reenable = None
