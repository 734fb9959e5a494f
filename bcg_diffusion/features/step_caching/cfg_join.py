"""One cache context for a batch of true CFG's cond and uncond calls (fast mode's CFG batching under a cache).

Qwen-Image's pipeline runs its cond call under ``transformer.cache_context("cond")`` and its uncond call
under ``cache_context("uncond")``: each context has a state of its own in every diffusers cache hook (step
index, accumulators, kept residuals, Taylor factors). Fast mode's CFG batching
(:mod:`bcg_diffusion.features.cfg_batching`) runs both calls of a step as one batch of twice the rows. Under
a cache whose decision reads host values alone (MagCache with its ratios, TaylorSeer: the step counters and
accumulators), both contexts decide the same at every step, so the batch can run in one *joint* context,
:data:`JOINT_CONTEXT`, whose state is both states side by side:

* **Join** (:meth:`CfgJoin.join`, before a batched call): when the joint state is not there yet, it is
  built from the cond and uncond states: their host fields must be equal (else nothing is batched, and the
  batcher logs why), the tensors of the kind's ``batch_fields`` are concatenated along the batch dimension,
  cond first, as the batch is ordered. The cond and uncond states are then taken out of their contexts, so
  nothing reads them stale. Before every batched call, a copy of the joint state is kept (its kept tensors
  cloned where graphs write them in place), in case a half of the batch is not used.
* **Run** (:meth:`CfgJoin.batch`): the hooks' context is the joint one for the batched call, and back to
  the caller's after it. The graphs are keyed by the context as by any other (their own buffers), and the
  decisions (``CacheState.key``, MagCache's mirror of diffusers' decision, TaylorSeer's breaks) are made on
  the joint state, which has the host fields either context would have had.
* **Separate** (:meth:`CfgJoin.separate`, before any call that runs alone): the joint state is split back
  into the two contexts, tensors by halves (copies of their own) and host fields copied to both, so each
  context goes on exactly as if it had run alone. A half of the last batch that was not used (the
  speculated uncond half dropped; an output that could not be split) comes from the copy kept before that
  batch instead: that context did not run that call.

Decisions are therefore the unbatched run's; only rounding differs (batched GEMMs), which is what fast mode
allows. The per-call reset (diffusers' ``reset_stateful_hooks``, from the pipeline's
``maybe_free_model_hooks``) drops the joint state with the others.

FirstBlockCache (it decides on the data of the whole batch), MagCache while calibrating (it reads each
call's residuals), Cache-DiT (its own step counting and CFG handling per call) and hooks of no known kind
are not joined: :meth:`CfgJoin.refusal` says why, and the batcher runs those calls one by one.

Readers of a context's state between calls (:class:`~.enable.SkipCounter`) find the state that stands for it
with :func:`reading_context`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ...core.tree import UnsupportedValue, flatten, unflatten
from .cachedit import cache_dit_enabled
from .kinds import DEFAULT_CONTEXT, Kind, kind_of

__all__ = ["JOINT_CONTEXT", "CfgJoin", "join_states", "reading_context", "snapshot_state", "split_state"]

JOINT_CONTEXT = "bcg-cfg-batch"
"""The cache context a batch of cond and uncond runs in (a name no pipeline uses)."""

CACHE_DIT_REFUSAL = (
    "Cache-DiT counts its steps per transformer call and handles true CFG's two calls itself; one batch of both "
    "would be one call to it"
)

# A state manager whose joint state was built from two contexts -> (cond name, uncond name).
_JOINED: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()


def reading_context(manager: Any) -> str:
    """The name of the context whose state stands for ``manager``'s current context: the joint context's
    while a joint state built from the current one is there, else the current context (MagCache's default,
    :data:`~.kinds.DEFAULT_CONTEXT`, when none is set)."""
    context = manager._context
    name = DEFAULT_CONTEXT if context is None else context.name
    joined = _JOINED.get(manager)
    if joined is not None and name in joined and JOINT_CONTEXT in manager._state_cache:
        return JOINT_CONTEXT
    return name


# ------------------------------------------------------------------------------------ per kind, per state
def _fresh(manager: Any) -> Any:
    return manager._state_cls(*manager._init_args, **manager._init_kwargs)


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _own(value: Any, clone: bool) -> Any:
    """``value`` with containers of its own (lists, tuples and dicts copied), its tensors cloned if ``clone``.
    Cheap enough for every batched call (a snapshot of TaylorSeer's 60 states on Qwen-Image)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor):
        return value.clone() if clone else value
    if type(value) in (list, tuple):
        return type(value)(_own(item, clone) for item in value)
    if type(value) is dict:
        return {key: _own(item, clone) for key, item in value.items()}
    leaves, spec = flatten(value)
    return unflatten(spec, [leaf.clone() for leaf in leaves] if clone else leaves)


def _host_copy(value: Any) -> Any:
    """``value`` with containers and tensors of its own (a host field: 0-d tensors are updated in place)."""
    return _own(value, clone=True)


def _host_equal(a: Any, b: Any) -> bool:
    try:
        leaves_a, spec_a = flatten(a)
        leaves_b, spec_b = flatten(b)
    except UnsupportedValue:
        return a is b
    return spec_a == spec_b and all(torch.equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def join_states(kind: Kind, cond: Any, uncond: Any, sizes: tuple[int, int]) -> Any:
    """The joint state of ``cond`` and ``uncond`` (states of one cache kind, ``sizes`` rows each), or a str
    saying why they cannot be joined. Host fields must be equal (the joint gets copies); the tensors of
    ``kind.batch_fields`` are concatenated along dim 0, cond first; ``kind.batch_shape_fields`` get their
    first dimension summed. Changes neither state."""
    fields = vars(cond)
    if fields.keys() != vars(uncond).keys():
        return f"the cond and uncond {kind.name} states have different fields"
    joint = copy.copy(cond)
    for name, a in fields.items():
        b = getattr(uncond, name)
        if name in kind.batch_fields:
            leaves_a, spec_a = flatten(a)
            leaves_b, spec_b = flatten(b)
            if spec_a != spec_b:
                return f"the cond and uncond {kind.name} states keep {name} of different structures or shapes"
            if any(x.dim() == 0 or x.shape[0] != sizes[0] for x in leaves_a):
                return f"{kind.name}'s {name} is not one row per sample"
            setattr(joint, name, unflatten(spec_a, [torch.cat([x, y]) for x, y in zip(leaves_a, leaves_b)]))
        elif name in kind.batch_shape_fields:
            if a != b:
                return f"the cond and uncond {kind.name} states keep {name} of different shapes"
            if a is not None and any(shape[0] != sizes[0] for shape in a):
                return f"{kind.name}'s {name} is not one row per sample"
            setattr(joint, name, None if a is None else tuple((sum(sizes), *shape[1:]) for shape in a))
        elif _host_equal(a, b):
            setattr(joint, name, _host_copy(a))
        else:
            return f"the cond and uncond {kind.name} states differ in {name}"
    return joint


def split_state(kind: Kind, joint: Any, sizes: tuple[int, int]) -> tuple[Any, Any]:
    """The cond and uncond states ``joint`` (from :func:`join_states`) stands for: its tensors' rows split by
    ``sizes``, as tensors of their own; its host fields copied to each."""
    halves = (copy.copy(joint), copy.copy(joint))
    bounds = ((0, sizes[0]), (sizes[0], sum(sizes)))
    for name, value in vars(joint).items():
        if name in kind.batch_fields:
            leaves, spec = flatten(value)
            if any(leaf.dim() == 0 or leaf.shape[0] != sum(sizes) for leaf in leaves):
                raise RuntimeError(f"bcg-diffusion: {kind.name}'s joint {name} does not have {sum(sizes)} rows")
            for half, (start, end) in zip(halves, bounds):
                setattr(half, name, unflatten(spec, [leaf[start:end].clone() for leaf in leaves]))
        elif name in kind.batch_shape_fields:
            for half, rows in zip(halves, sizes):
                setattr(half, name, None if value is None else tuple((rows, *shape[1:]) for shape in value))
        else:
            for half in halves:
                setattr(half, name, _host_copy(value))
    return halves


def snapshot_state(kind: Kind, state: Any) -> Any:
    """A copy of ``state`` that the next call leaves as it is: containers of its own, host tensors cloned, and
    the kept tensors cloned too where graphs write them in place (``kind.buffered``: their buffers)."""
    saved = copy.copy(state)
    for name, value in vars(state).items():
        # Kept tensors no graph writes (TaylorSeer's, rebound by its hooks) stay the same tensors.
        setattr(saved, name, _own(value, clone=kind.buffered or name not in kind.batch_fields))
    return saved


# ------------------------------------------------------------------------------------------- the joiner
@dataclasses.dataclass
class _Manager:
    """A diffusers state manager of the module's cache, with its kind."""

    manager: Any
    kind: Kind


class CfgJoin:
    """Runs batches of cond and uncond in one cache context on ``module`` (see the module docstring).

    The caller (the CFG batcher, holding the pipeline's lock) calls, per transformer call:

    * :meth:`refusal` first: a reason to run every call one by one under the cache that is on, or None;
    * :meth:`stateful`: whether a cache keeps state per context (the first step of a call then runs one by one);
    * :meth:`note_uncond` when an uncond call runs alone (it learns the uncond context's name);
    * :meth:`join` then, inside :meth:`batch`, the batched call; :meth:`kept_cond` once its cond half is
      returned; :meth:`served` when its uncond half is returned for the uncond call, after
      :meth:`in_uncond` said that call runs in the uncond context the batch stood for;
    * :meth:`separate` before any call that runs alone.

    Without cache hooks on the module every method does nothing (and :meth:`join` accepts).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._walked: tuple[Any, ...] | None = None
        self._managers: list[_Manager] = []
        self._refusal: str | None = None
        self._uncond: str | None = None  # the context the last uncond call that ran alone ran in
        self._names: tuple[str, str] | None = None  # (cond, uncond) of the joint state, while there is one
        self._sizes: tuple[int, int] = (0, 0)
        # id(manager) -> (the joint state, its copy before the last batched call)
        self._saved: dict[int, tuple[Any, Any]] = {}
        self._used = (True, True)  # whether the last batch's cond and uncond halves were used

    # --------------------------------------------------------------------------- what is on the module
    def _walk(self) -> list[_Manager]:
        """The state managers of the stateful hooks on the module, walked again when diffusers' list of
        hooked modules or the root's hooks changed (``enable_cache`` and ``disable_cache`` change them)."""
        root = vars(self.module).get("_diffusers_hook")
        seen = (None,) if root is None else (root, root._get_child_registries(), tuple(root._hook_order))
        last = self._walked
        same = last is not None and len(last) == len(seen) and all(a is b for a, b in zip(seen[:2], last[:2]))
        if same and seen[2:] == last[2:]:
            return self._managers
        managers: dict[int, _Manager] = {}
        refusal = None
        registries = [] if root is None else [root, *root._get_child_registries()]
        for registry in registries:
            for name in registry._hook_order:
                hook = registry.hooks[name]
                if not getattr(hook, "_is_stateful", False):
                    continue
                found = [v for v in vars(hook).values() if type(v).__name__ == "StateManager"]
                if not found:
                    refusal = refusal or f"the cache hook {name!r} keeps a state that is not per cache context"
                for manager in found:
                    kind = kind_of(manager)
                    if kind.join_refusal is not None:
                        refusal = refusal or (
                            kind.join_refusal if kind.name != "generic" else f"{name!r}: {kind.join_refusal}"
                        )
                    elif getattr(getattr(hook, "config", None), "calibrate", False):
                        refusal = refusal or "MagCache in calibration mode reads each call's residuals"
                    managers.setdefault(id(manager), _Manager(manager, kind))
        self._walked, self._managers, self._refusal = seen, list(managers.values()), refusal
        return self._managers

    def refusal(self) -> str | None:
        """Why the cache on the module keeps cond and uncond calls one by one (None: no cache, or one whose
        contexts can be joined)."""
        if cache_dit_enabled(self.module):
            return CACHE_DIT_REFUSAL
        self._walk()
        return self._refusal

    def stateful(self) -> bool:
        """Whether cache hooks that keep a state per cache context are on the module."""
        return bool(self._walk())

    def _context(self) -> Any:
        managers = self._walk()
        return managers[0].manager._context if managers else None

    def note_uncond(self) -> None:
        """An uncond call is running alone: the context it runs in is the one later batches stand for."""
        context = self._context()
        self._uncond = None if context is None else context.name

    def in_uncond(self) -> bool:
        """Whether the current call runs in the uncond context of the joint state (True without a cache)."""
        if not self._managers or self._names is None:
            return True
        context = self._context()
        return context is not None and context.name == self._names[1]

    # ------------------------------------------------------------------------------------------ joining
    def join(self, sizes: tuple[int, int], padded: bool) -> str | None:
        """Make the joint state ready for a batch of ``sizes`` rows (cond, uncond) from the current (cond)
        context and the learned uncond context; ``padded``: the two texts have different token lengths and
        are padded in the batch. Returns why not (nothing changed then), or None."""
        managers = self._walk()
        if not managers:
            return None
        context = managers[0].manager._context
        if context is None:
            return "the call runs in no cache context"
        names = (context.name, self._uncond)
        if names[1] is None:
            return "no uncond call ran alone in a cache context yet"
        if names[1] == names[0]:
            return f"this call runs in the uncond calls' cache context {names[0]!r}"
        if self._names is not None and (self._names != names or self._sizes != sizes):
            self.separate()
        joints: dict[int, Any] = {}
        for entry in managers:
            cache = entry.manager._state_cache
            if JOINT_CONTEXT in cache:
                continue
            cond, uncond = cache.get(names[0]), cache.get(names[1])
            if cond is None and uncond is None:
                continue
            if padded and entry.kind.text_shaped:
                return f"{entry.kind.name} keeps outputs with the text's length, and the two prompts' lengths differ"
            cond = _fresh(entry.manager) if cond is None else cond  # a context that never ran: a fresh state
            uncond = _fresh(entry.manager) if uncond is None else uncond
            joint = join_states(entry.kind, cond, uncond, sizes)
            if isinstance(joint, str):
                return joint
            joints[id(entry.manager)] = joint
        for entry in managers:
            cache = entry.manager._state_cache
            joint = joints.get(id(entry.manager))
            if joint is not None:
                cache.pop(names[0], None)
                cache.pop(names[1], None)
                cache[JOINT_CONTEXT] = joint
            _JOINED[entry.manager] = names
        self._names, self._sizes = names, sizes
        self._saved = {
            id(entry.manager): (state, snapshot_state(entry.kind, state))
            for entry in managers
            if (state := entry.manager._state_cache.get(JOINT_CONTEXT)) is not None
        }
        return None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The batched call runs in the joint context, then the caller's context is set back."""
        from diffusers.hooks.hooks import _set_cache_context

        self._used = (False, False)
        context = self._context()
        if context is None:
            yield
            return
        _set_cache_context(self.module, dataclasses.replace(context, name=JOINT_CONTEXT))
        try:
            yield
        finally:
            _set_cache_context(self.module, context)

    def kept_cond(self) -> None:
        """The batch's cond half was returned."""
        self._used = (True, False)

    def served(self) -> None:
        """The batch's uncond half was returned for the uncond call: both contexts are the joint state now."""
        self._used = (True, True)
        self._saved = {}

    def separate(self) -> None:
        """Put the joint state back into the cond and uncond contexts (see the module docstring); nothing to
        do without one. A half of the last batch that was not used comes from the copy kept before it."""
        if self._names is None:
            return
        names, sizes = self._names, self._sizes
        for entry in self._walk():
            manager = entry.manager
            _JOINED.pop(manager, None)
            joint = manager._state_cache.pop(JOINT_CONTEXT, None)
            if joint is None:
                continue
            saved = self._saved.get(id(manager))
            before = saved[1] if saved is not None and saved[0] is joint else None
            sources = [joint if used or before is None else before for used in self._used]
            if sources[0] is sources[1]:
                halves = split_state(entry.kind, sources[0], sizes)
            else:
                halves = (split_state(entry.kind, sources[0], sizes)[0], split_state(entry.kind, sources[1], sizes)[1])
            manager._state_cache[names[0]], manager._state_cache[names[1]] = halves
        self._names, self._saved, self._used = None, {}, (True, True)
