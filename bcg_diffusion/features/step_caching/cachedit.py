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

What cannot be carried runs eagerly, with the reason, and only that part: with DBPrune (its per-block
decisions) or a calibrator other than TaylorSeer (not checked for in-place updates of what it keeps), the
cached-blocks module's whole forward becomes one eager break (:meth:`CacheDit.key`), so the embeddings,
the output norm and projection stay in the graphs and Cache-DiT's code runs as in eager. Under parallelism
(Cache-DiT's own, or a process group of more than one) the whole transformer runs eagerly: the collectives
are outside the blocks.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from collections.abc import Hashable
from typing import Any

import torch

from ...core.graphs import eager_break
from ...core.runner import BCGWarning
from ...core.tree import UnsupportedValue
from ...patches.followed import installable

__all__ = [
    "BREAKS",
    "CACHE_DIT_STATE_MODULE",
    "FOLLOWED_PATCH",
    "CacheDit",
    "cache_dit_enabled",
    "code_refused",
    "eager_blocks",
    "unsupported",
]

# The Cache-DiT code this carrier relies on (the cached blocks call the state only through the methods of BREAKS
# and config getters, those methods rebind what they keep and call none of each other, the kept tensors are never
# written in place, the TaylorSeer calibrator included, and the decision is can_cache's bool; the cached-blocks
# modules live in the closure of the forward mock_transformer installs) is fingerprinted in
# bcg_diffusion.patches.followed under this name: a Cache-DiT whose code differs keeps the transformer eager.
FOLLOWED_PATCH = "step caching: Cache-DiT"

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
    """Why Cache-DiT on ``module`` keeps the whole transformer eager (None: it is carried, at least in part, or
    it is not on): no context manager, or parallelism, whose collectives are outside the cached blocks."""
    if not cache_dit_enabled(module):
        return None
    if _manager(module) is None:
        return "Cache-DiT patched the transformer but left no context manager on it: not carried"
    if getattr(module, "_is_parallelized", False) or (
        torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    ):
        return (
            "Cache-DiT under parallelism (its decisions are all-reduced) is not carried: the transformer runs eagerly"
        )
    return None


def code_refused(module: torch.nn.Module, stacklevel: int = 4) -> str | None:
    """Why Cache-DiT on ``module`` cannot be carried because its code is not the code this carrier was written
    for (:mod:`bcg_diffusion.patches.followed`, which warns once), or None (it is, or Cache-DiT is not on)."""
    if not cache_dit_enabled(module) or installable(FOLLOWED_PATCH, stacklevel=stacklevel):
        return None
    return "Cache-DiT's code is not the code bcg-diffusion's carrier was written for: the transformer runs eagerly"


def eager_blocks(module: torch.nn.Module) -> str | None:
    """Why Cache-DiT's cached blocks on ``module`` run eagerly inside the graphs, as one break (None: they are
    captured, or Cache-DiT is not on): DBPrune, or a calibrator other than TaylorSeer."""
    manager = _manager(module)
    if manager is None:
        return None
    if type(manager) is not _dbcache_manager():
        return (
            f"Cache-DiT's {type(manager).__name__} (DBPrune) decides per block; only DBCache is carried inside "
            "the graphs: its blocks run eagerly, the rest of the transformer in the graphs"
        )
    for context in _contexts(manager):
        calibrator = getattr(context, "calibrator_config", None)
        enabled = calibrator is not None and (calibrator.enable_calibrator or calibrator.enable_encoder_calibrator)
        if enabled and calibrator.calibrator_type not in CARRIED_CALIBRATORS:
            return (
                f"Cache-DiT's {calibrator.calibrator_type!r} calibrator is not carried inside the graphs (only "
                f"{', '.join(CARRIED_CALIBRATORS)}): its blocks run eagerly, the rest of the transformer in the graphs"
            )
    return None


@functools.cache
def _dbcache_manager() -> type:
    """Cache-DiT's DBCache context manager class (imported once: :func:`eager_blocks` runs at every call)."""
    from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager

    return CachedContextManager


def _cached_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The cached-blocks modules Cache-DiT swaps into ``module`` during each call. Outside a call they are held
    only by the closure of the forward Cache-DiT installed (``CachedAdapter.mock_transformer``), so that
    closure is searched: through functions, partials, dicts, lists and module lists, nothing else."""
    from cache_dit.caching.cache_blocks.pattern_base import CachedBlocks_Pattern_Base

    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    todo: list[Any] = [vars(module).get("forward")]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CachedBlocks_Pattern_Base):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, types.FunctionType):
            todo.append(getattr(obj, "__wrapped__", None))
            for cell in obj.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, torch.nn.ModuleList)):
            todo.extend(obj)
    return found


def _contexts(manager: Any) -> list[Any]:
    contexts = list(manager._cached_context_manager.values())
    current = manager._current_context
    if current is not None and all(current is not c for c in contexts):
        contexts.append(current)
    return contexts


# ----------------------------------------------------------------------------------------- state
def _is_state(value: Any) -> bool:
    return hasattr(value, "__dict__") and type(value).__module__.startswith(CACHE_DIT_STATE_MODULE)


def _containers(value: Any, found: list[Any], clone: bool = False) -> Any:
    """``value`` with containers of its own (dicts, lists, tuples, sets), the same objects, and the same
    tensors (``clone``: copies); Cache-DiT's state objects met on the way are added to ``found``."""
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps a defaultdict's factory
        for k, v in value.items():
            out[k] = _containers(v, found, clone)
        return out
    if isinstance(value, (list, tuple, set)):
        return type(value)(_containers(v, found, clone) for v in value)
    if clone and isinstance(value, torch.Tensor):
        return value.clone()
    if _is_state(value):
        found.append(value)
    return value


class Snapshot:
    """What :func:`snapshot` saved: each Cache-DiT state object with its attributes, and whether the
    tensors among them are copies (then :func:`restore` copies them again, so it can restore twice)."""

    def __init__(self, objects: list[tuple[Any, dict[str, Any]]], clone: bool) -> None:
        self.objects, self.clone = objects, clone


def snapshot(manager: Any, clone: bool = False) -> Snapshot:
    """Every Cache-DiT state object reachable from ``manager`` (contexts, calibrators, their states) with
    its attributes, containers copied; tensors are shared: nothing DBCache and the TaylorSeer calibrator
    keep is written in place (they rebind it). ``clone``: tensors are copied too, for the code that was not
    checked for that (DBPrune, other calibrators)."""
    saved, seen, todo = [], set(), [manager]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found: list[Any] = []
        saved.append((obj, {k: _containers(v, found, clone) for k, v in vars(obj).items()}))
        todo.extend(found)
    return Snapshot(saved, clone)


def restore(saved: Snapshot) -> None:
    """Put back what :func:`snapshot` saved."""
    for obj, attrs in saved.objects:
        vars(obj).clear()
        vars(obj).update({k: _containers(v, [], saved.clone) for k, v in attrs.items()})


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
        self.manager: Any = None  # the context manager on the module when key() last ran
        self.eager_reason: str | None = None  # why the cached blocks run as one eager break (see eager_blocks)
        self.refused: str | None = None  # why the manager's Cache-DiT cannot be carried (code_refused)
        self._blocks: list[torch.nn.Module] = []  # cached-blocks modules whose forward is that break
        self._start: Snapshot | None = None  # the state key() found
        self.call = eager_break(self._call)

    def key(self) -> Hashable:
        """None without Cache-DiT; else its manager, how it is carried and the contexts' configs. Installs the
        breaks on the manager now on the module (Cache-DiT may be enabled at any time), or, for what cannot be
        carried (:func:`eager_blocks`), makes the cached blocks' forward one eager break and warns once; notes
        the state for restart. Raises UnsupportedValue where the whole transformer must run eagerly.

        Warm-ups and captures save the state with :meth:`checkpoint` and put it back with :meth:`rewind`;
        with the blocks eager, that copy includes the kept tensors (code not checked for in-place writes)."""
        manager = _manager(self.module)
        if manager is not self.manager:
            self.close()
            self.refused = code_refused(self.module, stacklevel=6)  # once per manager: it reads the sources
        if manager is None:
            return None
        reason = self.refused or unsupported(self.module)
        if reason is not None:
            raise UnsupportedValue(reason)
        names = vars(self.module).get("_context_names") or []
        missing = [n for n in _flat(names) if n not in manager._cached_context_manager]
        if missing and not manager.persistent_context:
            raise UnsupportedValue(
                f"Cache-DiT's contexts {missing} do not exist: the transformer was called outside its pipeline's call"
            )
        eager = eager_blocks(self.module)
        if eager is not None:
            # One break runs the blocks and all of Cache-DiT's logic: no replay switches paths after it, so
            # nothing to restart (and copying every kept tensor at every call would cost a forward's memory).
            self._install_eager(manager, eager)
            self._start = None
        else:
            self._install(manager)
            self._start = snapshot(manager)
        return ("cache-dit", id(manager), eager is not None, config_key(manager))

    def path_hint(self) -> Hashable | None:
        """How many transformer calls each of Cache-DiT's contexts ran in this pipeline call (its contexts are
        made afresh at each): the coming call's place in the call, which decides its path under a static
        computation mask, and is a good guess under the others. None without Cache-DiT, or with its blocks
        eager (no path to choose)."""
        if self.manager is None or self.eager_reason is not None:
            return None
        return tuple(
            (name, context.transformer_executed_steps)
            for name, context in sorted(self.manager._cached_context_manager.items())
        )

    def checkpoint(self) -> Any:
        return snapshot(self.manager, clone=self.eager_reason is not None) if self.manager is not None else None

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
        for blocks in self._blocks:
            vars(blocks).pop("forward", None)
        self.manager, self.eager_reason, self._blocks, self._start = None, None, [], None

    def _install(self, manager: Any) -> None:
        if vars(manager).get(_PATCHED) is self and self.eager_reason is None:
            return
        self.close()
        for name in BREAKS:
            setattr(manager, name, _Break(self, manager, name))
        setattr(manager, _PATCHED, self)
        self.manager = manager

    def _install_eager(self, manager: Any, reason: str) -> None:
        if self.manager is manager and self.eager_reason == reason:
            return
        self.close()
        blocks = _cached_blocks(self.module)
        if not blocks:
            raise UnsupportedValue(f"{reason}; but its cached blocks were not found: the transformer runs eagerly")
        for module in blocks:
            # The instance's forward, which nn.Module.__call__ prefers to the class's; popped again by close().
            module.forward = eager_break(type(module).forward.__get__(module))
        warnings.warn(f"bcg-diffusion: {reason}", BCGWarning, stacklevel=2)
        self.manager, self.eager_reason, self._blocks = manager, reason, blocks

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
