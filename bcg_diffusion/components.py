"""Components set on an accelerated pipeline after ``accelerate`` (``pipe.transformer = other``), followed.

:func:`~bcg_diffusion.accelerate` patches the modules a pipeline holds when it is called. A module set on
the pipeline afterwards (a fine-tuned transformer swapped in, another VAE) would otherwise run eagerly while
``stats()`` said the pipeline was accelerated. So every call of an accelerated pipeline first compares the
components it may accelerate with the modules it holds (a few attribute reads), and for each that changed:

* the module it held is let go: given back as it was, unless another accelerated pipeline still holds it;
* the new module is taken into the pipeline's group with the group's options, as ``accelerate`` would have
  taken it, and captures at this call; or, where that cannot be (another device, offload or diffusers hooks,
  a module of pipelines accelerated apart), it runs eagerly, with a :class:`~bcg_diffusion.BCGWarning`
  saying why;
* ``stats(pipe)["replaced_components"]`` names it, and an INFO line says what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch

from .core.hooks import diffusers_hooks
from .core.runner import BCGWarning
from .features.step_caching import cache_dit_code_refused, cache_dit_unsupported
from .group import held_by

__all__ = ["follow_components", "module_eager_reason"]

logger = logging.getLogger(__name__)


def module_eager_reason(name: str, module: Any) -> str | None:
    """Why component ``name`` (``module``) must stay eager whatever else is accelerated (None: it need not):
    accelerate's offload hooks, diffusers hooks a graph cannot follow, or Cache-DiT where it cannot run."""
    if module is None:
        return None
    if hasattr(module, "_hf_hook"):
        return f"{name} has accelerate offload hooks (enable_*_cpu_offload): graphs need weights resident on the GPU"
    hooks = diffusers_hooks(module) if isinstance(module, torch.nn.Module) else []
    if hooks:
        return (
            f"{name} has diffusers hooks {hooks} (a cache other than FirstBlockCache, TaylorSeer and MagCache, "
            "layerwise casting or group offloading: they decide on the host or move weights every forward); "
            "remove them, or accept eager speed"
        )
    if isinstance(module, torch.nn.Module):
        reason = cache_dit_unsupported(module) or cache_dit_code_refused(module, stacklevel=6)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _device_reason(state: Any, name: str, module: torch.nn.Module) -> str | None:
    group = state.group
    if group.pool is None:
        return None  # debug mode: any device
    elsewhere = sorted({str(p.device) for p in module.parameters() if p.device != group.pool.device})
    return f"it is on {elsewhere}, not on {group.pool.device} where the pipeline's graphs live" if elsewhere else None


def follow_components(state: Any) -> None:
    """Before a call of ``state``'s pipeline: take every component set on it since it was accelerated, and let
    go of the module it replaced (see the module docstring). The caller holds the group's lock."""
    pipe, group = state.pipe, state.group
    if pipe is None or group is None:
        return
    for name in state.config.components:
        current = getattr(pipe, name, None)
        record = state.held.get(name)
        if current is (record.module if record is not None else None) or name in state.left_eager.get(id(current), ()):
            continue
        if record is not None:
            if record.runner is not None:
                for key, value in dataclasses.asdict(record.runner.counters).items():
                    state.retired[key] = state.retired.get(key, 0) + value
            group.let_go(record, state)
            del state.held[name]
        state.replaced_components.append(name)
        reason = _take(state, name, current)
        if reason is None:
            logger.info(
                "%s: a new %s was set on the pipeline; accelerated with its options", type(pipe).__name__, name
            )
            continue
        state.left_eager.setdefault(id(current), set()).add(name)
        warnings.warn(
            f"bcg-diffusion: the {name} set on {type(pipe).__name__} after accelerate() runs eagerly: {reason}",
            BCGWarning,
            stacklevel=4,
        )


def _take(state: Any, name: str, module: Any) -> str | None:
    """Hold ``module`` as component ``name`` of ``state``'s pipeline; why it stays eager, or None."""
    if not isinstance(module, torch.nn.Module):
        return None if module is None else f"it is a {type(module).__name__}, not a torch module"
    group = state.group
    record = held_by(module)
    if record is not None:
        if record.group is not group:
            return "it belongs to pipelines accelerated apart, whose graphs live in another pool"
        record.holders.append(state)
        state.held[name] = record
        return None
    reason = module_eager_reason(name, module) or _device_reason(state, name, module)
    if reason is not None:
        return reason
    taken = group.take(state, {name: module}, pipeline_features=False)
    for record in taken.values():
        record.holders.append(state)
    state.held.update(taken)
    return None
