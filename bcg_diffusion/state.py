"""What :func:`~bcg_diffusion.accelerate` leaves on a pipeline: its options, its group, what it holds."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from .config import AccelerateConfig
from .core.hooks import MethodPatches
from .core.runner import GraphRunner
from .features import Feature
from .group import GraphGroup, HeldModule
from .pipelines import PipelineAdapter

__all__ = ["PipelineState", "accelerated_state", "check_pipeline"]

STATE_ATTR = "_bcg_state"


@dataclass(eq=False)
class PipelineState:
    """One accelerated pipeline: options, adapter, whether graphs are in use (and why not), the group it
    belongs to, the modules it holds (by component; shared ones are held by other members too), its
    own patches (on the pipeline object) and the features that live on the pipeline. It refers to the
    pipeline weakly: a pipeline dropped without ``restore`` releases what it held (see :mod:`.group`)."""

    pipe_ref: weakref.ref
    config: AccelerateConfig
    adapter: PipelineAdapter
    active: bool
    reason: str | None = None
    group: GraphGroup | None = None
    held: dict[str, HeldModule] = field(default_factory=dict)
    patches: MethodPatches = field(default_factory=MethodPatches)
    features: list[Feature] = field(default_factory=list)

    @property
    def pipe(self) -> Any:
        """The pipeline, or None once it was garbage-collected."""
        return self.pipe_ref()

    @property
    def runners(self) -> dict[str, GraphRunner]:
        return {name: record.runner for name, record in self.held.items() if record.runner is not None}

    def all_features(self) -> list[Feature]:
        """The features of every module it holds, then its own."""
        return [feature for record in self.held.values() for feature in record.features] + self.features


def check_pipeline(pipe: Any, caller: str) -> None:
    """Raise TypeError unless ``pipe`` is a diffusers pipeline."""
    if pipe is None:
        raise TypeError(f"{caller}() needs a diffusers pipeline, got None")
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        raise TypeError(
            f"{caller}() needs a diffusers DiffusionPipeline, got {type(pipe).__module__}.{type(pipe).__name__}"
        )


def accelerated_state(pipe: Any, caller: str) -> PipelineState:
    """``pipe``'s state; raises TypeError for a non-pipeline, ValueError for one never accelerated."""
    check_pipeline(pipe, caller)
    state: PipelineState | None = getattr(pipe, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{caller}(): this pipeline was not accelerated (call bcg_diffusion.accelerate(pipe) first)")
    return state
