"""The runner: replaces one callable (a module's ``forward``, a VAE's ``decode``) with graphs.

For every distinct call signature (see :mod:`bcg_diffusion.core.tree`) the runner keeps static input
buffers, warms the callable up on the capture stream, captures it as a breakable graph on the first
call, and replays it afterwards: copy inputs in, replay, clone outputs (two calls of one graph return
the same buffers, so CFG's cond and uncond results would otherwise overwrite each other).

A signature whose capture fails runs eagerly from then on, with one warning naming the reason; it is
not retried. Errors the eager callable itself raises (bad shapes...) propagate unchanged.

**Branches.** A break that returns a Python value (a cache's "skip the remaining blocks?") freezes
the code after it. When a replay's break returns another value, the runner takes that other *path*:
it replays the signature's graph for it if one was captured, else captures one there and then (from
the same static inputs, so the capture takes the same way), up to :data:`MAX_PATHS` per signature.
Every decision is made on the host each call, exactly as eager makes it; each outcome replays a graph
of its own. Switching paths re-runs the graph up to the branch point (see
:class:`~bcg_diffusion.core.graphs.BreakableGraph`).

**Outer state.** A callable may read and write state that is not in its arguments (diffusers' cache
hooks keep residuals and step counters between calls). An :class:`OuterState` makes that safe: its
``key()`` joins the signature, its tensors live in buffers outside the graph pool that the graphs
update in place, warm-ups and captures start from the same state as the call, after a replay the
Python side of the state is set to what the capture left, and a replay that switches paths first lets
the state undo what its breaks changed (``restart()``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import graphs, settings
from .auto_breaks import AutoBreaker, module_breaks, modules_to_break, refused_by_capture
from .budget import SignatureBudget
from .graphs import BreakableGraph, BreakResultMismatch, GraphPool, capture_breakable
from .hostile import HostileOpFinder
from .opaque import OpaqueArgument
from .python_data import PythonDataConstants
from .python_state import ReadRecorder, StateWatch, Watched, current_scope
from .recording import NotRecordable, RecordedGraph, first_difference, record_breakable, same_bytes
from .tree import UnsupportedValue, describe, differences, flatten, unflatten

__all__ = ["MAX_PATHS", "BCGWarning", "GraphRunner", "OuterState", "RunnerCounters", "SignatureRecord"]

logger = logging.getLogger(__name__)


# Paths (branch outcomes) one signature may capture; a signature that needs more runs eagerly.
MAX_PATHS = 8


class BCGWarning(UserWarning):
    """A bcg-diffusion warning: something runs eagerly (slower, still correct) and here is why."""


class OuterState(Protocol):
    """State that the runner's callable reads and writes besides its arguments (see the module docstring).

    The runner calls, in this order per call: ``key()`` (before the lookup; what of the state decides
    the code path, hashable; raise :class:`~bcg_diffusion.core.tree.UnsupportedValue` with a reason to run
    the call eagerly), then for a capture ``checkpoint()`` once and ``rewind(token)`` before every
    warm-up and before the capture, ``persist()`` at the end of every run it captures or warms up
    (inside the capture: it must only copy into buffers that a warm-up already allocated), and
    ``record()`` after the capture; after a replay, ``apply(record)`` with that capture's record. When a
    replay's break returns another value, ``restart()`` before the breaks run again: it undoes what
    breaks changed in the state since ``key()`` (a break that changes nothing needs nothing).

    Optionally, ``managed()``: the objects whose state it carries (the read recorder of
    :mod:`bcg_diffusion.core.python_state` leaves them alone: they change at every step by design).

    Optionally, ``path_hint()`` (called after ``key()``, before a replay): a hashable that tells apart
    the calls whose breaks tend to decide alike (Cache-DiT: how many calls its contexts ran in this
    pipeline call), or None. A replay then starts in the path the last replay with the same hint took
    (:class:`PathHints`), instead of the path of the signature's last call. A wrong hint costs a switch,
    never a wrong result: every break still checks its result against the path's.
    """

    def key(self) -> Hashable: ...

    def checkpoint(self) -> Any: ...

    def rewind(self, token: Any) -> None: ...

    def persist(self) -> None: ...

    def record(self) -> Any: ...

    def apply(self, record: Any) -> None: ...

    def restart(self) -> None: ...


@dataclass
class RunnerCounters:
    captures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0
    invalidations: int = 0
    capture_seconds: float = 0.0
    misses: int = 0  # calls of an uncaptured signature while capture_new is off (they ran eagerly)
    evictions: int = 0  # signatures dropped to stay within max_signatures
    hotswaps: int = 0  # LoRA weights hot-swapped in place: graphs kept
    branches: int = 0  # paths captured after the first, where a break's Python result changed
    branch_switches: int = 0  # replays that went on in another captured path than the last one
    state_checks: int = 0  # checks of the Python state the graphs read (once per pipeline call)
    state_check_seconds: float = 0.0
    state_changes: int = 0  # values found changed since their capture (their graphs were dropped)
    mismatches: int = 0  # debug="verify": calls whose replay differed from the eager forward


@dataclass
class SignatureRecord:
    """What one signature of one runner cost and did; ``stats()`` reports these."""

    component: str
    signature: str
    status: str  # "captured", "debug" or "failed"
    state: str = ""  # what keys the signature besides the arguments (attention backend, parallel layout...)
    reason: str | None = None
    segments: int = 0
    breaks: int = 0
    memory_bytes: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    paths: int = 0  # graphs captured for this signature: one per way its breaks' decisions went
    # Debug mode: what a capture of this signature would trip on outside the marked breaks (automatic
    # breaks, graph constants, collectives: bcg_diffusion.core.hostile), found by its recording.
    hostile_ops: list[str] | None = None
    # The eager breaks the capture made by itself (bcg_diffusion.core.auto_breaks), each "op (kind) in
    # module at file:line"; in debug mode, the ones a capture would make.
    auto_breaks: list[str] = field(default_factory=list)
    # Tensors the forward builds on the GPU from Python data, which the graph holds as constants
    # (bcg_diffusion.core.python_data): no break needed. Same format as auto_breaks.
    constants: list[str] = field(default_factory=list)
    # Python values the capture read (module attributes, parameters, submodules: bcg_diffusion.core.python_state),
    # checked once per pipeline call; a change drops the signature.
    watched: int = 0
    # How a replay runs: "graph" (CUDA), "record" (debug mode: the recorded operations, see
    # bcg_diffusion.core.recording), with the compiled regions it calls anew, or "re-run" and why.
    replayed_as: str = ""
    # Arguments (positions among the call's tensors) the forward writes into: written back after each replay.
    written_inputs: list[int] = field(default_factory=list)
    # debug="verify": where replays of this signature first differed from the eager forward.
    mismatches: list[str] = field(default_factory=list)


class _EagerReplay:
    """Debug-mode stand-in for a :class:`BreakableGraph` where a record cannot be made
    (:class:`~bcg_diffusion.core.recording.NotRecordable`): re-runs the callable on the static inputs and
    copies the result into the static outputs, exactly where a graph replay would write."""

    num_segments = 0
    num_breaks = 0

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, outputs: list[torch.Tensor], spec: Hashable):
        self.fn, self.args, self.kwargs, self.outputs, self.spec = fn, args, kwargs, outputs, spec

    def replay(self) -> None:
        leaves, spec = flatten(self.fn(*self.args, **self.kwargs))
        if spec != self.spec:
            raise BreakResultMismatch("debug replay returned a different structure than the first run")
        for static, fresh in zip(self.outputs, leaves):
            static.copy_(fresh)

    def reset(self) -> None:
        self.outputs.clear()


@dataclass
class _Path:
    """One captured way through a signature's forward: its graph, outputs and outer-state record."""

    graph: BreakableGraph | _EagerReplay  # a RecordedGraph in debug mode
    outputs: list[torch.Tensor]
    output_spec: Hashable
    outer: Any = None
    keep: list[torch.Tensor] = field(default_factory=list)  # what the graph reads and nothing else holds

    @property
    def decisions(self) -> tuple[Hashable, ...]:
        return getattr(self.graph, "path", ())


