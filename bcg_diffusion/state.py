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

__all__ = ["PipelineState", "accelerated_state", "attach_state", "check_pipeline", "mark_restored"]

STATE_ATTR = "_bcg_state"
RESTORED_ATTR = "_bcg_restored"  # what stats() reports of a pipeline after restore


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
    # Components set on the pipeline after accelerate (see bcg_diffusion.components), in order; and the modules
    # left eager among them (by id, with their component names), so each is refused once, not at every call.
    replaced_components: list[str] = field(default_factory=list)
    left_eager: dict[int, set[str]] = field(default_factory=dict)
    # The counters of the runners of components replaced since: stats() totals keep counting them.
    retired: dict[str, float] = field(default_factory=dict)

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


@dataclass(frozen=True)
class _Restored:
    """What :func:`mark_restored` leaves on a pipeline: the options and adapter it had, and why it is inactive."""

    config: AccelerateConfig
    adapter: PipelineAdapter
    reason: str


def attach_state(pipe: Any, state: PipelineState) -> None:
    """Put ``state`` on ``pipe`` (bypassing diffusers' ``__setattr__``), replacing any mark of a restore."""
    vars(pipe).pop(RESTORED_ATTR, None)
    object.__setattr__(pipe, STATE_ATTR, state)


def mark_restored(pipe: Any, state: PipelineState, reason: str) -> None:
    """Take ``state`` off ``pipe`` and note that it was restored, so :func:`accelerated_state` with
    ``restored=True`` can report it (its options, no graphs, ``reason``) instead of refusing it."""
    object.__delattr__(pipe, STATE_ATTR)
    object.__setattr__(pipe, RESTORED_ATTR, _Restored(state.config, state.adapter, reason))


def accelerated_state(pipe: Any, caller: str, *, restored: bool = False) -> PipelineState:
    """``pipe``'s state; raises TypeError for a non-pipeline, ValueError for one not accelerated now.

    With ``restored=True`` a pipeline that :func:`~bcg_diffusion.restore` undid is not refused: it gets an
    inactive state with its former options and adapter, holding nothing (what ``stats`` reports)."""
    check_pipeline(pipe, caller)
    state: PipelineState | None = getattr(pipe, STATE_ATTR, None)
    if state is not None:
        return state
    mark: _Restored | None = vars(pipe).get(RESTORED_ATTR)
    if mark is None:
        raise ValueError(f"{caller}(): this pipeline was not accelerated (call bcg_diffusion.accelerate(pipe) first)")
    if not restored:
        raise ValueError(
            f"{caller}(): this pipeline is not accelerated: it was restored (call bcg_diffusion.accelerate(pipe) "
            "again first)"
        )
    return PipelineState(weakref.ref(pipe), config=mark.config, adapter=mark.adapter, active=False, reason=mark.reason)
