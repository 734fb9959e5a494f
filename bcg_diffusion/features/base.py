"""The shape every optional feature takes: decide, install through recorded patches, report, undo.

A feature is one optional part of acceleration (fast mode's compiled blocks, CFG batching, text
trimming, the VAE group norm, context parallelism, text buckets...). :func:`~bcg_diffusion.accelerate`
knows none of them by name: it walks :data:`bcg_diffusion.features.FEATURES`, asks each class whether
it applies (:meth:`Feature.create`) and calls the instances' hooks at fixed points of the install:

1. :meth:`~Feature.prepare`, before any runner exists: change the model (compile blocks, patch
   processors, apply process-wide patches);
2. :meth:`~Feature.runner_fn`, per accelerated component: what its runner calls and what else keys
   its signatures;
3. :meth:`~Feature.wrap_call`, per accelerated component: a wrapper around its runner's call;
4. :meth:`~Feature.finish`, after every runner exists: wrap methods from outside (a trimmed text
   encoder around the accelerated one), patch what the runners call into.

Later, :func:`~bcg_diffusion.stats` merges every instance's :meth:`~Feature.stats` over the class
defaults, :func:`~bcg_diffusion.warm_up` lets each instance add calls (:meth:`~Feature.warm_up`)
and runs every call in each instance's :meth:`~Feature.warming_up` context,
and ``restore`` closes it (:meth:`~Feature.close`) after undoing the patches it recorded
(:meth:`~Feature.before_undo` runs just before).

A feature lives on one component's module (``component = "transformer"``...) or on the pipeline
(``component = None``). A transformer feature that sets ``experts = True`` also serves each further
denoiser of a two-expert pipeline (Wan 2.2's ``transformer_2``): one more instance per expert, created,
prepared and finished with :func:`expert_view` of the setup, in which that expert is the
``"transformer"``; its hooks see only that expert's target, named ``"transformer"`` too, and its
``stats()`` go under ``stats()["experts"][name]``. The instance's ``component`` and ``expert`` are the
expert's name. A module shared by several pipelines is accelerated once (see
:mod:`bcg_diffusion.group`), so a module feature is created when its module is first taken and lives
as long as any accelerated pipeline holds that module; a pipeline feature is created for every
pipeline. Every patch a feature makes goes through the :class:`~bcg_diffusion.core.hooks.MethodPatches`
it is handed (its module's, or its pipeline's), which ``restore`` undoes.

>>> class Counting(Feature):                                   # doctest: +SKIP
...     name, component, defaults = "counting", "transformer", {"counted": 0}
...     @classmethod
...     def create(cls, setup):
...         return cls()
...     def wrap_call(self, target, call):
...         def counted(*args, **kwargs):
...             self.count += 1
...             return call(*args, **kwargs)
...         return counted
...     def stats(self):
...         return {"counted": self.count}
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..core.hooks import MethodPatches

if TYPE_CHECKING:
    from ..config import AccelerateConfig
    from ..core.runner import GraphRunner
    from ..group import GraphGroup
    from ..pipelines import PipelineAdapter
    from .context_parallel import ParallelLayout

__all__ = ["EXPERTS", "Feature", "Setup", "Target", "expert_target", "expert_view", "transformer_device"]

# The further denoisers of two-expert pipelines, each a component of its own (Wan 2.2's low-noise expert).
EXPERTS = ("transformer_2",)


@dataclass
class Setup:
    """What one :func:`~bcg_diffusion.accelerate` call installs into, as features see it.

    Attributes:
        pipe: the pipeline being accelerated.
        config: its options, components resolved.
        adapter: the pipeline family's adapter.
        group: the :class:`~bcg_diffusion.group.GraphGroup` (pool, lock, consensus) the modules join.
        modules: the pipeline's component modules this call takes that no accelerated pipeline held
            before (a module shared with one is already installed: nothing is installed on it again).
        accelerated: the names in ``modules`` that get a runner (``config.components`` the adapter can
            target).
        layout: the transformer's context-parallel layout, or None.
        attention_kwargs: extra keyword arguments the transformer's attention processors accept,
            added by features that patch them (fast mode's per-prompt attention).
        runners: the runners built so far, by component (complete from :meth:`Feature.finish` on).
        quantized: what ``quantize=`` did to the transformer (a
            :class:`~bcg_diffusion.features.quantization.Quantized`, with the original weights), once
            the quantization feature has prepared; None otherwise.
    """

    pipe: Any
    config: AccelerateConfig
    adapter: PipelineAdapter
    group: GraphGroup
    modules: dict[str, torch.nn.Module]
    accelerated: tuple[str, ...]
    layout: ParallelLayout | None = None
    attention_kwargs: set[str] = field(default_factory=set)
    runners: dict[str, GraphRunner] = field(default_factory=dict)
    quantized: Any = None


@dataclass
class Target:
    """One method of one component that a runner replaces (``transformer.forward``, ``vae.decode``)."""

    component: str
    module: torch.nn.Module
    method: str
    original: Callable[..., Any]  # the method as found, before our wrapper
    runner: GraphRunner | None = None  # set once built (after runner_fn, before wrap_call)

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.original)


class Feature:
    """Base of every optional feature (see the module docstring for the install order).

    Class attributes:
        name: short name, for logs.
        component: the component whose module the feature lives on, or None for the pipeline.
        defaults: the ``stats()`` keys the feature reports, with their values when it is not installed.
        experts: whether a transformer feature also serves each further expert (see the module docstring).

    Every hook is optional; the defaults do nothing.
    """

    name: ClassVar[str] = ""
    component: str | None = None  # a class attribute; an expert's instance sets its own
    defaults: ClassVar[dict[str, Any]] = {}
    experts: ClassVar[bool] = False  # also one instance per further expert (see the module docstring)
    expert: str | None = None  # set on such an instance: the expert it serves

    @classmethod
    def create(cls, setup: Setup) -> Feature | None:
        """An instance when the feature applies to ``setup`` (None: it does not). Warns
        (:class:`~bcg_diffusion.BCGWarning`) when the user asked for it and it cannot apply."""
        return None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        """Before any runner exists: change the model, recording every patch in ``patches``."""

    def runner_fn(
        self, target: Target, fn: Callable[..., Any], state_key: Callable[[], Hashable] | None
    ) -> tuple[Callable[..., Any], Callable[[], Hashable] | None]:
        """What ``target``'s runner calls and what keys its signatures besides the arguments."""
        return fn, state_key

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        """A wrapper around ``target``'s runner call (``target.runner`` is set)."""
        return call

    def finish(self, setup: Setup, patches: MethodPatches) -> None:
        """After every runner exists: wrap or patch what they call, recording it in ``patches``."""

    def stats(self) -> dict[str, Any]:
        """This instance's counters, keys among :attr:`defaults`."""
        return {}

    def patch_names(self) -> list[str]:
        """Names of the patches it applied, for ``stats()["patches"]``."""
        return []

    def warm_up(self, pipe: Any, call_kwargs: dict[str, Any]) -> int:
        """Extra calls :func:`~bcg_diffusion.warm_up` makes for this feature; returns how many."""
        return 0

    def warming_up(self) -> contextlib.AbstractContextManager[None]:
        """The context every call of :func:`~bcg_diffusion.warm_up` runs in (default: none)."""
        return contextlib.nullcontext()

    def before_undo(self) -> None:
        """Called just before ``restore`` undoes the patches of the module it lives on."""

    def close(self) -> None:
        """Undo what is not a recorded patch (process-wide patches...); called after the patches are undone."""


def transformer_device(setup: Setup) -> tuple[torch.device | None, str | None]:
    """The device of ``setup``'s transformer (that of its first parameter; the CPU without one), or None with
    why: the transformer is missing or not among the accelerated components."""
    transformer = setup.modules.get("transformer")
    if transformer is None or "transformer" not in setup.accelerated:
        return None, "the transformer is not among the accelerated components"
    parameter = next(transformer.parameters(), None)
    return (parameter.device if parameter is not None else torch.device("cpu")), None


def expert_view(setup: Setup, expert: str) -> Setup:
    """``setup`` as a transformer feature sees it when it serves ``expert`` (one of :data:`EXPERTS`): that
    expert's module and runner are the ``"transformer"``'s, and it is accelerated where the expert is."""
    modules = {name: module for name, module in setup.modules.items() if name not in ("transformer", expert)}
    modules["transformer"] = setup.modules[expert]
    accelerated = tuple(
        "transformer" if name == expert else name for name in setup.accelerated if name != "transformer"
    )
    runners = {name: runner for name, runner in setup.runners.items() if name not in ("transformer", expert)}
    if expert in setup.runners:
        runners["transformer"] = setup.runners[expert]
    return dataclasses.replace(setup, modules=modules, accelerated=accelerated, runners=runners)


def expert_target(feature: Feature, target: Target) -> Target | None:
    """The target ``feature``'s hooks see for ``target``: ``target`` itself, except for an expert's instance,
    which sees only its own expert's target, named ``"transformer"`` (None: not its own)."""
    if feature.expert is None:
        return target
    if target.component != feature.expert:
        return None
    return dataclasses.replace(target, component="transformer")
