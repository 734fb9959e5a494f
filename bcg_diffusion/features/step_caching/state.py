"""Step caching inside graphs: diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache) kept
exact while the transformer replays captured graphs, with a few graphs per call shape.

A cache hook decides on the host, every step, whether to run the remaining blocks or reuse what it
kept from earlier steps, and it keeps that (residuals, Taylor factors, step counters) in Python
objects between calls. A replay runs no Python, so four things are made explicit:

* **Graphs are keyed by the decision, not by the step.** FirstBlockCache's decision reads device data
  (``.item()`` of a residual difference): it is an eager break whose Python result picks which captured
  path continues (the runner's branches, :mod:`bcg_diffusion.core.runner`). MagCache and TaylorSeer
  decide on host state alone (step counters, accumulated errors): their decision for the coming call is
  computed before it on a copy of the state and joins the signature (:meth:`CacheState.key`). Step
  indices, accumulators and flags stay out of the key, so each outcome (compute, skip) has one graph per
  argument signature, whatever the step. What each cache decides and writes is :mod:`.kinds`.
* **Host state after a replay** is what eager would leave: the fields a path writes are set from its
  capture's record (:meth:`CacheState.apply`; FirstBlockCache's decision and kept tensors), MagCache's
  host fields from the plan computed before the call, and TaylorSeer's whole state by its eager
  breaks, which run diffusers' own code on the real state in every replay.
* **Tensors kept between steps** that graphs write (FirstBlockCache's and MagCache's residuals) live in
  buffers of their own, outside the graph pool, one per (hook state, cache context, attribute, position,
  layout). A run copies what the hooks kept into them at its end (:meth:`CacheState.persist`, captured
  with the forward), so every graph reads and writes the state where it lives and no other capture can
  reuse that memory. TaylorSeer's factors are only read by its breaks: eager tensors, as in eager.
* **Breaks that change state** (TaylorSeer's step advance) run again when a replay switches paths;
  :meth:`CacheState.restart` puts what they changed back first.

The per-call reset (``reset_state``, which pipelines call after the last step) runs eagerly between
pipeline calls and only drops the Python references; the buffers stay for the next call. Cache
contexts (Qwen-Image's ``cache_context("cond")`` and ``("uncond")``, and fast mode's joint context for a
batch of both, :mod:`.cfg_join`) each have their own state, so their graphs and buffers are apart.

Supported: the hooks of :data:`SUPPORTED_HOOKS`. Any other stateful hook (FasterCache,
PyramidAttentionBroadcast...) makes the call run eagerly with the reason (see :meth:`CacheState.key`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ...core.graphs import eager_break
from ...core.tree import UnsupportedValue, flatten, unflatten
from ...patches.followed import FOLLOWED, installable
from .cachedit import CacheDit, cache_dit_enabled
from .cachedit import _manager as _cachedit_manager
from .kinds import DEFAULT_CONTEXT, Kind, install, kind_of, layout, run_taylor_step, uninstall

__all__ = [
    "DEFAULT_CONTEXT",
    "SUPPORTED_HOOKS",
    "CacheState",
    "cache_dit_enabled",
    "cache_hooks",
    "has_cache_hooks",
]

logger = logging.getLogger(__name__)

# diffusers' names of the hooks whose state we carry (see diffusers.hooks.*): graphs may hold them.
SUPPORTED_HOOKS = (
    "fbc_leader_block_hook",
    "fbc_block_hook",
    "taylorseer_cache",
    "mag_cache_leader_block_hook",
    "mag_cache_block_hook",
)


def hook_registries(module: torch.nn.Module, fresh: bool = False) -> list[Any]:
    """``module``'s diffusers hook registry and its children's, from diffusers' cached list (what its
    ``cache_context`` walks every call; a module with no registry of its own has none: enable_cache
    makes one); ``fresh``: walk the modules again. Creates nothing."""
    root = vars(module).get("_diffusers_hook")
    if not fresh:
        return [] if root is None else [root, *root._get_child_registries()]
    if root is not None:
        root.invalidate_child_registries_cache()
        return [root, *root._get_child_registries()]
    return [m._diffusers_hook for m in module.modules() if "_diffusers_hook" in vars(m)]


def has_cache_hooks(module: torch.nn.Module) -> bool:
    """Whether a stateful diffusers hook (a cache's) is on ``module``'s tree; cheap enough for every call."""
    return any(
        getattr(hook, "_is_stateful", False)
        for registry in hook_registries(module)
        for hook in registry.hooks.values()
    )


def cache_hooks(module: torch.nn.Module) -> list[str]:
    """Names of the stateful diffusers hooks on ``module``'s tree (a cache's), sorted."""
    names = set()
    for registry in hook_registries(module):
        names.update(name for name, hook in registry.hooks.items() if getattr(hook, "_is_stateful", False))
    return sorted(names)


def _unsupported(name: str, hook: Any) -> str | None:
    if name not in SUPPORTED_HOOKS:
        return (
            f"the cache hook {name!r} ({type(hook).__name__}) is not supported inside graphs (supported: "
            "FirstBlockCache, TaylorSeerCache, MagCache)"
        )
    config = getattr(hook, "config", None)
    if getattr(config, "calibrate", False):
        return "MagCache in calibration mode appends a host value every step; calibrate eagerly, then accelerate"
    return None


def _plain_config(hook: Any) -> Hashable:
    """The hook's own settings that its Python code reads (thresholds, intervals): part of the key."""
    items = []
    for name, value in sorted(vars(hook).items()):
        if name in ("fn_ref", "state_manager", "_metadata") or name.startswith("_bcg"):
            continue
        if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
            items.append((name, value))
        elif dataclass_fields := getattr(value, "__dataclass_fields__", None):
            items.append((name, repr({f: getattr(value, f) for f in dataclass_fields})))
    return tuple(items)