class PathHints:
    """Which captured path a replay starts in, by the outer state's hint (see :class:`OuterState`).

    Without a hint, the path of the signature's last call. With one, the path the last replay with the
    same hint took, else that last path: a static schedule that alternates compute and reuse (Cache-DiT's
    step mask) starts each call where it will end, instead of switching at every call, which re-runs the
    graph up to the decision. Remembers at most ``limit`` hints (then starts afresh)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_hint: dict[Hashable, Any] = {}

    def start(self, hint: Hashable | None, last: Any) -> Any:
        if hint is None:
            return last
        return self._by_hint.get(hint, last)

    def taken(self, hint: Hashable | None, path: Any) -> None:
        if hint is None:
            return
        if len(self._by_hint) >= self.limit and hint not in self._by_hint:
            self._by_hint.clear()
        self._by_hint[hint] = path

    def clear(self) -> None:
        self._by_hint.clear()


@dataclass
class _Entry:
    key: Hashable
    record: SignatureRecord
    static_inputs: list[torch.Tensor]
    spec: Hashable = None
    paths: list[_Path] = field(default_factory=list)
    current: _Path | None = None  # the path the last call took; None: the signature runs eagerly
    stand_ins: list[OpaqueArgument] = field(default_factory=list)  # for arguments the spec cannot hold
    hints: PathHints = field(default_factory=PathHints)
    written: list[int] | None = None  # static inputs the forward writes into (None: not known yet)

    def reset(self) -> None:
        for path in self.paths:
            path.graph.reset()
        self.paths.clear()
        self.hints.clear()
        self.current = None
        self.static_inputs = []


def _describe_state(state: tuple[Hashable, ...]) -> str:
    """The parts of a signature's extra key that are set (state key, call key, outer state, and the global
    settings that differ from the process's), for stats."""
    names = ("state", "call", "outer")
    parts = [f"{name}={value!r}" for name, value in zip(names, state[:3]) if value not in (None, ())]
    changed = settings.describe(state[3])
    if changed:
        parts.append(f"settings: {changed}")
    return "; ".join(parts)


def _state_differences(old: tuple[Hashable, ...], new: tuple[Hashable, ...]) -> list[str]:
    """What differs between two signatures' extra keys, one line each (see :func:`_describe_state`)."""
    lines = [f"component state: {a!r} -> {b!r}" for a, b in zip(old[:3], new[:3]) if a != b]
    return lines + [f"global setting {line}" for line in settings.differences(old[3], new[3])]


def _writeback_refusal(leaves: list[torch.Tensor], written: list[int]) -> str | None:
    """Why the values a forward wrote into its arguments cannot be copied back into the caller's tensors
    after a replay (None when they can): a tensor that overlaps itself (an expanded one), or one that shares
    memory with another argument, which the graph's separate static copies cannot reproduce."""
    for index in written:
        leaf = leaves[index]
        if torch._debug_has_internal_overlap(leaf) != 0:
            return f"the forward writes into argument tensor {index}, which overlaps itself (expanded)"
        pointer = leaf.untyped_storage().data_ptr()
        shared = [i for i, other in enumerate(leaves) if i != index and other.untyped_storage().data_ptr() == pointer]
        if pointer and shared:
            return f"the forward writes into argument tensor {index}, which shares memory with argument tensor {shared[0]}"
    return None


def _changed_arguments(spec: Hashable, leaves: list[torch.Tensor], args: tuple, kwargs: dict) -> str | None:
    """Why a graph cannot replay a forward that changed the structure of its own arguments (an item put
    into an input list, an attribute of an input object set), or None when it did not: eager leaves
    the caller's objects changed, while a replay would change nothing but the static copies.
    ``spec`` and ``leaves`` are the static arguments' before the runs."""
    after, after_spec = flatten((args, kwargs), [])
    if after_spec != spec or any(a is not b for a, b in zip(after, leaves)):
        found = differences(spec, after_spec)
        where = f" ({found[0]})" if found else ""
        return f"the forward changes the objects or lists it is given{where}; a replay would not"
    return None


