"""What each carried cache decides, writes and keeps: the per-cache half of :class:`.state.CacheState`.

A captured graph must not depend on host values that change from step to step (a step counter, an
accumulated error), or every step captures a graph of its own. So each cache's host logic is split
from the kernels it chooses, and the graphs are keyed by the *decision* alone:

* **FirstBlockCache** decides on device data (the first block's residual change, read with ``.item()``):
  the decision is an eager break whose Python result picks the captured path
  (:func:`_fbc_decision`). The first step (no residual kept yet) computes like any other, so one graph
  serves both. The result of a skip also names the layouts of the kept residuals the skip path reads.
* **MagCache** decides on host state alone (step index, accumulated ratio and error, the calibrated
  ratios). :func:`mag_plan` computes the decision before the call, on a copy of the state, with a mirror
  of diffusers' decision code (:func:`_mag_head_decision`) and diffusers' own ``_advance_step``; the
  decision keys the signature, and after a replay the host state is set to what the plan computed.
  Every run that executes the hooks (warm-ups, captures, debug-mode calls) checks that the hooks left
  exactly the planned host state, so a diffusers release whose code differs fails loudly instead of
  replaying stale decisions.
* **TaylorSeer** decides on a step counter, and its arithmetic (divided differences over the steps
  between updates, the extrapolation to the current offset) uses Python numbers that change with
  the step. Its hooks' host logic and that arithmetic therefore run as eager breaks, with diffusers' own
  ``_measure_should_compute``, ``TaylorSeerState.update`` and ``predict`` on the real state: the same
  ops on the same Python numbers as eager, in every replay (:func:`_taylor_step`, run by the
  carrier). The decision is computed before the call on a copy of the state (:func:`taylor_decision`)
  and keys the signature; the graphs hold the rest of the blocks. Its factors are eager tensors,
  never read by a graph segment, so they need no buffers.

Each kind also says which state fields a path writes (:meth:`Kind.record`), so a replay sets only
those: the key no longer fixes the whole state a capture started from.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ...core.graphs import eager_break
from ...core.tree import UnsupportedValue, flatten, unflatten

__all__ = [
    "DEFAULT_CONTEXT",
    "KINDS",
    "Kind",
    "install",
    "kind_of",
    "layout",
    "mag_plan",
    "run_taylor_step",
    "taylor_decision",
    "uninstall",
]

# The context our callers set when the pipeline sets none (Z-Image's calls no cache_context): the name
# MagCache's own hooks fall back to.
DEFAULT_CONTEXT = "inference"

_PATCHED = "_bcg_patched"  # on a hook: the names of the attributes we set on it (see install)

# The diffusers code these kinds mirror or rely on (what each state holds and which path writes what, where
# each hook decides, that TaylorSeer's hook updates or predicts through the state its _measure_should_compute
# returns and that an update sets last_update_step to the current step, MagCache's decision, mirrored by
# _mag_head_decision, and its step advance) is fingerprinted in bcg_diffusion.patches.followed ("step caching:
# <kind name>"): a diffusers whose code differs keeps its calls with that cache eager (see state._Holder).


def layout(tensor: torch.Tensor) -> Hashable:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _same(a: Any, b: Any) -> bool:
    """Equal types and values (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------------------ the kinds
class Kind:
    """How :class:`.state.CacheState` carries the state of one state manager. This base carries any
    stateful hook: the whole Python state keys the signature and a replay restores all of it."""

    name = "generic"
    buffered = True  # the tensors the state keeps are written by graphs: they live in buffers
    tensor_fields: tuple[str, ...] | None = None  # the fields whose tensors live in buffers (None: every field)
    default_context: str | None = None  # the context the hooks use when none is set (MagCache's)
    # Joining the states of two cache contexts for one batch (fast mode's CFG batching, :mod:`.cfg_join`):
    # why this kind's states cannot be joined (None: they can), the fields whose tensors have one row per
    # sample (concatenated along dim 0 in the joint state, split back after), the fields that hold a tuple of
    # such tensors' shapes (their first dimension scaled alike), and whether the kept tensors may have a
    # dimension of the text's length (then two prompts of different token lengths, padded in the batch,
    # cannot be joined). Every other field is a host value, which must be equal in both states.
    join_refusal: str | None = "a cache hook of no known kind: it is not known to decide per context alone"
    batch_fields: tuple[str, ...] = ()
    batch_shape_fields: tuple[str, ...] = ()
    text_shaped: bool = False

    def key(self, carrier: Any, holder: Any, state: Any) -> Hashable:
        if state is None:
            return (None, ())
        leaves, spec = flatten(vars(state))
        host = tuple(tuple(leaf.reshape(-1).tolist()) for leaf in leaves if carrier.is_host(leaf))
        return (spec, host)

    def record(self, carrier: Any, holder: Any, state: Any) -> Any:
        if state is None:
            return None
        return {name: (spec, carrier.host_copies(leaves)) for name, (spec, leaves) in flat(state, vars(state)).items()}

    def apply(self, carrier: Any, holder: Any, context: str | None, recorded: Any) -> None:
        state = carrier.place(holder, context, recorded is not None)
        if state is not None:
            for name, (spec, leaves) in recorded.items():
                setattr(state, name, unflatten(spec, carrier.host_copies(leaves)))

    def after_run(self, carrier: Any, holder: Any, state: Any) -> None:
        """At the end of every run that executed the hooks (warm-up, capture, debug call)."""


class FirstBlockKind(Kind):
    """FirstBlockCache: the decision is a break (:func:`_fbc_decision`); the key holds none of the state."""

    name = "FirstBlockCache"
    join_refusal = (
        "FirstBlockCache decides on the first block's residual change over the whole batch, so one decision for "
        "a batch of cond and uncond could differ from the decisions each makes alone"
    )
    _COMPUTED = ("head_block_output", "head_block_residual", "tail_block_residuals", "should_compute")

    def key(self, carrier: Any, holder: Any, state: Any) -> Hashable:
        return ()

    def record(self, carrier: Any, holder: Any, state: Any) -> Any:
        # A computed call rebinds everything it keeps; a skipped one only its decision.
        if state is None:
            return None
        return flat(state, self._COMPUTED if state.should_compute else ("should_compute",))

    def apply(self, carrier: Any, holder: Any, context: str | None, recorded: Any) -> None:
        state = carrier.place(holder, context, recorded is not None)
        if state is not None:
            unflat(state, recorded)


@dataclass
class MagPlan:
    """What MagCache will do in one call (see :func:`mag_plan`)."""

    compute: bool
    host: dict[str, Any]  # every host field of the state after the call
    residual_kept: bool  # whether the state keeps a residual after the call (False: reset at the last step)
    skip_layout: Hashable = None  # skipped: the layout of the kept residual the skip path adds


class MagCacheKind(Kind):
    """MagCache: the decision comes from the host state before the call (:func:`mag_plan`) and keys the
    signature; a replay sets the host state the plan computed."""

    name = "MagCache"
    default_context = DEFAULT_CONTEXT
    # Its accumulators are host values (0-d CPU tensors once the ratios are a tensor): never in buffers.
    TENSORS = tensor_fields = ("previous_residual", "head_block_input")
    # Its decision reads host fields alone; it keeps the hidden states argument and its residual (image tokens
    # on Qwen-Image), whose shape does not depend on the text.
    join_refusal = None
    batch_fields = TENSORS

    def key(self, carrier: Any, holder: Any, state: Any) -> Hashable:
        config = holder.hook.config
        ratios = config.mag_ratios
        if isinstance(ratios, torch.Tensor) and ratios.device.type != "cpu":
            raise UnsupportedValue(
                "MagCache's mag_ratios are on the GPU: its host decision would read the device every step; "
                "pass them as a list or a CPU tensor"
            )
        plan = holder.plan = mag_plan(holder, state)
        return (True,) if plan.compute else (False, plan.skip_layout)

    def record(self, carrier: Any, holder: Any, state: Any) -> Any:
        if state is None:
            return None
        residual = state.previous_residual
        if residual is None:  # computed at the last step: the hooks dropped it, the graph kept it (stash)
            residual = holder.stash.get((holder.context, "previous_residual"))
        return flat(state, ("head_block_input",)), residual

    def apply(self, carrier: Any, holder: Any, context: str | None, recorded: Any) -> None:
        plan: MagPlan = holder.plan
        if recorded is None or plan is None:
            return
        flat_input, residual = recorded
        state = carrier.place(holder, context, True)
        unflat(state, flat_input)
        for name, value in plan.host.items():
            setattr(state, name, value)
        if not plan.residual_kept:
            state.previous_residual = None
        elif plan.compute:
            state.previous_residual = residual

    def after_run(self, carrier: Any, holder: Any, state: Any) -> None:
        plan: MagPlan | None = holder.plan
        if plan is None or state is None:
            return
        found = {name: value for name, value in vars(state).items() if name not in self.TENSORS}
        wrong = sorted(
            name
            for name in found.keys() | plan.host.keys()
            if name not in found or name not in plan.host or not _same(found[name], plan.host[name])
        )
        if (state.previous_residual is not None) != plan.residual_kept:
            wrong.append("previous_residual")
        if wrong:
            left = {name: found.get(name, "(absent)") for name in wrong}
            planned = {name: plan.host.get(name, "(absent)") for name in wrong}
            raise RuntimeError(
                f"bcg-diffusion: MagCache's hooks left {left} where bcg-diffusion's mirror of their decision "
                f"planned {planned}: this diffusers release decides differently, and replays would follow the "
                "wrong steps. Run the pipeline without accelerate, or report it with your diffusers version"
            )


class TaylorSeerKind(Kind):
    """TaylorSeer: the decision keys the signature (:func:`taylor_decision`); the host logic and the
    factors' arithmetic run in eager breaks on the real state, so nothing is restored after a replay."""

    name = "TaylorSeer"
    buffered = False
    # Its decision reads the step counter alone; its factors are the hooked modules' outputs (the text stream's
    # among them on Qwen-Image's attention), one row per sample.
    join_refusal = None
    batch_fields = ("taylor_factors",)
    batch_shape_fields = ("inactive_shapes",)
    text_shaped = True

    def key(self, carrier: Any, holder: Any, state: Any) -> Hashable:
        return (taylor_decision(holder.hook, state),)

    def record(self, carrier: Any, holder: Any, state: Any) -> Any:
        return None

    def apply(self, carrier: Any, holder: Any, context: str | None, recorded: Any) -> None:
        return None


GENERIC = Kind()
KINDS = {
    "FBCSharedBlockState": FirstBlockKind(),
    "MagCacheState": MagCacheKind(),
    "TaylorSeerState": TaylorSeerKind(),
}


def kind_of(manager: Any) -> Kind:
    """How the state of this diffusers ``StateManager`` is carried (by the class of its state)."""
    return KINDS.get(getattr(manager._state_cls, "__name__", ""), GENERIC)


def _fresh(manager: Any) -> Any:
    return manager._state_cls(*manager._init_args, **manager._init_kwargs)


# ----------------------------------------------------------------------------------------- MagCache
def _mag_head_decision(config: Any, state: Any) -> bool:
    """The decision of diffusers' ``MagCacheHeadHook.new_forward`` (without calibration), on ``state``.

    A mirror of diffusers 0.42.1's code, statement for statement, except that every ``a op= b`` is
    written ``a = a op b``: the accumulators may be 0-d CPU tensors shared with the real state, which
    the hooks update in place and this must not. Same ops, same operand order, so the same bits
    (``tests/test_step_cache_cpu.py`` checks that diffusers' source is still the one mirrored, and every
    run of the hooks checks the result: :meth:`MagCacheKind.after_run`).
    """
    current_step = state.step_index
    current_scale = 1.0 if current_step >= len(config.mag_ratios) else config.mag_ratios[current_step]
    retention_step = int(config.retention_ratio * config.num_inference_steps + 0.5)
    if current_step < retention_step:
        return True
    state.accumulated_ratio = state.accumulated_ratio * current_scale
    state.accumulated_steps = state.accumulated_steps + 1
    state.accumulated_err = state.accumulated_err + abs(1.0 - state.accumulated_ratio)
    if (
        state.previous_residual is not None
        and state.accumulated_err <= config.threshold
        and state.accumulated_steps <= config.max_skip_steps
    ):
        return False
    state.accumulated_ratio = 1.0
    state.accumulated_steps = 0
    state.accumulated_err = 0.0
    return True


_KEPT = object()  # stands for the residual a computed call keeps, in the copy mag_plan advances


def mag_plan(holder: Any, state: Any) -> MagPlan:
    """What MagCache's hooks will do in the next call from ``state`` (None: a fresh state), computed on a
    copy: the head's decision (:func:`_mag_head_decision`), the residual the tail keeps, and the tail's
    step advance, by diffusers' own ``MagCacheBlockHook._advance_step``."""
    config = holder.hook.config
    scratch = copy.copy(state) if state is not None else _fresh(holder.manager)
    compute = _mag_head_decision(config, scratch)
    scratch.should_compute = compute
    kept = scratch.previous_residual  # skipping, the hooks add it (a decision without one fails in after_run)
    skip_layout = layout(kept) if not compute and isinstance(kept, torch.Tensor) else None
    if compute:
        scratch.previous_residual = _KEPT
    tail = next(h for h in holder.hooks if type(h).__name__ == "MagCacheBlockHook")
    type(tail)._advance_step(tail, scratch)
    host = {name: value for name, value in vars(scratch).items() if name not in MagCacheKind.TENSORS}
    return MagPlan(compute, host, scratch.previous_residual is not None, skip_layout)


def _mag_advance_keeping(carrier: Any, hook: Any) -> Any:
    """MagCache's tail ``_advance_step`` that hands the residual it drops at the last step to the carrier,
    which still copies it into its buffer: a graph captured at the last step then does the same copies
    as one captured at any other step."""
    original = type(hook)._advance_step

    def _advance_step(state: Any) -> None:
        residual = state.previous_residual
        original(hook, state)
        if residual is not None and state.previous_residual is None:
            carrier.stash(hook.state_manager, "previous_residual", residual)

    return _advance_step


# -------------------------------------------------------------------------------------- TaylorSeer
class _FixedState:
    """A stand-in state manager that hands out one state."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def get_state(self) -> Any:
        return self._state


# (hook class, its three step settings, the state's step) -> the decision: every hook of one cache decides the
# same way at the same step, and key() asks for each hook before every call (60 hooks on Qwen-Image).
_TAYLOR_DECISIONS: dict[tuple[Any, ...], bool] = {}


def taylor_decision(hook: Any, state: Any) -> bool:
    """Whether a TaylorSeer hook will compute (True) or predict (False) at its next call from ``state``
    (None: a fresh state): diffusers' own ``_measure_should_compute``, run on a copy. It reads the hook's
    three step settings and the state's step counter alone (:mod:`bcg_diffusion.patches.followed`), so the decision is
    remembered by those."""
    step = None if state is None else state.current_step
    key = (type(hook), hook.cache_interval, hook.disable_cache_before_step, hook.disable_cache_after_step, step)
    decision = _TAYLOR_DECISIONS.get(key)
    if decision is None:
        scratch = copy.copy(state) if state is not None else _fresh(hook.state_manager)
        stand_in = types.SimpleNamespace(**vars(hook))
        stand_in.state_manager = _FixedState(scratch)
        decision = bool(type(hook)._measure_should_compute(stand_in)[0])
        if len(_TAYLOR_DECISIONS) > 4096:
            _TAYLOR_DECISIONS.clear()
        _TAYLOR_DECISIONS[key] = decision
    return decision


class _TaylorStep:
    """What a TaylorSeer hook's ``_measure_should_compute`` returns in place of its state: ``update`` and
    ``predict`` run, with the step advance, as one eager break each (the carrier's ``taylor_step``)."""

    def __init__(self, carrier: Any, hook: Any, should_compute: bool) -> None:
        self.carrier, self.hook, self.should_compute = carrier, hook, should_compute

    def update(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self.carrier.taylor_step(self.hook, self.should_compute, tuple(outputs))

    def predict(self) -> list[torch.Tensor]:
        return self.carrier.taylor_step(self.hook, self.should_compute, None)


def _taylor_measure(carrier: Any, hook: Any) -> Any:
    """The ``_measure_should_compute`` we give a TaylorSeer hook: decides without touching the state
    (:func:`taylor_decision`); the break behind ``update`` / ``predict`` advances it."""

    def _measure_should_compute() -> tuple[bool, _TaylorStep]:
        should_compute = taylor_decision(hook, hook.state_manager.get_state())
        return should_compute, _TaylorStep(carrier, hook, should_compute)

    return _measure_should_compute


def run_taylor_step(hook: Any, expected: bool, outputs: tuple[torch.Tensor, ...] | None) -> Any:
    """The eager part of one TaylorSeer hook call: diffusers' ``_measure_should_compute`` (advances the
    step), then ``update(outputs)`` when it computed, else ``predict()``. ``outputs`` are the graph's
    tensors, rewritten by each replay: the state keeps copies of them, as eager keeps fresh tensors.

    A second run for the same step (after :meth:`.state.CacheState.restart` put the step back) finds
    the step's update already in the state and does not apply it twice."""
    should_compute, state = type(hook)._measure_should_compute(hook)
    if bool(should_compute) != expected:
        raise RuntimeError(
            f"bcg-diffusion: a TaylorSeer hook decided {'to compute' if should_compute else 'to predict'} in its "
            "eager break but the other way before it; its state changed in between"
        )
    if outputs is None:
        return state.predict()
    if state.last_update_step != state.current_step:
        state.update(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs))
    return None


# ------------------------------------------------------------------------------------ FirstBlockCache
@eager_break
def _fbc_decision(hook: Any, hidden_states_residual: torch.Tensor) -> Any:
    """diffusers' ``FBCHeadBlockHook._should_compute_remaining_blocks``, as an eager break whose result is
    ``True`` (compute) or ``(False, layouts of the kept tail residuals)`` (skip): the skip path adds
    those residuals, so a replay that finds them in other layouts takes another path."""
    if type(hook)._should_compute_remaining_blocks(hook, hidden_states_residual):
        return True
    kept = flatten(hook.state_manager.get_state().tail_block_residuals)[0]
    return False, tuple(layout(t) for t in kept)


def _fbc_decide(hook: Any) -> Any:
    def _should_compute_remaining_blocks(hidden_states_residual: torch.Tensor) -> bool:
        return _fbc_decision(hook, hidden_states_residual) is True

    _should_compute_remaining_blocks.__bcg_decision__ = True  # type: ignore[attr-defined]
    return _should_compute_remaining_blocks


# --------------------------------------------------------------------------------------- installing
def install(hook: Any, carrier: Any) -> None:
    """Give ``hook`` the methods that let graphs carry it (by its class; others are left as they are).
    Idempotent; :func:`uninstall` takes them off."""
    if _PATCHED in vars(hook):
        return
    cls = type(hook).__name__
    methods: dict[str, Any] = {}
    if cls == "FBCHeadBlockHook":
        methods["_should_compute_remaining_blocks"] = _fbc_decide(hook)
    elif cls == "MagCacheBlockHook" and getattr(hook, "is_tail", False):
        methods["_advance_step"] = _mag_advance_keeping(carrier, hook)
    elif cls == "TaylorSeerCacheHook":
        methods["_measure_should_compute"] = _taylor_measure(carrier, hook)
    for name, method in methods.items():
        setattr(hook, name, method)
    setattr(hook, _PATCHED, tuple(methods))


def uninstall(hook: Any) -> None:
    for name in vars(hook).pop(_PATCHED, ()):
        vars(hook).pop(name, None)


def flat(state: Any, names: Any) -> dict[str, tuple[Hashable, list[torch.Tensor]]]:
    """``state``'s attributes ``names`` as (spec, tensors), to set again with :func:`unflat`."""
    out = {}
    for name in names:
        leaves, spec = flatten(getattr(state, name))
        out[name] = (spec, leaves)
    return out


def unflat(state: Any, flat_state: dict[str, tuple[Hashable, list[torch.Tensor]]]) -> None:
    for name, (spec, leaves) in flat_state.items():
        setattr(state, name, unflatten(spec, leaves))
