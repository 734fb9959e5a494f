"""Context parallelism (diffusers' ``enable_parallelism``): its collectives become eager breaks.

The machinery is :mod:`bcg_diffusion.parallel` and :mod:`bcg_diffusion.patches.collectives`. On an
accelerated transformer this feature always guards against ``enable_parallelism`` called after
``accelerate`` (its collectives would not be breaks). Under a parallel layout it also patches the
collectives into breaks, makes every rank keep or abandon each capture together (one vote per break),
keys the signatures by the layout and checks that sequence lengths divide among the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .. import parallel
from ..hooks import MethodPatches
from ..patches import FunctionPatch
from ..patches.collectives import COLLECTIVES_PATCH, MASK_GATHER_PATCH
from .base import Feature, Setup, Target

__all__ = ["ContextParallel"]

# diffusers' ulysses_anything / ring_anything gather sizes on the host: not capturable.
_ANYTHING = "diffusers' ulysses_anything / ring_anything gather sizes on the host (not supported)"


class ContextParallel(Feature):
    name = "context parallelism"
    component = "transformer"

    def __init__(self, layout: parallel.ParallelLayout | None) -> None:
        self.layout = layout
        self.patches: list[FunctionPatch] = []

    @classmethod
    def create(cls, setup: Setup) -> ContextParallel | None:
        return cls(setup.layout) if "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        if self.layout is None:
            return
        if setup.group.consensus is None:
            setup.group.consensus = parallel.CaptureConsensus(self.layout.group)
        for patch in (COLLECTIVES_PATCH, MASK_GATHER_PATCH):
            if patch.apply():
                self.patches.append(patch)

    def runner_fn(
        self, target: Target, fn: Callable[..., Any], state_key: Callable[[], Hashable] | None
    ) -> tuple[Callable[..., Any], Callable[[], Hashable] | None]:
        if target.component != "transformer":
            return fn, state_key
        return parallel.guarded(fn, state_key, target.module, self.layout)

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component == "transformer" and self.layout is not None and self.layout.anything:
            target.runner.suspended = _ANYTHING
        return call

    def patch_names(self) -> list[str]:
        return [patch.name for patch in self.patches]

    def close(self) -> None:
        for patch in self.patches:
            patch.revert()
        self.patches.clear()
