"""Step caching inside graphs: diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache) kept
exact while the transformer replays captured graphs.

A cache hook decides on the host, every step, whether to run the remaining blocks or reuse what it
kept from earlier steps, and it keeps that (residuals, Taylor factors, step counters) in Python
objects between calls. A replay runs no Python, so three things are made explicit:

* **Decisions on device data** (FirstBlockCache's ``.item()`` of a residual difference) become eager
  breaks (:data:`DECISIONS`) whose Python result picks which captured path continues: the runner's
  branches (:mod:`bcg_diffusion.core.runner`). Each outcome replays a graph of its own.
* **Decisions on host state** (a step counter, MagCache's accumulated error) are fixed for a given
  state, so the Python part of the state before the call joins the signature (:meth:`CacheState.key`):
  each distinct state replays its own graph, and after a replay the Python state is set to what the
  capture left (:meth:`CacheState.apply`).
* **Tensors kept between steps** live in buffers of their own, outside the graph pool, one per
  (hook state, cache context, attribute, position, layout). A run copies what the hooks kept into them
  at its end (:meth:`CacheState.persist`, captured with the forward), so every graph reads and writes
  the state where it lives and no other capture can reuse that memory.

The per-call reset (``reset_state``, which pipelines call after the last step) runs eagerly between
pipeline calls and only drops the Python references; the buffers stay for the next call. Cache
contexts (Qwen-Image's ``cache_context("cond")`` and ``("uncond")``) each have their own state, so
their graphs and buffers are apart.

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

__all__ = [
    "CACHE_DIT_REASON",
    "DECISIONS",
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

# (hook class name, method) pairs that read device data on the host: each runs as an eager break.
DECISIONS = (("FBCHeadBlockHook", "_should_compute_remaining_blocks"),)

# The context our callers set when the pipeline sets none (Z-Image's calls no cache_context): the name
# MagCache's own hooks fall back to.
DEFAULT_CONTEXT = "inference"

_DECISION_ATTR = "_bcg_decision"

CACHE_DIT_REASON = (
    "Cache-DiT (cache_dit.enable_cache) keeps its cache state in objects of its own, which the graphs do not "
    "carry: the transformer runs eagerly; diffusers' FirstBlockCache, TaylorSeer and MagCache keep the graphs"
)


def cache_dit_enabled(module: torch.nn.Module) -> bool:
    """Whether Cache-DiT has patched ``module`` (it marks what it patches ``_is_cached``)."""
    return bool(vars(module).get("_is_cached", False))


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
    """One hook's state manager, with the buffers of its states."""

    def __init__(self, name: str, hook: Any, manager: Any) -> None:
        self.name, self.hook, self.manager = name, hook, manager
        self.buffers: dict[Hashable, torch.Tensor] = {}
        # What of the holder keys its signatures besides its state: set when diffusers makes the hook.
        self.identity = (id(manager), name, type(hook).__name__, _plain_config(hook))

    @property
    def context(self) -> str | None:
        context = self.manager._context
        return None if context is None else context.name

    def state(self) -> Any:
        context = self.context
        return None if context is None else self.manager._state_cache.get(context)