class _Holder:
    """One hook state manager (a cache's state, one per cache context), the hooks that share it, how its
    state is carried (its :class:`~.kinds.Kind`) and the buffers of its tensors."""

    def __init__(self, name: str, hooks: list[Any], manager: Any) -> None:
        self.name, self.hooks, self.manager = name, hooks, manager
        self.hook = hooks[0]
        self.kind: Kind = kind_of(manager)
        # Why this cache cannot be carried: diffusers' code for it is not the code its kind mirrors (a warning
        # says so, once, when the holder is made; every call with the hook then runs eagerly).
        followed = f"step caching: {self.kind.name}"
        self.refused = (
            None
            if followed not in FOLLOWED or installable(followed, stacklevel=7)
            else (
                f"diffusers' {self.kind.name} code is not the code bcg-diffusion's step caching mirrors "
                "(bcg_diffusion.patches.followed); calls with that cache run eagerly"
            )
        )
        self.buffers: dict[Hashable, torch.Tensor] = {}
        # What of the holder keys its signatures besides its state: set when diffusers makes the hook.
        self.identity = (id(manager), name, type(self.hook).__name__, _plain_config(self.hook))
        self.plan: Any = None  # what key() computed for the coming call (MagCache's plan)
        # (context, attribute) -> a tensor the hooks kept and dropped in this run, still to be copied into
        # its buffer (MagCache's residual at the last step); after persist(), that buffer
        self.stash: dict[tuple[str | None, str], torch.Tensor] = {}

    @property
    def context(self) -> str | None:
        context = self.manager._context
        return self.kind.default_context if context is None else context.name

    def state(self) -> Any:
        context = self.context
        return None if context is None else self.manager._state_cache.get(context)


