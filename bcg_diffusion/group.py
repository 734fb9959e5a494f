"""Modules accelerated together, and what their graphs share: one pool, one lock, one set of runners.

Graphs belong to modules, not to pipelines. diffusers users build relatives from one set of weights
(``ZImageImg2ImgPipeline(**pipe.components)``), so one transformer can sit in several pipelines, and
anything hung on it (its wrapped ``forward``, its runner, its compiled blocks) is seen by all of them.
So a module is accelerated once, by the first pipeline that takes it, and joins that pipeline's
:class:`GraphGroup`; a pipeline that holds a module of a group joins the group too, and takes its own
not-yet-held modules into it. Every member shares the group's graph pool, capture stream, lock
(their calls run one at a time: they share static buffers) and signature budget, and must have been
accelerated with the same options. A module is released, its runner closed and every patch on it
undone, when the last accelerated pipeline holding it is restored.

Contract, in short:

* a module accelerated through one pipeline replays its graphs in every pipeline that calls it,
  accelerated or not, each call keyed by its own signature: the result is the same as eager;
* ``restore(pipe)`` undoes what only ``pipe`` holds; a module another accelerated pipeline still
  holds stays accelerated (with a warning), also for ``pipe``'s calls;
* a pipeline whose modules belong to two groups accelerated apart is refused: two pools cannot merge.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import features as feature_registry
from .config import TEXT_ENCODERS, AccelerateConfig, describe_changes
from .core import settings
from .core.budget import SignatureBudget
from .core.graphs import GraphPool
from .core.hooks import MethodPatches, watch_component
from .core.runner import GraphRunner
from .features import EXPERTS, Feature, Setup, Target, expert_target, expert_view
from .features import context_parallel as parallel
from .patches import FunctionPatch
from .patches.text_encoder import CAUSAL_MASK_PATCH

if TYPE_CHECKING:
    from .pipelines import PipelineAdapter

__all__ = ["GraphGroup", "HeldModule", "held_by", "pipeline_names"]

logger = logging.getLogger(__name__)

_HELD_ATTR = "_bcg_held"


@dataclass(eq=False)
class HeldModule:
    """One module a group has taken: the runner that replaces its accelerated method (None when only
    a feature patches it, e.g. fast mode's trimming of an eager text encoder), the features living on
    it, every patch made on it, and the pipeline states that hold it."""

    component: str
    module: torch.nn.Module
    group: GraphGroup
    patches: MethodPatches = field(default_factory=MethodPatches)
    runner: GraphRunner | None = None
    features: list[Feature] = field(default_factory=list)
    holders: list[Any] = field(default_factory=list)


def pipeline_names(states: Any, but: Any = None) -> list[str]:
    """Sorted class names of the live pipelines of ``states`` (pipeline states), ``but`` left out; for
    messages and ``stats()["shared_with"]`` (a state refers to its pipeline weakly)."""
    return sorted({type(s.pipe).__name__ for s in states if s is not but and s.pipe is not None})


def held_by(module: Any) -> HeldModule | None:
    """The record of the group that holds ``module``, or None."""
    return module.__dict__.get(_HELD_ATTR) if isinstance(module, torch.nn.Module) else None


class GraphGroup:
    """The pool, lock, budget and held modules shared by pipelines accelerated together.

    Args:
        config: the options every member was accelerated with.
        adapter: the pipeline family's adapter (every member's).
        device: where the graphs live (ignored in debug mode, which has no pool).
    """

    def __init__(self, config: AccelerateConfig, adapter: PipelineAdapter, device: torch.device) -> None:
        self.config = config
        self.adapter = adapter
        self.pool = GraphPool(device) if not config.debug else None
        settings.settle(device)  # before any call reads the settings into a signature
        self.lock = threading.RLock()
        self.budget = SignatureBudget(config.max_signatures) if config.max_signatures is not None else None
        self.consensus: Any = None  # set by context parallelism: keeps the ranks' captures in step
        self.members: list[Any] = []  # pipeline states
        self.function_patches: list[FunctionPatch] = []
        encoders = any(name in TEXT_ENCODERS for name in config.components)
        needed = adapter.patches + ((CAUSAL_MASK_PATCH,) if encoders else ())
        for patch in needed:
            if patch.apply():
                self.function_patches.append(patch)

    # ------------------------------------------------------------------------------------- membership
    def check_joins(self, pipe: Any, config: AccelerateConfig, adapter: PipelineAdapter) -> None:
        """Raise ValueError unless ``pipe`` may join: same adapter, same options (a warm-up aside). The message
        names the options that differ, the group's value first (``mode: 'exact' → 'fast'``)."""
        others = ", ".join(pipeline_names(self.members)) or "a pipeline since collected"
        if adapter.name != self.adapter.name:
            raise ValueError(
                f"{type(pipe).__name__} shares components with {others}, accelerated with the {self.adapter.name} "
                f"adapter, not {adapter.name}: restore that pipeline first"
            )
        if _options(config) != _options(self.config):
            raise ValueError(
                f"{type(pipe).__name__} shares components with {others}, accelerated with other options "
                f"({describe_changes(_options(self.config), _options(config))}): pipelines that share components "
                "share their graphs and must be accelerated with the same options (or restore the others first)"
            )

    def take(
        self, state: Any, modules: dict[str, torch.nn.Module], pipeline_features: bool = True
    ) -> dict[str, HeldModule]:
        """Accelerate ``modules`` (``state``'s pipeline's modules that no member holds yet) and return the
        records of those that got a runner or a feature; install ``state``'s pipeline features too, unless
        ``pipeline_features`` is False (a component replaced later: the pipeline's are installed already)."""
        pipe, config, adapter = state.pipe, self.config, self.adapter
        transformer = modules.get("transformer", getattr(pipe, "transformer", None))
        setup = Setup(
            pipe=pipe,
            config=config,
            adapter=adapter,
            group=self,
            modules=modules,
            accelerated=tuple(c for c in config.components if c in modules and c in adapter.targets),
            layout=parallel.layout_of(transformer),
        )
        records = {name: HeldModule(name, module, self) for name, module in modules.items()}
        features: list[Feature] = []
        try:
            self._install(setup, state, records, features, pipeline_features)
        except BaseException:
            # Leave the modules as they were; the error itself is what the caller must see.
            _undo(records.values(), features, state)
            raise
        taken = {name: r for name, r in records.items() if r.runner is not None or r.features or r.patches}
        for record in taken.values():
            object.__setattr__(record.module, _HELD_ATTR, record)
        return taken

    def _install(
        self,
        setup: Setup,
        state: Any,
        records: dict[str, HeldModule],
        features: list[Feature],
        pipeline_features: bool = True,
    ) -> None:
        """The install order every feature relies on (see :mod:`bcg_diffusion.features.base`)."""
        for name, record in records.items():
            self.adapter.install_module(name, record.module, record.patches)
        experts = [name for name in EXPERTS if name in records]
        for feature_class in feature_registry.FEATURES:  # looked up now: the list is the extension point
            if feature_class.component is None and not pipeline_features:
                continue
            if feature_class.component is None or feature_class.component in records:
                # else its module is absent, or held already (installed by the pipeline that took it)
                feature = feature_class.create(setup)
                if feature is not None:
                    features.append(feature)
            if feature_class.component == "transformer" and feature_class.experts:
                for expert in experts:  # Wan 2.2's second expert gets what the first gets
                    feature = feature_class.create(expert_view(setup, expert))
                    if feature is not None:
                        feature.component = feature.expert = expert
                        features.append(feature)
        patches_of = {id(f): records[f.component].patches if f.component else state.patches for f in features}
        for feature in features:
            feature.prepare(_seen_by(feature, setup), patches_of[id(feature)])
        for name in setup.accelerated:
            records[name].runner = setup.runners[name] = self._install_runner(setup, records[name], features)
        for feature in features:
            feature.finish(_seen_by(feature, setup), patches_of[id(feature)])
        for feature in features:
            (records[feature.component].features if feature.component else state.features).append(feature)

    def _install_runner(self, setup: Setup, record: HeldModule, features: list[Feature]) -> GraphRunner:
        adapter, config = self.adapter, self.config
        component, module = record.component, record.module
        method = adapter.targets[component]
        target = Target(component, module, method, getattr(module, method))
        fn = adapter.runner_callable(component, target.original)
        state_key = adapter.state_key(component, module)
        for feature in features:
            if (seen := expert_target(feature, target)) is not None:
                fn, state_key = feature.runner_fn(seen, fn, state_key)
        runner = target.runner = GraphRunner(
            fn,
            name=component,
            pool=self.pool,
            lock=self.lock,
            debug=config.debug,
            warmup_runs=config.warmup_runs,
            capture_error_mode=config.capture_error_mode,
            track_external_tensors=config.track_external_tensors,
            state_key=state_key,
            call_key=adapter.call_key(component),
            capture_new=config.lazy_capture,
            budget=self.budget,
            consensus=self.consensus,
            module=module,
            auto_breaks=config.auto_breaks,
        )
        call: Callable[..., Any] = runner
        for feature in features:
            if (seen := expert_target(feature, target)) is not None:
                call = feature.wrap_call(seen, call)
        prepare = adapter.prepare_call(component)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if prepare is not None:
                args, kwargs = prepare(args, kwargs)
            return call(*args, **kwargs)

        functools.update_wrapper(wrapper, target.original)
        wrapper.__bcg_runner__ = runner  # type: ignore[attr-defined]
        record.patches.replace(module, method, wrapper)
        watch_component(record.patches, component, module, runner)
        return runner

    def release(self, state: Any) -> list[HeldModule]:
        """``state``'s pipeline leaves: undo what only it held. Returns the records other members still
        hold. The caller holds :attr:`lock`."""
        kept = [record for record in state.held.values() if not self.let_go(record, state)]
        self.members.remove(state)
        if not self.members:
            self.close()
        return kept

    def let_go(self, record: HeldModule, state: Any) -> bool:
        """``state``'s pipeline no longer holds ``record``'s module: undo everything on the module if no other
        member holds it (True), else leave it accelerated for them (False). The caller holds :attr:`lock`."""
        record.holders.remove(state)
        if record.holders:
            return False
        for feature in record.features:
            feature.before_undo()
        record.patches.undo()
        if record.runner is not None:
            record.runner.close()
        for feature in record.features:
            feature.close()
        record.module.__dict__.pop(_HELD_ATTR, None)
        return True

    def close(self) -> None:
        """No member is left: revert the process-wide patches and let the pool go."""
        if not self.members:
            for patch in self.function_patches:
                patch.revert()
            self.function_patches.clear()
            self.pool = None


def _seen_by(feature: Feature, setup: Setup) -> Setup:
    """The setup ``feature`` prepares and finishes with: an expert's view for an expert's instance."""
    return setup if feature.expert is None else expert_view(setup, feature.expert)


def _undo(records: Any, features: list[Feature], state: Any) -> None:
    """Take back a half-done install: every patch on the records and the pipeline, runners, features."""
    for record in records:
        record.patches.undo()
        if record.runner is not None:
            record.runner.close()
    state.patches.undo()
    for feature in features:
        try:
            feature.close()
        except Exception as exc:  # the install's own error matters more; say what else went wrong
            logger.warning("closing feature %s after a failed install raised: %r", feature.name, exc)


def _options(config: AccelerateConfig) -> AccelerateConfig:
    """``config`` without what a warm-up does once (capturing is an action, not a property of the graphs)."""
    return dataclasses.replace(config, warmup=(), warmup_cfg=(False, True))
