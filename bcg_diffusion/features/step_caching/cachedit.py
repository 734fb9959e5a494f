"""Cache-DiT's DBCache carried through the graphs: its cached blocks run inside them, its host logic in
eager breaks.

Cache-DiT (``cache_dit.enable_cache(pipe, ...)``) replaces the transformer's ``forward``: each call swaps
the block list for one ``CachedBlocks`` module, which runs the first ``Fn`` blocks, asks its context
manager whether the step may reuse the cache (a step computation mask, the warm-up steps, limits, or the
relative L1 difference of the ``Fn`` residual, read with ``.item()``), and then either applies the kept
``Bn`` residual (or the TaylorSeer calibrator's forecast of it) or runs the middle blocks and keeps their
residual, and runs the last ``Bn`` blocks. Its state (step counters, cached-step lists, the kept tensors,
calibrator factors) lives in ``CachedContext`` objects, one per context, which the pipeline's patched
``__call__`` creates afresh at each call.

The blocks are graph work; everything Cache-DiT does through its context manager is host work. So on the
context manager (the instance), the methods the cached blocks call to change or read that state
(:data:`BREAKS`) become eager breaks that run Cache-DiT's own code on the real state, at every replay:

* ``can_cache`` returns the decision, a Python bool: the runner's *paths* (one graph that computes, one
  that reuses, per argument signature), as for FirstBlockCache. Nothing of the step keys the signature;
  the contexts' configs do (:meth:`CacheDit.key`).
* ``set_context``, ``mark_step_begin`` and ``add_cached_step`` advance host counters and return nothing.
* ``set_Fn_buffer``, ``set_Bn_buffer`` and ``set_Bn_encoder_buffer`` keep a *copy* of their tensor, made
  in the break (outside the graph pool): a graph's tensor is rewritten by its next replay, and the pool's
  memory by other graphs, while eager keeps a fresh tensor. The calibrator's update runs in that break.
* ``apply_cache`` computes the reused hidden states (kept residual plus the ``Fn`` output, or the
  calibrator's forecast) eagerly and returns them through the break's bridges.

Warm-ups, captures and restarts (a replay that switches paths after the breaks ran) put the contexts back
as the call found them (:meth:`CacheDit.checkpoint`, :meth:`CacheDit.rewind`, :meth:`CacheDit.restart`).

Not carried, with the reason (the call runs eagerly): DBPrune (its per-block decisions), calibrators
other than TaylorSeer (not checked for in-place updates of what they keep), and parallel contexts.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any

import torch

from ...core.graphs import eager_break
from ...core.tree import UnsupportedValue

__all__ = ["BREAKS", "CACHE_DIT_STATE_MODULE", "FOLLOWED_SOURCES", "CacheDit", "cache_dit_enabled", "unsupported"]

# The Cache-DiT 1.5.3 code (under cache_dit.caching) this carrier relies on, by the first 16 hex digits of the
# SHA-256 of its source: the cached blocks call the state only through the methods of BREAKS (and config
# getters), those methods rebind what they keep and call none of each other, the kept tensors are never written
# in place (the TaylorSeer calibrator included), and the decision is can_cache's bool.
# tests/test_step_cache_cpu.py fails when the installed Cache-DiT differs: check this module against it.
FOLLOWED_SOURCES = {
    "cache_blocks.pattern_base.CachedBlocks_Pattern_Base.forward": "563d0d920528b033",
    "cache_blocks.pattern_base.CachedBlocks_Pattern_Base.call_Mn_blocks": "f71303d9bc816d7e",
    "cache_blocks.pattern_3_4_5.CachedBlocks_Pattern_3_4_5.forward": "6889b2f01832cdc8",
    "cache_contexts.cache_manager.CachedContextManager.set_context": "d68927da9b9e8196",
    "cache_contexts.cache_manager.CachedContextManager.can_cache": "af14fccac435c181",
    "cache_contexts.cache_manager.CachedContextManager.similarity": "1520e86e8e955d6a",
    "cache_contexts.cache_manager.CachedContextManager.apply_cache": "0108631d6a82b6fb",
    "cache_contexts.cache_manager.CachedContextManager.set_Fn_buffer": "4d1c7a80294cc001",
    "cache_contexts.cache_manager.CachedContextManager.set_Bn_buffer": "ebb4de7bed51be95",
    "cache_contexts.cache_manager.CachedContextManager.set_Bn_encoder_buffer": "d19016e0e1872ef2",
    "cache_contexts.cache_context.CachedContext.mark_step_begin": "fab2b01ccff821a3",
    "cache_contexts.cache_context.CachedContext.add_cached_step": "f9997caf3df73ff8",
    "cache_contexts.calibrators.taylorseer.TaylorSeerState.update": "d2c656fca9b752e7",
    "cache_contexts.calibrators.taylorseer.TaylorSeerState.derivative": "03aa4178e8c265a2",
    "cache_contexts.calibrators.taylorseer.TaylorSeerState.approximate": "6319025b5f59fae1",
    "cache_contexts.calibrators.taylorseer.TaylorSeerCalibrator.update": "a0982f1c06ccf2c8",
    "cache_contexts.calibrators.taylorseer.TaylorSeerCalibrator.approximate": "06346c7bf511d0ea",
}

# The context-manager methods Cache-DiT's cached blocks call to change or read its state: eager breaks.
BREAKS = (
    "set_context",
    "mark_step_begin",
    "can_cache",
    "add_cached_step",
    "apply_cache",
    "set_Fn_buffer",
    "set_Bn_buffer",
    "set_Bn_encoder_buffer",
)
_KEEPS = ("set_Fn_buffer", "set_Bn_buffer", "set_Bn_encoder_buffer")  # keep their tensor argument: a copy
_PATCHED = "_bcg_cache_dit"  # on a context manager: the carrier whose breaks it calls
CACHE_DIT_STATE_MODULE = "cache_dit.caching.cache_contexts"  # the modules of the objects that hold its state
CARRIED_CALIBRATORS = ("taylorseer",)


def cache_dit_enabled(module: torch.nn.Module) -> bool:
    """Whether Cache-DiT has patched ``module`` (it marks what it patches ``_is_cached``)."""
    return bool(vars(module).get("_is_cached", False))


def _manager(module: torch.nn.Module) -> Any:
    return vars(module).get("_context_manager") if cache_dit_enabled(module) else None


def unsupported(module: torch.nn.Module) -> str | None:
    """Why Cache-DiT on ``module`` cannot be carried through the graphs (None: it can, or it is not on)."""
    manager = _manager(module)
    if not cache_dit_enabled(module):
        return None
    if manager is None:
        return "Cache-DiT patched the transformer but left no context manager on it: not carried"
    from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager

    if type(manager) is not CachedContextManager:
        return (
            f"Cache-DiT's {type(manager).__name__} (DBPrune) decides per block; only DBCache is carried inside "
            "the graphs: the transformer runs eagerly"
        )
    if getattr(module, "_is_parallelized", False) or (
        torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    ):
        return (
            "Cache-DiT under parallelism (its decisions are all-reduced) is not carried: the transformer runs eagerly"
        )
    for context in _contexts(manager):
        calibrator = getattr(context, "calibrator_config", None)
        enabled = calibrator is not None and (calibrator.enable_calibrator or calibrator.enable_encoder_calibrator)
        if enabled and calibrator.calibrator_type not in CARRIED_CALIBRATORS:
            return (
                f"Cache-DiT's {calibrator.calibrator_type!r} calibrator is not carried inside the graphs (only "
                f"{', '.join(CARRIED_CALIBRATORS)}): the transformer runs eagerly"
            )
    return None


def _contexts(manager: Any) -> list[Any]:
    contexts = list(manager._cached_context_manager.values())
    current = manager._current_context
    if current is not None and all(current is not c for c in contexts):
        contexts.append(current)
    return contexts


# ----------------------------------------------------------------------------------------- state
def _is_state(value: Any) -> bool:
    return hasattr(value, "__dict__") and type(value).__module__.startswith(CACHE_DIT_STATE_MODULE)


def _containers(value: Any, found: list[Any]) -> Any:
    """``value`` with containers of its own (dicts, lists, tuples, sets), the same tensors and objects;
    Cache-DiT's state objects met on the way are added to ``found``."""
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps a defaultdict's factory
        for k, v in value.items():
            out[k] = _containers(v, found)
        return out
    if isinstance(value, (list, tuple, set)):
        return type(value)(_containers(v, found) for v in value)
    if _is_state(value):
        found.append(value)
    return value