class CacheState:
    """The cache hooks' state on one module, carried through its graphs (a runner's
    :class:`~bcg_diffusion.core.runner.OuterState`; see the module docstring for the contract).

    Needs the hooks' state to be plain data: tensors, Python scalars, dtypes, devices, and lists,
    tuples and dicts of those, and the hooks to *rebind* what they keep (``state.residual = r``), never
    to write a kept tensor in place before their last decision: a replay that switches paths runs the
    graph up to the decision again (every supported hook rebinds). Buffers stay while their hooks are
    on, one set per resolution: the memory the cache itself keeps in eager. Raises
    :class:`~bcg_diffusion.core.tree.UnsupportedValue` from :meth:`key` otherwise, and for unsupported hooks,
    which the runner turns into an eager call with the reason.

    A stateful hook of no known kind (only tests make one) is carried whole: the Python state before the
    call keys the signature and a replay leaves what the capture left. Tensors such a hook keeps on the
    CPU while the model is on a GPU are host values: they key by value, and a replay leaves copies.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._holders: dict[int, _Holder] = {}  # by id(manager)
        self._installed: list[Any] = []  # hooks we gave methods of ours (kinds.install)
        # Called with the ids of state managers whose hooks were removed (disable_cache): graphs keyed
        # on them can never be replayed again, and their buffers go with them.
        self.on_removed: Callable[[set[int]], None] | None = None
        self._walked: tuple[Any, ...] | None = None  # what the last walk saw (see _live)
        self._on_gpu: bool | None = None  # whether the module's weights are on a GPU (see is_host)
        # What TaylorSeer's breaks changed since key(), to put back before they run again (see restart):
        # id(manager) -> (manager, context, whether the state existed, its step counter)
        self._undo: dict[int, tuple[Any, str, bool, int | None]] = {}
        self.taylor_step = eager_break(self._taylor_step)
        self.cachedit = CacheDit(module)

    # ------------------------------------------------------------------------------ discovery
    def _live(self, fresh: bool = False) -> list[_Holder]:
        """The holders of the hooks on the module now (new ones get theirs; removed ones are dropped).

        Called before every transformer call: the walk is skipped while diffusers' cached list of
        hooked modules is the same object as at the last walk (enable_cache and disable_cache replace
        it), and the root's own hooks are the same."""
        root = vars(self.module).get("_diffusers_hook")
        if not fresh:
            seen = (root, root._get_child_registries(), tuple(root._hook_order)) if root is not None else (None,)
            last = self._walked  # the registries by identity (a new list once invalidated), the root's hooks by value
            same = last is not None and len(last) == len(seen) and all(a is b for a, b in zip(seen[:2], last[:2]))
            if same and seen[2:] == last[2:]:
                return list(self._holders.values())
        found: dict[int, tuple[str, list[Any], Any]] = {}
        for registry in hook_registries(self.module, fresh):
            for name in registry._hook_order:
                hook = registry.hooks[name]
                if not getattr(hook, "_is_stateful", False):
                    continue
                reason = _unsupported(name, hook)
                if reason is not None:
                    raise UnsupportedValue(reason)
                for value in vars(hook).values():
                    if type(value).__name__ == "StateManager":
                        found.setdefault(id(value), (name, [], value))[1].append(hook)
        # Hooks without a state of their own share one (FirstBlockCache's and MagCache's block hooks): theirs.
        for registry in hook_registries(self.module, fresh):
            for hook in registry.hooks.values():
                manager = getattr(hook, "state_manager", None)
                if manager is not None and id(manager) in found and hook not in found[id(manager)][1]:
                    found[id(manager)][1].append(hook)
        live: dict[int, _Holder] = {}
        for key, (name, hooks, manager) in found.items():
            holder = self._holders.get(key)
            if holder is None or holder.manager is not manager:
                holder = _Holder(name, hooks, manager)
            holder.hooks = hooks
            live[key] = holder
        # Our methods on the hooks that are on now; hooks taken off (disable_cache) get theirs back.
        hooks = [hook for holder in live.values() for hook in holder.hooks]
        for hook in self._installed:
            if not any(hook is other for other in hooks):
                uninstall(hook)
        for hook in hooks:
            install(hook, self)
        self._installed = hooks
        removed = self._holders.keys() - live.keys()
        self._holders = live
        self._walked = None if fresh else seen
        if removed and self.on_removed is not None:
            self.on_removed(set(removed))
        return list(live.values())

    @staticmethod
    def mentions(key: Hashable, managers: set[int]) -> bool:
        """Whether ``key`` (from :meth:`key`) names one of the state managers with these ids."""
        return any(part[0] in managers for part in key)

    def close(self) -> None:
        """Give the hooks their own methods back and drop every buffer."""
        for hook in self._installed:
            uninstall(hook)
        self._installed.clear()
        self._holders.clear()
        self._undo.clear()
        self.cachedit.close()

    # ----------------------------------------------------------------------------- the state
    def is_host(self, tensor: torch.Tensor) -> bool:
        """A CPU tensor kept by a hook of a model on a GPU: a host value (see the class docstring)."""
        if self._on_gpu is None:
            self._on_gpu = any(p.device.type == "cuda" for p in self.module.parameters())
        return self._on_gpu and tensor.device.type == "cpu"

    @staticmethod
    def place(holder: _Holder, context: str | None, present: bool) -> Any:
        """``holder``'s state in ``context``, made present (created if absent) or absent (None)."""
        return _place(holder, context, present)

    def host_copies(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return [leaf.clone() if self.is_host(leaf) else leaf for leaf in leaves]

    def _buffer(self, holder: _Holder, where: Hashable, like: torch.Tensor, allocate: bool, what: str) -> torch.Tensor:
        buffer = holder.buffers.get(where)
        if buffer is None:
            if not allocate:
                raise RuntimeError(
                    f"{holder.name} kept a new tensor ({what}) during a capture that no warm-up kept: its buffer "
                    "cannot be allocated inside the graph"
                )
            buffer = holder.buffers[where] = torch.empty_strided(
                like.shape, like.stride(), dtype=like.dtype, device=like.device
            )
        return buffer

    def _settle(self, holder: _Holder, state: Any, allocate: bool) -> None:
        """Move every tensor of ``state`` into its holder's buffer for its place and layout."""
        context = holder.context
        moves: list[tuple[str, Hashable, list[torch.Tensor]]] = []
        buffers = set(map(id, holder.buffers.values()))
        fields = holder.kind.tensor_fields
        for attr, value in list(vars(state).items()):
            if fields is not None and attr not in fields:
                continue
            dropped = holder.stash.get((context, attr)) if value is None else None
            if dropped is not None:
                # Kept and dropped in this run (see stash): copied into its buffer, in the field's turn (a graph
                # captured at the last step does the copies of any other step, in the same order); still None.
                buffer = self._buffer(holder, (context, attr, 0, layout(dropped)), dropped, allocate, attr)
                if buffer is not dropped:
                    buffer.copy_(dropped)
                holder.stash[(context, attr)] = buffer
                continue
            leaves, spec = flatten(value)
            if not leaves:
                continue
            targets = []
            for index, leaf in enumerate(leaves):
                if self.is_host(leaf):
                    targets.append(leaf)
                    continue
                where = (context, attr, index, layout(leaf))
                targets.append(self._buffer(holder, where, leaf, allocate, f"{attr}[{index}]"))
            if any(t is not leaf for t, leaf in zip(targets, leaves)):
                moves.append((attr, spec, list(zip(targets, leaves))))
        # A state may move a kept tensor to another place (FasterCache-style [old[-1], new]): read every
        # buffer that is a source before writing any.
        sources = {}
        for _, _, pairs in moves:
            for target, leaf in pairs:
                if target is not leaf and id(leaf) in buffers and id(leaf) not in sources:
                    sources[id(leaf)] = leaf.clone()
        for attr, spec, pairs in moves:
            for target, leaf in pairs:
                if target is not leaf:
                    target.copy_(sources.get(id(leaf), leaf))
            setattr(state, attr, unflatten(spec, [target for target, _ in pairs]))

    def stash(self, manager: Any, attr: str, tensor: torch.Tensor) -> None:
        """A hook dropped ``tensor``, kept as ``attr`` until now, in this run (MagCache's residual at the last
        step): :meth:`persist` still copies it into its buffer, as at any other step."""
        holder = self._holders.get(id(manager))
        if holder is not None:
            holder.stash[(holder.context, attr)] = tensor

    def key(self) -> Hashable:
        """What decides the code of the coming call: per hook state, its settings, the cache context and
        what its kind puts in the key (:mod:`.kinds`: a decision, or nothing when a break decides). Moves
        stray tensors (kept by an eager call) into their buffers first."""
        dit = self.cachedit.key()  # Cache-DiT's DBCache (.cachedit), carried beside diffusers' hooks
        self._undo.clear()
        parts = []
        for holder in self._live():
            if holder.refused is not None:
                raise UnsupportedValue(holder.refused)
            holder.stash.clear()
            holder.plan = None
            state = holder.state()
            if state is not None and holder.kind.buffered:
                self._settle(holder, state, allocate=True)
            # The manager's id keys its buffers' addresses, which the graphs bake in: hooks enabled again
            # (new managers, new buffers) must not replay graphs of the old ones. Holders keep the
            # managers alive, so the ids are not reused while a key names them.
            parts.append((*holder.identity, holder.context, holder.kind.key(self, holder, state)))
        if dit is not None:
            parts.append(dit)
        return tuple(parts)

    def managed(self) -> list[Any]:
        """The objects whose state this carries through the graphs (the runner's optional hook): Cache-DiT's
        context manager, which its blocks hold as an attribute and change at every step. diffusers' hook
        states live in the modules' hook registries, which the state check leaves alone anyway."""
        manager = _cachedit_manager(self.module)
        return [manager] if manager is not None else []

    def path_hint(self) -> Hashable | None:
        """Which earlier calls the coming one should decide like (the runner's optional hint): Cache-DiT's
        (:meth:`.cachedit.CacheDit.path_hint`); None for diffusers' hooks, whose decisions either join the
        key or read the data."""
        return self.cachedit.path_hint()

    def persist(self) -> None:
        for holder in self._holders.values():
            state = holder.state()
            if state is not None and holder.kind.buffered:
                self._settle(holder, state, allocate=not _capturing())
            holder.kind.after_run(self, holder, state)

    def checkpoint(self) -> tuple[list[_Saved], Any]:
        # Captures are rare: check that diffusers' cached list of registries, which key() trusts, is not
        # stale (apply_first_block_cache and friends, called directly, do not refresh it).
        seen = set(self._holders)
        if {id(holder.manager) for holder in self._live(fresh=True)} != seen:
            raise RuntimeError(
                "bcg-diffusion: cache hooks were added or removed without enable_cache()/disable_cache(), which "
                "keep diffusers' list of hooked modules current; a graph captured now would not follow them. "
                "Use transformer.enable_cache(config) (or bcg_diffusion.enable_cache)"
            )
        token = []
        for holder in self._holders.values():
            state = holder.state()
            attrs = _copy(vars(state)) if state is not None else {}
            # Buffered kinds may write kept tensors in place (MagCache's accumulators): keep their values.
            # TaylorSeer's breaks only rebind.
            keep_values = state is not None and holder.kind.buffered
            values = [leaf.clone() for leaf in flatten(attrs)[0]] if keep_values else []
            token.append((holder, holder.context, state, attrs, values))
        return token, self.cachedit.checkpoint()

    def rewind(self, token: tuple[list[_Saved], Any]) -> None:
        saved, dit = token
        self.cachedit.rewind(dit)
        for holder, context, state, attrs, values in saved:
            holder.stash.clear()
            state = _place(holder, context, state is not None, state)
            if state is None:
                continue
            vars(state).clear()
            vars(state).update(_copy(attrs))
            for buffer, value in zip(flatten(attrs)[0], values):
                buffer.copy_(value)

    def record(self) -> list[_Recorded]:
        return [(h, h.context, h.kind.record(self, h, h.state())) for h in self._holders.values()]

    def apply(self, recorded: list[_Recorded]) -> None:
        for holder, context, what in recorded:
            holder.kind.apply(self, holder, context, what)

    def restart(self) -> None:
        """Before a replay runs the breaks of this call again (another path, a branch's capture, an eager
        call): put back what TaylorSeer's breaks changed since :meth:`key`. The step counter goes back, and a
        state the call created goes; factors a break already updated stay, and its second run for the same
        step does not update them again (:func:`~.kinds.run_taylor_step`). The other kinds' breaks change
        nothing. Cache-DiT's contexts go back to what :meth:`key` found (:meth:`.cachedit.CacheDit.restart`)."""
        self.cachedit.restart()
        for manager, context, existed, step in self._undo.values():
            if not existed:
                manager._state_cache.pop(context, None)
            elif (state := manager._state_cache.get(context)) is not None:
                state.current_step = step
        self._undo.clear()

    def _taylor_step(self, hook: Any, expected: bool, outputs: tuple[torch.Tensor, ...] | None) -> Any:
        """One TaylorSeer hook's step advance and update or prediction (see :func:`~.kinds.run_taylor_step`),
        noting first what :meth:`restart` must put back. Made an eager break in ``__init__``."""
        manager = hook.state_manager
        if id(manager) not in self._undo:
            context = manager.context.name  # raises diffusers' own error without a context, as eager would
            state = manager._state_cache.get(context)
            step = state.current_step if state is not None else None
            self._undo[id(manager)] = (manager, context, state is not None, step)
        return run_taylor_step(hook, expected, outputs)


# What checkpoint() keeps per holder: its context, the state object (None: absent), the state's attributes
# (containers of their own, the same tensors) and the values of those tensors.
_Saved = tuple[_Holder, "str | None", Any, "dict[str, Any]", "list[torch.Tensor]"]
# What record() keeps per holder: its context and what its kind records (None: absent).
_Recorded = tuple[_Holder, "str | None", Any]


def _place(holder: _Holder, context: str | None, present: bool, state: Any = None) -> Any:
    """Make ``holder``'s state in ``context`` present (``state``, else the one there, else a new one) and
    return it, or absent (None). Nothing to do without a context."""
    if context is None:
        return None
    cache = holder.manager._state_cache
    if not present:
        cache.pop(context, None)
        return None
    if state is not None:
        cache[context] = state
    elif context not in cache:
        manager = holder.manager
        cache[context] = manager._state_cls(*manager._init_args, **manager._init_kwargs)
    return cache[context]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _swap(flat: tuple[list[torch.Tensor], Hashable]) -> tuple[Hashable, list[torch.Tensor]]:
    leaves, spec = flat
    return spec, leaves


def _copy(attrs: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state's attributes with containers of their own and the same tensors."""
    return {attr: unflatten(*_swap(flatten(value))) for attr, value in attrs.items()}