@contextlib.contextmanager
def _pointed(stand_ins: list[OpaqueArgument], objects: list[Any]) -> Iterator[None]:
    """Point a signature's stand-ins at this call's objects for the call, and let go of them after."""
    for stand_in, target in zip(stand_ins, objects):
        stand_in.point_at(target)
    try:
        yield
    finally:
        for stand_in in stand_ins:
            stand_in.point_at(None)


def _device_type(module: torch.nn.Module | None) -> str:
    """Where ``module``'s parameters live (the first one's device type), "cpu" without any."""
    if module is not None:
        for parameter in module.parameters():
            return parameter.device.type
    return "cpu"


def _static_copy(tensor: torch.Tensor) -> torch.Tensor:
    # empty_like keeps the caller's strides when they are dense (so the captured kernels are the ones
    # eager picks) and falls back to contiguous for expanded tensors, which cannot be written into.
    return torch.empty_like(tensor).copy_(tensor)


class GraphRunner:
    """Calls ``fn`` through signature-keyed breakable CUDA graphs.

    Args:
        fn: the callable to accelerate (e.g. the original bound ``forward``).
        name: component name for stats and warnings (``"transformer"``).
        pool: the shared :class:`GraphPool`; ``None`` only in debug mode.
        lock: serialises captures and replays of every runner sharing ``pool``.
        debug: run the runner path without graphs: each signature's forward is recorded and replayed
            from its record, stale where a graph would be (:mod:`bcg_diffusion.core.recording`).
            ``"verify"``: also run the eager forward at every replay and compare; a difference warns,
            naming the first operation that differs (``stats()["signatures"][i]["mismatches"]``).
        warmup_runs, capture_error_mode, track_external_tensors: see :class:`AccelerateConfig`.
        state_key: returns extra hashable state that changes what ``fn`` computes but is not in its
            arguments (VAE tiling flags, the attention backend); it becomes part of the signature.
        call_key: ``call_key(args, kwargs)`` returns a decision about the call's *values* that changes
            which code path ``fn`` takes (a text encoder's "no token is padded"); it becomes part of
            the signature, so each path gets its own graph.
        capture_new: capture a signature seen for the first time (lazy capture). When False (serving
            after a warm-up), such a call runs eagerly, is counted in ``misses`` and logged once.
        budget: the pipeline's :class:`~bcg_diffusion.core.budget.SignatureBudget` (``max_signatures``),
            shared by its runners; None: no limit.
        consensus: a :class:`~bcg_diffusion.features.context_parallel.CaptureConsensus` when the ranks of a
            context-parallel model must keep or abandon each capture together; None otherwise.
        module: the module ``fn`` runs (names modules in the records; automatic module breaks);
            default: ``fn.__self__`` when that is a module.
        auto_breaks: let captures make eager breaks by themselves (:mod:`bcg_diffusion.core.auto_breaks`),
            and retry a failed capture once with what it taught. Off under a consensus: the ranks
            would have to learn the same breaks together.

    Thread safety: calls are serialised by ``lock``; the static buffers are shared, so two replays of
    one graph must never overlap.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        pool: GraphPool | None,
        lock: threading.RLock,
        debug: bool | str = False,
        warmup_runs: int = 2,
        capture_error_mode: str = "thread_local",
        track_external_tensors: bool = True,
        state_key: Callable[[], Hashable] | None = None,
        call_key: Callable[[tuple, dict], Hashable] | None = None,
        capture_new: bool = True,
        budget: SignatureBudget | None = None,
        consensus: Any = None,
        module: torch.nn.Module | None = None,
        auto_breaks: bool = True,
    ) -> None:
        if pool is None and not debug:
            raise ValueError("a GraphRunner needs a GraphPool unless debug=True")
        self.fn = fn
        self.name = name
        self.pool = pool
        self.lock = lock
        self.debug = bool(debug)
        self.verify = debug == "verify"
        self.warmup_runs = warmup_runs
        self.capture_error_mode = capture_error_mode
        self.track_external_tensors = track_external_tensors
        self.state_key = state_key
        self.call_key = call_key
        self.capture_new = capture_new
        self.budget = budget
        self.consensus = consensus
        owner = getattr(fn, "__self__", None)
        self.module = module if module is not None or not isinstance(owner, torch.nn.Module) else owner
        # The device type of the tensors a capture (or a debug recording) works on: what its breaks are for.
        self.device_type = pool.device.type if pool is not None else _device_type(self.module)
        self.auto_breaks = auto_breaks and consensus is None
        self._learned_ops: set[str] = set()  # ops that failed inside a capture: broken around from then on
        self._module_breaks: list[str] = []  # submodules of module run as eager breaks in every capture
        self.counters = RunnerCounters()
        self._entries: dict[Hashable, _Entry] = {}
        self._warned: set[str] = set()
        self._missed: set[Hashable] = set()
        self.closed = False
        self.bypass = 0  # > 0 inside bcg_diffusion.eager(pipe): plain calls, graphs kept
        self.suspended: str | None = None  # why every call currently runs eagerly (e.g. a cache hook)
        self.outer_state: OuterState | None = None  # set by a feature (step caching) after construction
        self._specs: set[Hashable] = set()  # argument structures captured at least once
        self._watch = StateWatch()  # the Python state the captured signatures read
        self._checked_scope: int | None = None  # the pipeline call whose state was checked last
        self._change_streaks: dict[str, int] = {}  # values found changed at consecutive checks

    # ----------------------------------------------------------------------------------------- call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self.closed
            or self.bypass
            or graphs.is_capturing()
            or (not self.debug and torch.cuda.is_current_stream_capturing())
        ):
            # Closed by restore(), bypassed by eager(pipe), or inside someone's capture (ours or the
            # user's): be a plain call.
            return self.fn(*args, **kwargs)
        if self.suspended is not None:
            return self._eager(f"suspended:{self.suspended}", self.suspended, args, kwargs)
        if torch.is_grad_enabled():
            return self._eager(
                "grad_mode", "autograd is enabled; graphs are for inference (use torch.no_grad())", args, kwargs
            )
        objects: list[Any] = []  # arguments the signature cannot hold: the graph uses them through stand-ins
        try:
            leaves, spec = flatten((args, kwargs), objects)
        except UnsupportedValue as exc:
            return self._eager(f"unsupported:{exc}", str(exc), args, kwargs)
        with self.lock:
            if len(self._watch):
                self._check_state()
            try:
                key = (spec, self._state(args, kwargs))
            except UnsupportedValue as exc:
                return self._eager(f"unsupported:{exc}", str(exc), args, kwargs)
            entry = self._entries.get(key)
            if entry is None:
                if not self.capture_new:
                    return self._miss(key, spec, args, kwargs)
                if not objects:
                    return self._capture(key, spec, leaves, args, kwargs, [])
                stand_ins = [OpaqueArgument(o) for o in objects]
                with _pointed(stand_ins, objects):
                    return self._capture(key, spec, leaves, args, kwargs, stand_ins)
            if entry.current is None:
                self.counters.eager_fallbacks += 1
                return self.fn(*args, **kwargs)
            if self.budget is not None:
                self.budget.touch(self, key)
            if not objects:
                return self._replay(entry, leaves, args, kwargs)
            with _pointed(entry.stand_ins, objects):
                return self._replay(entry, leaves, args, kwargs)

    def _state(self, args: tuple, kwargs: dict) -> tuple[Hashable, ...]:
        """What keys a signature besides its arguments: the state key, the call key, the outer state and the
        global torch settings (:mod:`bcg_diffusion.core.settings`)."""
        return (
            self.state_key() if self.state_key is not None else None,
            self.call_key(args, kwargs) if self.call_key is not None else None,
            self.outer_state.key() if self.outer_state is not None else None,
            settings.current(),
        )

    def _run(self, args: tuple, kwargs: dict) -> Any:
        """One run that a graph captures or that warms one up: the callable, then the outer state's
        persistence (captured with it)."""
        result = self.fn(*args, **kwargs)
        if self.outer_state is not None:
            self.outer_state.persist()
        return result

    def _miss(self, key: Hashable, spec: Hashable, args: tuple, kwargs: dict) -> Any:
        """A signature never captured while capture is off: run eagerly; log it the first time."""
        self.counters.misses += 1
        if key not in self._missed:
            self._missed.add(key)
            self._log_miss(key, spec, captured=False)
        return self.fn(*args, **kwargs)

    def _eager(self, warn_key: str, reason: str, args: tuple, kwargs: dict) -> Any:
        self._warn_once(warn_key, f"bcg-diffusion: {self.name} runs eagerly for this call: {reason}")
        self.counters.eager_fallbacks += 1
        return self.fn(*args, **kwargs)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, BCGWarning, stacklevel=4)

    # --------------------------------------------------------------------------------------- replay
    def _replay(self, entry: _Entry, leaves: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        for static, fresh in zip(entry.static_inputs, leaves):
            static.copy_(fresh)
        outer = self.outer_state
        before = outer.checkpoint() if self.verify and outer is not None else None
        hint_of = getattr(outer, "path_hint", None)
        hint = hint_of() if hint_of is not None else None
        path = entry.hints.start(hint, entry.current)
        for _ in range(MAX_PATHS + 1):  # each switch fixes one more decision, so this ends sooner
            try:
                path.graph.replay()
                break
            except BreakResultMismatch as exc:
                # The breaks up to this one have run, and a break may change the outer state (a cache's
                # step counter): put it back as key() found it before any of them runs again, in another
                # path, in a branch's capture or in an eager call.
                if outer is not None:
                    outer.restart()
                if exc.index is None or self.consensus is not None:
                    # Ranks of a context-parallel model must take every path together: not supported.
                    return self._give_up(entry, f"{type(exc).__name__}: {exc}", args, kwargs)
                branch = path.decisions[: exc.index] + (exc.spec,)
                found = next((p for p in entry.paths if p.decisions[: len(branch)] == branch), None)
                if found is None:
                    return self._branch(entry, branch, leaves, args, kwargs)
                self.counters.branch_switches += 1
                path = found
        else:
            return self._give_up(entry, "a break's results changed between two runs of one input", args, kwargs)
        entry.current = path
        entry.hints.taken(hint, path)
        if outer is not None:
            outer.apply(path.outer)
        self._write_back(entry, leaves)
        entry.record.replays += 1
        self.counters.replays += 1
        result = self._cloned_outputs(path)
        if self.verify:
            self._verify(entry, path, leaves, result, before)
        return result

    def _write_back(self, entry: _Entry, leaves: list[torch.Tensor]) -> None:
        """Leave the caller's tensors as eager leaves them: what the forward wrote into its static copies."""
        for index in entry.written or ():
            leaves[index].copy_(entry.static_inputs[index])

    def _restore_inputs(self, entry: _Entry, leaves: list[torch.Tensor]) -> None:
        """Give the static copies the forward writes into the call's values again, before another run."""
        for index in entry.written or ():
            entry.static_inputs[index].copy_(leaves[index])

    # -------------------------------------------------------------------------------------- verify
    def _verify(self, entry: _Entry, path: _Path, leaves: list[torch.Tensor], result: Any, before: Any) -> None:
        """debug="verify": run the eager forward on the call's inputs, from the state the replay started in,
        and compare. On a difference, find the first recorded operation that differs (a fresh recording of the
        eager forward against the replay, op by op), warn once per place, and count it."""
        outer = self.outer_state
        after = outer.checkpoint() if outer is not None else None

        def inputs() -> tuple[tuple, dict]:
            """The call's inputs in the static copies, and the outer state as the replay found it."""
            if outer is not None:
                outer.rewind(before)
            for static, fresh in zip(entry.static_inputs, leaves):
                static.copy_(fresh)
            return unflatten(entry.spec, entry.static_inputs, entry.stand_ins)

        try:
            static_args, static_kwargs = inputs()
            got, got_spec = flatten(result)
            want, want_spec = flatten(self.fn(*static_args, **static_kwargs))
            if got_spec == want_spec and all(map(same_bytes, got, want)):
                return
            where = self._first_difference(path, inputs)
        finally:
            if outer is not None:
                outer.rewind(after)
        self.counters.mismatches += 1
        entry.record.mismatches = list(dict.fromkeys([*entry.record.mismatches, where]))
        self._warn_once(
            f"mismatch:{entry.record.signature}:{where}",
            f"bcg-diffusion: {self.name}: a replay of signature {entry.record.signature} differs from the eager "
            f"forward: {where}. The graph replays a Python value (or code) that changed since its capture and "
            "that no check sees: a module-level global, a closure, a class attribute; invalidate(pipe) after such "
            "a change (docs/invalidation.md)",
        )

    def _first_difference(self, path: _Path, inputs: Callable[[], tuple[tuple, dict]]) -> str:
        """Where ``path``'s replay first differs from a recording of the eager forward on ``inputs()`` (see
        :func:`~bcg_diffusion.core.recording.first_difference`)."""
        graph = path.graph
        if not isinstance(graph, RecordedGraph):
            return "the outputs differ (this forward is re-run, not replayed from a record: no operation to name)"
        breaker = AutoBreaker(self.module, self._learned_ops, self.device_type) if self.auto_breaks else None
        static_args, static_kwargs = inputs()
        fresh, _ = record_breakable(
            lambda: self.fn(*static_args, **static_kwargs), breaker=breaker, sites=True, observe=True
        )
        try:
            inputs()
            found = first_difference(graph, fresh)
        except BreakResultMismatch as exc:
            return f"an eager break returned another value than at capture: {exc}"
        finally:
            fresh.reset()
        if found is None:
            return "the outputs differ, but every recorded operation agrees with eager's (an eager break differs)"
        return str(found)

    def _give_up(self, entry: _Entry, reason: str, args: tuple, kwargs: dict) -> Any:
        self._disable(entry, reason)
        self.counters.eager_fallbacks += 1
        return self.fn(*args, **kwargs)

    def _branch(
        self, entry: _Entry, branch: tuple[Hashable, ...], leaves: list[torch.Tensor], args: tuple, kwargs: dict
    ) -> Any:
        """Capture the path a replay's decisions chose, from the signature's static inputs."""
        if len(entry.paths) >= MAX_PATHS:
            return self._give_up(entry, f"its breaks took more than {MAX_PATHS} different paths", args, kwargs)
        self._restore_inputs(entry, leaves)
        static_args, static_kwargs = unflatten(entry.spec, entry.static_inputs, entry.stand_ins)
        started = time.perf_counter()
        path = self._capture_path(entry, static_args, static_kwargs, 1, leaves)
        if path is None:
            self.counters.eager_fallbacks += 1
            return self.fn(*args, **kwargs)
        if path.decisions[: len(branch)] != branch:
            path.graph.reset()
            return self._give_up(entry, "a break decided differently at capture than at replay", args, kwargs)
        elapsed = time.perf_counter() - started
        entry.paths.append(path)
        entry.current = path
        entry.record.paths += 1
        entry.record.capture_seconds += elapsed
        self.counters.branches += 1
        self.counters.capture_seconds += elapsed
        self._write_back(entry, leaves)
        logger.info(
            "%s: captured path %d of %s in %.3f s", self.name, len(entry.paths), entry.record.signature, elapsed
        )
        return self._cloned_outputs(path)

    @staticmethod
    def _cloned_outputs(path: _Path) -> Any:
        return unflatten(path.output_spec, [leaf.clone() for leaf in path.outputs])

    # -------------------------------------------------------------------------------------- capture
    def _capture(
        self,
        key: Hashable,
        spec: Hashable,
        leaves: list[torch.Tensor],
        args: tuple,
        kwargs: dict,
        stand_ins: list[OpaqueArgument],
    ) -> Any:
        record = SignatureRecord(
            component=self.name,
            signature=describe(spec),
            status="debug" if self.debug else "captured",
            state=_describe_state(key[1]),
        )
        self._log_miss(key, spec)
        entry = _Entry(key=key, record=record, static_inputs=[], spec=spec, stand_ins=stand_ins)
        self._entries[key] = entry
        if not self.debug:
            misplaced = sorted({str(leaf.device) for leaf in leaves if leaf.device != self.pool.device})
            if misplaced:
                self._disable(entry, f"inputs on {misplaced}, graphs live on {self.pool.device}")
                self.counters.eager_fallbacks += 1
                return self.fn(*args, **kwargs)

        started = time.perf_counter()
        entry.static_inputs = [_static_copy(leaf) for leaf in leaves]
        static_args, static_kwargs = unflatten(spec, entry.static_inputs, stand_ins)
        static_spec = flatten((static_args, static_kwargs), [])[1]  # the copies' own strides may differ
        try:
            # An argument structure captured before under another outer state (a cache's next step) has
            # run its lazy initialisation already: one warm-up, for the state's buffers. Debug mode warms up
            # once: lazy initialisation is done in the first run, and CUDA's own (cuBLAS, Triton) is absent.
            warmups = 1 if self.debug or (self.outer_state is not None and spec in self._specs) else self.warmup_runs
            path = self._capture_path(entry, static_args, static_kwargs, warmups, leaves)
            if path is None:
                self.counters.eager_fallbacks += 1
                return self.fn(*args, **kwargs)
            changed = _changed_arguments(static_spec, entry.static_inputs, static_args, static_kwargs)
            if changed is not None:
                path.graph.reset()
                return self._give_up(entry, changed, args, kwargs)
            entry.paths.append(path)
            entry.current = path
            record.paths = 1
            self._specs.add(spec)
        except Exception as exc:
            # The eager callable itself failed (in a warm-up): the user's error, not ours. Forget the
            # signature so a corrected call captures normally.
            self._entries.pop(key, None)
            if not stand_ins:
                raise
            # Unless it failed on a stand-in (an argument used in a way eager breaks cannot follow):
            # the call as written then runs, and raises if the error was the call's own.
            result = self.fn(*args, **kwargs)
            self._entries[key] = entry
            kinds = ", ".join(sorted({stand_in.stands_for.__qualname__ for stand_in in stand_ins}))
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            self._disable(
                entry,
                f"the forward uses an argument the graph cannot hold ({kinds}) in a way eager breaks cannot "
                f"follow: {type(exc).__name__}: {first}",
            )
            self.counters.eager_fallbacks += 1
            return result
        except BaseException:
            self._entries.pop(key, None)
            raise
        self._write_back(entry, leaves)
        record.capture_seconds = time.perf_counter() - started
        if self.budget is not None:
            self.budget.admit(self, key)
        self.counters.captures += 1
        self.counters.capture_seconds += record.capture_seconds
        if self.debug:  # no graph was made: segments and memory would read 0
            logger.info(
                "%s: debug mode recorded %s in %.3f s (no graph; replayed as: %s)",
                self.name,
                record.signature,
                record.capture_seconds,
                record.replayed_as,
            )
        else:
            logger.info(
                "%s: captured %s in %.3f s (%d segments, %d breaks, %.1f MiB)",
                self.name,
                record.signature,
                record.capture_seconds,
                record.segments,
                record.breaks,
                record.memory_bytes / 2**20,
            )
        return self._cloned_outputs(path)

    def _log_miss(self, key: Hashable, spec: Hashable, captured: bool = True) -> None:
        """Say what is new about this signature, against the nearest one already captured."""
        if not captured:
            # Serving with capture off: a miss is slower, so it is worth more than an INFO line.
            logger.warning(
                "%s: signature %s was not warmed up; it runs eagerly (capture of new signatures is off)",
                self.name,
                describe(spec),
            )
        if not self._entries or not logger.isEnabledFor(logging.INFO):
            return
        candidates = []
        for other_spec, other_state in self._entries:
            candidates.append(differences(other_spec, spec) + _state_differences(other_state, key[1]))
        # Specs are of (args, kwargs): "0.2.x" is positional argument 2, "1.mask" the keyword "mask".
        renames = (
            (r"^0\.(\d+)", r"arg \1"),
            (r"^0:", "positional arguments:"),
            (r"^1:", "keyword arguments:"),
            (r"^1\.", ""),
        )
        nearest = []
        for line in min(candidates, key=len):
            for pattern, replacement in renames:
                line = re.sub(pattern, replacement, line)
            nearest.append(line)
        logger.info(
            "%s: %s; the nearest captured one differs in: %s",
            self.name,
            f"new signature #{len(self._entries) + 1}" if captured else "missed signature",
            "; ".join(nearest[:4]) + (f" (+{len(nearest) - 4} more)" if len(nearest) > 4 else ""),
        )

    def _capture_path(
        self, entry: _Entry, args: tuple, kwargs: dict, warmup_runs: int, leaves: list[torch.Tensor]
    ) -> _Path | None:
        """Warm up, then capture one path: a CUDA graph, or in debug mode a record of its operations. None (and
        the entry disabled) if the capture failed.

        With an outer state, every run starts from the state the call found (``rewind``), and at least one
        warm-up runs: it allocates the state's buffers, which the capture may not. The first warm-up notes
        the Python state the forward reads and which of its arguments it writes into; every later run starts
        from the call's values in those (``leaves``: the call's own tensors).
        """
        outer = self.outer_state
        token = outer.checkpoint() if outer is not None else None
        if outer is not None:
            warmup_runs = max(warmup_runs, 1)
        constants = PythonDataConstants(self._module_names(), self.device_type) if self.auto_breaks else None
        recorder = self._recorder()  # the first warm-up notes the Python state the forward reads
        pool = self.pool
        caller_stream = torch.cuda.current_stream(pool.device) if pool is not None else None
        stream = pool.stream if pool is not None else None  # a failed capture may move the pool (renew)
        if stream is not None:
            stream.wait_stream(caller_stream)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for index in range(warmup_runs):
                    if outer is not None:
                        outer.rewind(token)
                    self._restore_inputs(entry, leaves)
                    versions = [t._version for t in entry.static_inputs] if entry.written is None else None
                    reading = recorder.recording() if recorder is not None and index == 0 else contextlib.nullcontext()
                    with reading, constants.recording() if constants is not None else contextlib.nullcontext():
                        self._run(args, kwargs)
                    if versions is not None:
                        entry.written = [i for i, t in enumerate(entry.static_inputs) if t._version != versions[i]]
                if recorder is not None and recorder.paused:
                    self._restore_inputs(entry, leaves)
                    self._record_through_compiled(recorder, args, kwargs, token)
                if outer is not None:
                    outer.rewind(token)
                self._restore_inputs(entry, leaves)
        finally:
            if stream is not None:
                caller_stream.wait_stream(stream)
        refusal = _writeback_refusal(leaves, entry.written) if entry.written else None
        if refusal is not None:
            self._disable(entry, refusal)
            return None
        entry.record.written_inputs = list(entry.written or ())

        reserved_before = pool.reserved_bytes() if pool is not None else 0
        attempts = 2 if self.auto_breaks else 1  # a failed capture may teach one more break
        for attempt in range(attempts):
            breaker = AutoBreaker(self.module, self._learned_ops, self.device_type) if self.auto_breaks else None
            if pool is not None:
                stream = pool.stream
                stream.wait_stream(caller_stream)
            serving = constants.serving() if constants is not None else contextlib.nullcontext()
            try:
                with (
                    torch.cuda.stream(stream) if pool is not None else contextlib.nullcontext(),
                    module_breaks(self.module, self._module_breaks),
                    serving,
                ):
                    graph, result = self._capture_graph(args, kwargs, breaker)
                outputs, output_spec = flatten(result)
                break
            except NotRecordable as exc:  # debug mode only: re-run this signature's forward instead
                if outer is not None:
                    outer.rewind(token)
                self._restore_inputs(entry, leaves)
                return self._rerun_path(entry, args, kwargs, str(exc))
            except Exception as exc:  # any capture failure: fall back for this signature, say why
                if pool is not None:
                    caller_stream.wait_stream(stream)
                if outer is not None:  # the eager call that follows must start where this one did
                    outer.rewind(token)
                self._restore_inputs(entry, leaves)
                if attempt + 1 < attempts and self._learn(breaker, constants, exc, args, kwargs):
                    self._restore_inputs(entry, leaves)
                    continue
                reason = f"capture failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                self._disable(entry, reason)
                return None
        if pool is not None:
            caller_stream.wait_stream(stream)
            entry.record.memory_bytes += max(0, pool.reserved_bytes() - reserved_before)
        entry.record.segments = max(entry.record.segments, graph.num_segments)
        entry.record.breaks = max(entry.record.breaks, graph.num_breaks)
        if breaker is not None:
            self._record_auto_breaks(entry, breaker, constants)
        if isinstance(graph, RecordedGraph):
            self._record_replay(entry, graph, breaker, constants)
        else:
            entry.record.replayed_as = "graph"
        self._watch_reads(entry, recorder)
        keep = constants.kept if constants is not None else []
        return _Path(graph, outputs, output_spec, outer.record() if outer is not None else None, keep)

    def _capture_graph(self, args: tuple, kwargs: dict, breaker: AutoBreaker | None) -> tuple[BreakableGraph, Any]:
        """One capture of the forward: a breakable CUDA graph, or in debug mode a record of its operations."""
        if self.pool is None:
            return record_breakable(lambda: self._run(args, kwargs), breaker=breaker, consensus=self.consensus)
        return capture_breakable(
            lambda: self._run(args, kwargs),
            self.pool,
            capture_error_mode=self.capture_error_mode,
            track_external=self.track_external_tensors,
            consensus=self.consensus,
            breaker=breaker,
        )

    def _rerun_path(self, entry: _Entry, args: tuple, kwargs: dict, why: str) -> _Path:
        """Debug mode, where a record cannot be made: a path that re-runs the forward at every replay."""
        entry.record.replayed_as = f"re-run: {why}"
        logger.warning(
            "%s: signature %s is re-run, not replayed from a record: %s", self.name, entry.record.signature, why
        )
        outputs, output_spec = flatten(self._run(args, kwargs))
        graph = _EagerReplay(lambda *a, **k: self._run(a, k), args, kwargs, outputs, output_spec)
        outer = self.outer_state
        return _Path(graph, outputs, output_spec, outer.record() if outer is not None else None)

    def _record_replay(
        self, entry: _Entry, graph: RecordedGraph, breaker: AutoBreaker | None, constants: PythonDataConstants | None
    ) -> None:
        """Debug mode: how the record replays, and what a capture on a GPU would meet outside the marked breaks."""
        rerun = f"; {graph.rerun} compiled region(s) run anew at each replay" if graph.rerun else ""
        entry.record.replayed_as = f"record{rerun}"
        found = [str(op) for op in breaker.made] if breaker is not None else []
        found += [str(site) for site in constants.served] if constants is not None else []
        found += [str(site) for site in graph.hostile]
        entry.record.hostile_ops = list(dict.fromkeys((entry.record.hostile_ops or []) + found))

    def _module_names(self) -> dict[int, str]:
        return {id(m): name for name, m in self.module.named_modules()} if self.module is not None else {}

    # ------------------------------------------------------------------------------- Python state
    def _recorder(self) -> ReadRecorder | None:
        """A recorder of what the forward reads of ``module``'s tree (None without a module)."""
        if self.module is None:
            return None
        managed = getattr(self.outer_state, "managed", None)
        skip = {id(value) for value in managed()} if managed is not None else set()
        return ReadRecorder({id(m): (name, m) for name, m in self.module.named_modules()}, skip)

    def _record_through_compiled(self, recorder: ReadRecorder, args: tuple, kwargs: dict, token: Any) -> None:
        """One more run, from the call's outer state, in which compiled regions run their eager originals
        under ``recorder``: what they read was hidden from it (compiled code runs without its hook)."""
        if self.outer_state is not None:
            self.outer_state.rewind(token)
        with recorder.recording(through_compiled=True):
            self._run(args, kwargs)

    def _watch_reads(self, entry: _Entry, recorder: ReadRecorder | None) -> None:
        """Watch what ``entry``'s capture read; values other signatures read that have changed since
        (the capture read their new value) drop those signatures."""
        if recorder is None:
            return
        recorder.settle()
        stale = self._watch.add(entry.key, recorder.reads)
        if stale:
            self._drop_changed(stale, keep=entry.key)
            self._watch.add(entry.key, recorder.reads)
        entry.record.watched = len(recorder.reads)

    def _check_state(self) -> None:
        """Once per pipeline call (every call outside one): drop the signatures whose captures read a
        Python value that has changed since (see :mod:`bcg_diffusion.core.python_state`)."""
        scope = current_scope()
        number = scope[0] if scope is not None else None
        if number is not None and number == self._checked_scope:
            return
        self._checked_scope = number
        started = time.perf_counter()
        changed = self._watch.changes()
        if changed:
            self._drop_changed(changed)
        elif self._change_streaks:
            self._change_streaks.clear()
        self.counters.state_checks += 1
        self.counters.state_check_seconds += time.perf_counter() - started

    def _drop_changed(self, changed: list[Watched], keep: Hashable = None) -> None:
        """Forget the values in ``changed`` and drop the signatures that read any of them (but ``keep``), with
        one INFO line naming each value, old -> new, and what was dropped."""
        doomed: set[Hashable] = set()
        described = []
        for item in changed:
            doomed |= self._watch.readers(item)
            described.append(item.describe_change())
            self._watch.forget_item(item)
        doomed.discard(keep)
        for key in doomed:
            self._remove(key)
        self.counters.state_changes += len(changed)
        shown = "; ".join(described[:8]) + (f"; and {len(described) - 8} more" if len(described) > 8 else "")
        one = len(described) == 1
        dropped = (
            f"; dropping {len(doomed)} captured signature(s) that read {'it' if one else 'them'}" if doomed else ""
        )
        logger.info("%s: %s since %s capture%s", self.name, shown, "its" if one else "their", dropped)
        for item in changed:
            streak = self._change_streaks[item.where] = self._change_streaks.get(item.where, 0) + 1
            if streak == 3:
                self._warn_once(
                    f"state-streak:{item.where}",
                    f"bcg-diffusion: {self.name}: {item.where} changed before each of the last 3 calls, and each "
                    "change captures its graphs again (slower than eager). If the model changes it itself, "
                    "run this component eagerly (accelerate(pipe, components=...) without it) or restore(pipe)",
                )

    def _learn(
        self,
        breaker: AutoBreaker | None,
        constants: PythonDataConstants | None,
        exc: Exception,
        args: tuple,
        kwargs: dict,
    ) -> bool:
        """After a failed capture: find a break that may let the next one succeed. True if one was found.

        Only for CUDA's refusals inside a capture (not out-of-memory, nor the model's own errors). The
        operation that raised while recorded comes first; else an eager run under the hostile-op finder
        names the modules that build GPU tensors from Python data (auto_breaks' docstring), except
        those whose every such tensor was held as a constant (``constants``).
        """
        if not refused_by_capture(exc):
            return False
        if breaker is not None and breaker.failed_op is not None and breaker.failed_op not in self._learned_ops:
            self._learned_ops.add(breaker.failed_op)
            logger.info("%s: capture failed in %s (%s); breaking around it", self.name, breaker.failed_op, exc)
            return True
        if self.module is None:
            return False
        token = self.outer_state.checkpoint() if self.outer_state is not None else None
        with HostileOpFinder(self.module) as finder:
            self._run(args, kwargs)
        if self.outer_state is not None:
            self.outer_state.rewind(token)
        held = set()
        if constants is not None:
            held = {site.module for site in constants.served} - {site.module for site in constants.unstable}
            for site in constants.unstable:
                logger.info("%s: %s changed between warm-ups and capture: not a constant", self.name, site)
        new = [path for path in modules_to_break(finder.found) if path not in self._module_breaks and path not in held]
        if new:
            self._module_breaks.extend(new)
            logger.info("%s: capture failed (%s); running %s as eager breaks", self.name, exc, ", ".join(new))
        return bool(new)

    def _record_auto_breaks(self, entry: _Entry, breaker: AutoBreaker, constants: PythonDataConstants | None) -> None:
        made = [str(op) for op in breaker.made]
        made += [f"module {path} (builds GPU tensors from Python data)" for path in self._module_breaks]
        entry.record.auto_breaks = list(dict.fromkeys(entry.record.auto_breaks + made))  # every path's
        held = [str(site) for site in constants.served] if constants is not None else []
        entry.record.constants = list(dict.fromkeys(entry.record.constants + held))
        for what, sites in (("automatic eager break", made), ("graph constant", held)):
            for site in sites:
                if site not in self._warned:
                    self._warned.add(site)
                    logger.info("%s: %s: %s", self.name, what, site)

    def _disable(self, entry: _Entry, reason: str) -> None:
        if self.budget is not None:  # a disabled signature holds no graph: nothing left to evict
            self.budget.forget(self, entry.key)
        self._watch.forget(entry.key)  # it runs eagerly: nothing of it can go stale
        entry.reset()
        entry.record.status = "failed"
        entry.record.reason = reason
        self._warn_once(
            f"disabled:{entry.record.signature}",
            f"bcg-diffusion: {self.name} runs eagerly for signature {entry.record.signature}: {reason}",
        )
        logger.warning("%s: signature %s runs eagerly: %s", self.name, entry.record.signature, reason)

    # ---------------------------------------------------------------------------------------- admin
    def records(self) -> list[SignatureRecord]:
        return [entry.record for entry in self._entries.values()]

    def evict(self, key: Hashable) -> None:
        """Drop one captured signature to make room (called by the budget, under the lock); a later
        call of it captures again."""
        entry = self._remove(key)  # the budget has already taken it out of its order
        if entry is not None:
            self.counters.evictions += 1
            logger.info("%s: evicted %s", self.name, entry.record.signature)

    def _remove(self, key: Hashable) -> _Entry | None:
        """Forget one signature and free its graphs (the caller holds the lock)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            if self.budget is not None:
                self.budget.forget(self, key)
            entry.reset()
        self._watch.forget(key)
        return entry

    def invalidate(self, reason: str) -> None:
        """Drop every graph: they bake in weight addresses and Python values that ``reason`` changed.
        The next call of each signature captures again (failed signatures get another try)."""
        with self.lock:
            if self._entries:
                logger.info("%s: dropping %d captured signature(s): %s", self.name, len(self._entries), reason)
            self._free_entries()
            self.counters.invalidations += 1

    def outer_keys(self) -> list[Hashable]:
        """The outer-state keys (see :class:`OuterState`) of the captured signatures."""
        with self.lock:
            return [key[1][2] for key in self._entries] if self.outer_state is not None else []

    def drop(self, outer_key: Callable[[Hashable], bool], reason: str) -> None:
        """Drop the signatures whose outer-state key (see :class:`OuterState`) ``outer_key`` accepts:
        what they bake in is gone for good. Other signatures keep their graphs."""
        with self.lock:
            doomed = [key for key in self._entries if outer_key(key[1][2])]
            for key in doomed:
                self._remove(key)
            if doomed:
                logger.info("%s: dropped %d captured signature(s): %s", self.name, len(doomed), reason)

    def hotswapped(self) -> None:
        """New weights were copied into the tensors the graphs read (a LoRA hot swap): graphs stay valid.
        In fast mode the compiled blocks' guards decide for themselves (tensor values are not guarded)."""
        with self.lock:
            self.counters.hotswaps += 1
            logger.info(
                "%s: weights hot-swapped in place; %d captured signature(s) kept", self.name, len(self._entries)
            )

    def close(self) -> None:
        """Free every graph and buffer this runner holds; later calls go straight to ``fn``."""
        with self.lock:
            self.closed = True
            self._free_entries()

    def _free_entries(self) -> None:
        if self.budget is not None:
            self.budget.forget(self)
        for entry in self._entries.values():
            entry.reset()
        self._entries.clear()
        self._specs.clear()
        self._watch.clear()