def snapshot(manager: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Every Cache-DiT state object reachable from ``manager`` (contexts, calibrators, their states) with
    its attributes, containers copied; tensors are shared: nothing Cache-DiT keeps is written in place
    (DBCache and the TaylorSeer calibrator rebind what they keep)."""
    saved, seen, todo = [], set(), [manager]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found: list[Any] = []
        saved.append((obj, {k: _containers(v, found) for k, v in vars(obj).items()}))
        todo.extend(found)
    return saved


def restore(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, attrs in saved:
        vars(obj).clear()
        vars(obj).update({k: _containers(v, []) for k, v in attrs.items()})


def config_key(manager: Any) -> Hashable:
    """What of the contexts decides the code the cached blocks run: their configs (block counts, residual or
    hidden states, the mask, the calibrator), by value."""
    return tuple(
        (name, repr(c.cache_config), repr(c.extra_cache_config), repr(c.calibrator_config))
        for name, c in sorted(manager._cached_context_manager.items())
    )


class CacheDit:
    """Carries Cache-DiT's DBCache on one transformer through its graphs (see the module docstring): the
    Cache-DiT half of :class:`.state.CacheState`, which calls it at the runner's fixed points."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.manager: Any = None  # the context manager whose methods are our breaks
        self._start: list[tuple[Any, dict[str, Any]]] | None = None  # the state key() found
        self.call = eager_break(self._call)

    def key(self) -> Hashable:
        """None without Cache-DiT; else its manager and the contexts' configs. Installs the breaks on the
        manager now on the module (Cache-DiT may be enabled at any time) and notes the state for restart."""
        manager = _manager(self.module)
        if manager is not self.manager:
            self.close()
        if manager is None:
            return None
        reason = unsupported(self.module)
        if reason is not None:
            raise UnsupportedValue(reason)
        names = vars(self.module).get("_context_names") or []
        missing = [n for n in _flat(names) if n not in manager._cached_context_manager]
        if missing and not manager.persistent_context:
            raise UnsupportedValue(
                f"Cache-DiT's contexts {missing} do not exist: the transformer was called outside its pipeline's call"
            )
        self._install(manager)
        self._start = snapshot(manager)
        return ("cache-dit", id(manager), config_key(manager))

    def checkpoint(self) -> Any:
        return snapshot(self.manager) if self.manager is not None else None

    def rewind(self, token: Any) -> None:
        if token is not None:
            restore(token)

    def restart(self) -> None:
        if self._start is not None:
            restore(self._start)

    def close(self) -> None:
        if self.manager is not None:
            for name in BREAKS:
                vars(self.manager).pop(name, None)
            vars(self.manager).pop(_PATCHED, None)
        self.manager, self._start = None, None

    def _install(self, manager: Any) -> None:
        if vars(manager).get(_PATCHED) is self:
            return
        for name in BREAKS:
            setattr(manager, name, _Break(self, manager, name))
        setattr(manager, _PATCHED, self)
        self.manager = manager

    def _call(self, manager: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One context-manager method, eagerly, on the real state (an eager break, made in ``__init__``)."""
        if name in _KEEPS and args and isinstance(args[0], torch.Tensor):
            args = (args[0].clone(), *args[1:])  # kept across steps: not the graph's tensor
        result = getattr(type(manager), name)(manager, *args, **kwargs)
        if name == "can_cache":
            return bool(result)
        return result if name == "apply_cache" else None


class _Break:
    """A context-manager method that goes through the carrier's eager break."""

    def __init__(self, carrier: CacheDit, manager: Any, name: str) -> None:
        self.carrier, self.manager, self.name = carrier, manager, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.carrier.call(self.manager, self.name, args, kwargs)


def _flat(names: Any) -> list[str]:
    if isinstance(names, (list, tuple)):
        return [n for item in names for n in _flat(item)]
    return [names]