def _layout(tensor: torch.Tensor) -> Hashable:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


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

    Tensors a hook keeps on the CPU while the model is on a GPU (MagCache's accumulators become 0-d CPU
    tensors once its ratios are a tensor) are host values, not buffers: no graph writes them, and the
    hook decides on them in Python. They key the signature by value, as Python numbers do, and a
    replay leaves copies of the values its capture ended with.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._holders: dict[int, _Holder] = {}  # by id(manager)
        self._decisions: list[Any] = []  # hooks whose decision method we made an eager break
        # Called with the ids of state managers whose hooks were removed (disable_cache): graphs keyed
        # on them can never be replayed again, and their buffers go with them.
        self.on_removed: Callable[[set[int]], None] | None = None
        self._walked: tuple[Any, ...] | None = None  # what the last walk saw (see _live)
        self._on_gpu: bool | None = None  # whether the module's weights are on a GPU (see _is_host)

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
        live: dict[int, _Holder] = {}
        for registry in hook_registries(self.module, fresh):
            for name in registry._hook_order:
                hook = registry.hooks[name]
                if not getattr(hook, "_is_stateful", False):
                    continue
                reason = _unsupported(name, hook)
                if reason is not None:
                    raise UnsupportedValue(reason)
                self._make_decisions_breaks(hook)
                for value in vars(hook).values():
                    if type(value).__name__ == "StateManager":
                        holder = self._holders.get(id(value))
                        if holder is None or holder.manager is not value:
                            holder = _Holder(name, hook, value)
                        live[id(value)] = holder
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

    def _make_decisions_breaks(self, hook: Any) -> None:
        if _DECISION_ATTR in vars(hook):
            return
        for cls_name, method in DECISIONS:
            if type(hook).__name__ == cls_name:
                setattr(hook, method, eager_break(getattr(hook, method)))
                setattr(hook, _DECISION_ATTR, method)
                self._decisions.append(hook)

    def close(self) -> None:
        """Give the hooks their own decision methods back and drop every buffer."""
        for hook in self._decisions:
            method = vars(hook).pop(_DECISION_ATTR, None)
            if method is not None:
                vars(hook).pop(method, None)
        self._decisions.clear()
        self._holders.clear()

    # ----------------------------------------------------------------------------- the state
    def _is_host(self, tensor: torch.Tensor) -> bool:
        """A CPU tensor kept by a hook of a model on a GPU: a host value (see the class docstring)."""
        if self._on_gpu is None:
            self._on_gpu = any(p.device.type == "cuda" for p in self.module.parameters())
        return self._on_gpu and tensor.device.type == "cpu"

    def _host_copies(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return [leaf.clone() if self._is_host(leaf) else leaf for leaf in leaves]

    def _settle(self, holder: _Holder, state: Any, allocate: bool) -> None:
        """Move every tensor of ``state`` into its holder's buffer for its place and layout."""
        context = holder.context
        moves: list[tuple[str, Hashable, list[torch.Tensor]]] = []
        buffers = set(map(id, holder.buffers.values()))
        for attr, value in list(vars(state).items()):
            leaves, spec = flatten(value)
            if not leaves:
                continue
            targets = []
            for index, leaf in enumerate(leaves):
                if self._is_host(leaf):
                    targets.append(leaf)
                    continue
                where = (context, attr, index, _layout(leaf))
                buffer = holder.buffers.get(where)
                if buffer is None:
                    if not allocate:
                        raise RuntimeError(
                            f"{holder.name} kept a new tensor ({attr}[{index}]) during a capture that no warm-up "
                            "kept: its buffer cannot be allocated inside the graph"
                        )
                    buffer = holder.buffers[where] = torch.empty_strided(
                        leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device
                    )
                targets.append(buffer)
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

    def key(self) -> Hashable:
        """What of the hooks' state decides the code: per hook, its settings, the cache context and the
        Python structure and values of that context's state. Moves stray tensors into their buffers first.
        """
        if cache_dit_enabled(self.module):
            raise UnsupportedValue(CACHE_DIT_REASON)
        parts = []
        for holder in self._live():
            state = holder.state()
            host: tuple[tuple[Any, ...], ...] = ()
            if state is not None:
                self._settle(holder, state, allocate=True)
                leaves, spec = flatten(vars(state))
                host = tuple(tuple(leaf.reshape(-1).tolist()) for leaf in leaves if self._is_host(leaf))
            else:
                spec = None
            # The manager's id keys its buffers' addresses, which the graphs bake in: hooks enabled again
            # (new managers, new buffers) must not replay graphs of the old ones. Holders keep the
            # managers alive, so the ids are not reused while a key names them.
            parts.append((*holder.identity, holder.context, spec, host))
        return tuple(parts)

    def persist(self) -> None:
        for holder in self._holders.values():
            state = holder.state()
            if state is not None:
                self._settle(holder, state, allocate=not _capturing())

    def checkpoint(self) -> list[_Saved]:
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
            values = [leaf.clone() for leaf in flatten(attrs)[0]] if state is not None else []
            token.append((holder, holder.context, state, attrs, values))
        return token

    def rewind(self, token: list[_Saved]) -> None:
        for holder, context, state, attrs, values in token:
            state = _place(holder, context, state is not None, state)
            if state is None:
                continue
            vars(state).clear()
            vars(state).update(_copy(attrs))
            for buffer, value in zip(flatten(attrs)[0], values):
                buffer.copy_(value)

    def record(self) -> list[_Recorded]:
        recorded = []
        for holder in self._holders.values():
            state = holder.state()
            flat = None
            if state is not None:
                flat = {}
                for attr, value in vars(state).items():
                    spec, leaves = _swap(flatten(value))
                    flat[attr] = (spec, self._host_copies(leaves))  # host values as the capture left them
            recorded.append((holder, holder.context, flat))
        return recorded

    def apply(self, recorded: list[_Recorded]) -> None:
        for holder, context, flat in recorded:
            state = _place(holder, context, flat is not None)
            if state is None:
                continue
            for attr, (spec, leaves) in flat.items():
                setattr(state, attr, unflatten(spec, self._host_copies(leaves)))


# What checkpoint() keeps per holder: its context, the state object (None: absent), the state's attributes
# (containers of their own, the same tensors) and the values of those tensors.
_Saved = tuple[_Holder, "str | None", Any, "dict[str, Any]", "list[torch.Tensor]"]
# What record() keeps per holder: its context and each attribute's (spec, tensors), or None: absent.
_Recorded = tuple[_Holder, "str | None", "dict[str, tuple[Hashable, list[torch.Tensor]]] | None"]


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
