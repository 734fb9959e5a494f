"""A CUDA graph's behaviour without a GPU: record a forward's operations once, replay them as recorded.

A CUDA graph replays the kernels its capture launched, on the memory they used, with every Python value
the forward read at capture baked in. Debug mode (``accelerate(pipe, debug=True)``) runs where there is
no GPU, yet it must go stale exactly where a graph would, or a test on the CPU cannot see what a GPU
would get wrong. :func:`record_breakable` is :func:`~bcg_diffusion.core.graphs.capture_breakable` for
any device: a dispatch mode records every ATen operation of each segment (the operation, its Python
arguments, which earlier operation made each tensor it reads), and :meth:`RecordedSegment.replay` runs
those operations again, and nothing else:

* Python values are baked in as in a graph: ``out + 0.05 * self.shift`` replays ``mul(out, 0.25)``
  however ``shift`` changed since; a branch taken on a Python value is replayed as taken;
* a tensor the forward builds from Python data (``torch.tensor([...])``) is a constant, whose value is
  written again at every replay (what :mod:`.python_data` does on a GPU);
* memory behaves as in a graph: every tensor made at capture that anything outside the record still
  holds afterwards (an output, a module attribute, a break's argument, a view of either) is written at
  every replay, where it is; tensors read from outside (weights, static inputs, buffers) are read where
  they are, and written there by in-place operations; the rest are temporaries, dropped after their
  last use;
* eager breaks run as on a GPU: the segment before them replays, then the break, with the same argument
  objects, and its tensor results are copied into the buffers the next segment reads. Host reads that a
  capture on a GPU could not hold (``.item()``, ``if tensor:``, ``.tolist()``, ``.numpy()``, data-dependent
  shapes) become automatic breaks here too, as if the model's tensors lived on a GPU.

What a record cannot hold, it calls again: a compiled region (inductor's code is not made of dispatched
operations) runs anew at every replay, so what it reads of Python is not frozen; the record counts them
(:attr:`RecordedGraph.rerun`). An operation whose result is a tensor subclass raises
:class:`NotRecordable`; the runner then re-runs that signature's forward, with the reason in ``stats()``.

For the verifying debug mode, :func:`first_difference` replays a record beside a fresh recording of the
eager forward and names the first operation whose result differs, with its segment and source line.

>>> graph, result = record_breakable(lambda: model(static_x))         # doctest: +SKIP
>>> static_x.copy_(new_x); graph.replay()                             # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import graphs
from .auto_breaks import BREAK_KINDS
from .hostile import HostileOp, classify, user_frame
from .tree import flatten, unflatten

__all__ = [
    "Difference",
    "NotRecordable",
    "RecordedGraph",
    "RecordedSegment",
    "first_difference",
    "record_breakable",
    "same_bytes",
]

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_CLONE = torch.ops.aten.clone.default
# Tensor methods that read a tensor's values on the host with no dispatched operation on the CPU; on a GPU
# each starts with a copy to the host, which a capture cannot hold.
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_CONTAINERS = (list, tuple, dict)


def _references(items: list[Any], index: int) -> int:
    return sys.getrefcount(items[index])


# The references to an object held by one list and by getrefcount's argument: a tensor of a record with
# no more than these is held by nothing but the record.
_ONLY_OURS = _references([object()], 0)


class NotRecordable(RuntimeError):
    """A forward did something a record cannot replay (a tensor subclass as an operation's result); the
    runner re-runs such a signature's forward instead, and says why."""


@dataclass
class _Op:
    """One recorded operation: ``call`` (an ATen operation or a compiled region) on ``args`` and ``kwargs``,
    with the tensors at ``slots`` (``(where, slot)``: an argument's index, or ``(index, key)`` of a keyword)
    taken from earlier operations; ``outputs`` pairs each new tensor's position among the results with its
    slot, and ``frees`` lists the temporaries it reads for the last time. Arguments nested in containers
    (``cat``'s list) go through ``spec``, the pytree of ``(args, kwargs)`` whose leaves ``args`` then holds.

    A ``constant`` is the value of a tensor built from Python data as it was built: the replay writes it
    back into ``args[0]`` instead of calling anything."""

    call: Callable[..., Any]
    args: list[Any]
    kwargs: dict[str, Any]
    slots: list[tuple[Any, int]]
    spec: Any = None
    outputs: list[tuple[int, int]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    constant: torch.Tensor | None = None
    site: str = ""

    @property
    def name(self) -> str:
        if self.constant is not None:
            return "tensor from Python data"
        return str(self.call) if isinstance(self.call, torch._ops.OpOverload) else "compiled region"

    def run(self, values: list[Any]) -> list[Any]:
        """Call the operation with this replay's tensors; returns its results, flattened."""
        args, kwargs = self.args, self.kwargs
        if self.slots:
            args = list(args)
            if self.spec is None:
                kwargs = dict(kwargs)
                for where, slot in self.slots:
                    if isinstance(where, int):
                        args[where] = values[slot]
                    else:
                        kwargs[where[1]] = values[slot]
            else:
                for where, slot in self.slots:
                    args[where] = values[slot]
        if self.spec is not None:
            args, kwargs = tree_unflatten(args, self.spec)
        return _results(self.call(*args, **kwargs))


def _results(result: Any) -> list[Any]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in result):
        return list(result)
    return tree_flatten(result)[0]


class _Memory:
    """What one record's segments share across a replay: the kept tensors (written where they are), and the
    temporaries, set while a replay runs and dropped after their last use."""

    def __init__(self, size: int, kept: dict[int, torch.Tensor]) -> None:
        self.size = size
        self.kept = kept
        self.values: list[Any] = []

    def reset(self) -> None:
        self.values = [None] * self.size
        for slot, tensor in self.kept.items():
            self.values[slot] = tensor


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


class RecordedSegment:
    """The operations of one segment, replayed in order. It stands where a ``torch.cuda.CUDAGraph`` would
    in a :class:`~bcg_diffusion.core.graphs.BreakableGraph` (``replay()``, ``reset()``).

    ``observer``, when set, is called with each operation and its results (for :func:`first_difference`).
    """

    def __init__(self, ops: list[_Op], memory: _Memory, first: bool, inference: bool) -> None:
        self.ops = ops
        self.memory = memory
        self.first = first  # the graph's first segment starts each replay afresh
        self.inference = inference
        self.observer: Callable[[_Op, list[Any]], None] | None = None

    def replay(self) -> None:
        memory = self.memory
        if self.first:
            memory.reset()
        values, kept, observer = memory.values, memory.kept, self.observer
        # A graph runs its kernels whatever autocast says now: the recorded operations are autocast's already.
        with _NoAutocast(), torch.inference_mode() if self.inference else contextlib.nullcontext():
            for op in self.ops:
                if op.constant is not None:
                    target = op.args[0]
                    target.copy_(op.constant)
                    results = [target]
                else:
                    results = op.run(values)
                    for position, slot in op.outputs:
                        fresh = results[position]
                        target = kept.get(slot)
                        if target is None:
                            values[slot] = fresh
                        elif not _same_memory(target, fresh):
                            target.copy_(fresh)
                if observer is not None:
                    observer(op, results)
                for slot in op.frees:
                    values[slot] = None

    def reset(self) -> None:
        self.ops = []
        self.memory.kept = {}
        self.memory.values = []


class _NoAutocast:
    """Autocast off for every device type while a record replays, where it is on."""

    def __enter__(self) -> None:
        self.contexts = [
            torch.autocast(device, enabled=False) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
        ]
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc)


@dataclass
class RecordedGraph(graphs.BreakableGraph):
    """A :class:`~bcg_diffusion.core.graphs.BreakableGraph` whose segments are :class:`RecordedSegment`.

    ``rerun`` counts the compiled regions its replays call again (what a record cannot hold); ``hostile``
    lists the operations a capture on a GPU would have met that no break handles (collectives);
    ``observed`` holds each operation and a copy of its results, in order, when recorded with ``observe``.
    """

    rerun: int = 0
    hostile: list[HostileOp] = field(default_factory=list)
    observed: list[tuple[_Op, list[Any]]] | None = None

    @property
    def segments(self) -> list[RecordedSegment]:
        return [step.graph for step in self.steps if isinstance(step, graphs._GraphStep)]


class _Recorder(TorchDispatchMode):
    """The dispatch mode of a recording: every operation goes to :class:`_BreakableRecording`."""

    pauses_for_compiled_code = True  # graphs.call_untracked takes it off the stack around compiled regions

    def __init__(self, recording: _BreakableRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        recording = self.recording
        if not recording.active:
            return func(*args, **kwargs)
        breaker = recording.breaker
        if breaker is not None:
            kind = breaker.wants(func, args, kwargs)
            if kind is not None:
                return breaker.run(recording, func, args, kwargs, kind)
        else:
            kind = classify(func, args, kwargs, ran=False)
            if kind in BREAK_KINDS:
                recording.refuse(HostileOp(str(func), kind, "", user_frame()))
        if func is _LIFT_FRESH:
            return recording.constant(func, args, kwargs)
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            recording.note_hostile(HostileOp(str(func), "collective", "", user_frame()))
        return recording.operation(func, args, kwargs)


class _HostReads(TorchFunctionMode):
    """The function mode of a recording: ``.tolist()``, ``.numpy()`` and ``np.asarray(tensor)`` read a tensor's
    memory with no dispatched operation on the CPU, where on a GPU they copy to the host first, which a
    capture must break around. Here they break the same way: a break copies the tensor, whose values then
    join the break's result, and the method reads the copy."""

    pauses_for_compiled_code = True

    def __init__(self, recording: _BreakableRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        recording = self.recording
        if func in _HOST_READS and recording.active and args and isinstance(args[0], torch.Tensor):
            breaker = recording.breaker
            if breaker is None:
                recording.refuse(HostileOp(f"Tensor.{func.__name__}", "host sync", "", user_frame()))
            copy = breaker.run(recording, _CLONE, (args[0],), {}, "host sync")
            return func(copy, *args[1:], **kwargs)
        return func(*args, **kwargs)


class _BreakableRecording:
    """State of one recording in progress. Set as the active capture (``graphs._ACTIVE``), so that eager
    breaks, automatic breaks and compiled regions reach it as they reach a CUDA capture. Created and
    driven by :func:`record_breakable` only."""

    def __init__(self, breaker: Any, consensus: Any, sites: bool, observe: bool) -> None:
        self.breaker = breaker
        self.consensus = consensus
        self.sites = sites
        self.observed: list[tuple[_Op, list[Any]]] | None = [] if observe else None
        self.active = False
        self.tensors: list[torch.Tensor] = []  # every tensor the recorded operations made, by slot
        self._slot_of: dict[int, int] = {}  # id -> slot; the tensors above are held, so ids stay theirs
        self.ops: list[_Op] = []
        self.steps: list[Any] = []  # lists of operations (segments) and eager steps, in order
        self.rerun = 0
        self.hostile: list[HostileOp] = []
        self.inference = torch.is_inference_mode_enabled()

    # ----------------------------------------------------------------------------------- operations
    def _op(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> _Op:
        slot_of = self._slot_of
        site = user_frame() if self.sites else ""
        nested = any(isinstance(a, _CONTAINERS) for a in args) or any(
            isinstance(v, _CONTAINERS) for v in kwargs.values()
        )
        if nested:
            leaves, spec = tree_flatten((args, kwargs))
            slots = []
            for index, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and (slot := slot_of.get(id(leaf))) is not None:
                    slots.append((index, slot))
                    leaves[index] = None  # filled in at replay: the record holds its own tensors once
            return _Op(call, leaves, {}, slots, spec=spec, site=site)
        args, kwargs, slots = list(args), dict(kwargs), []
        for index, value in enumerate(args):
            if isinstance(value, torch.Tensor) and (slot := slot_of.get(id(value))) is not None:
                slots.append((index, slot))
                args[index] = None
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and (slot := slot_of.get(id(value))) is not None:
                slots.append(((None, key), slot))
                kwargs[key] = None
        return _Op(call, args, kwargs, slots, site=site)

    def _note(self, op: _Op, result: Any) -> None:
        """Give the tensors ``op`` made slots of their own, and add it to the segment."""
        results = _results(result)
        given = {id(v) for v in (*op.args, *op.kwargs.values()) if isinstance(v, torch.Tensor)}
        for position, leaf in enumerate(results):
            if not isinstance(leaf, torch.Tensor) or id(leaf) in self._slot_of or id(leaf) in given:
                continue  # not a tensor, or one it was given (in place, out=, an alias)
            if is_traceable_wrapper_subclass(leaf):
                raise NotRecordable(f"{op.name} returned a {type(leaf).__qualname__}, which a record cannot replay")
            self._slot_of[id(leaf)] = len(self.tensors)
            op.outputs.append((position, len(self.tensors)))
            self.tensors.append(leaf)
        if self.observed is not None:
            self.observed.append((op, [t.clone() if isinstance(t, torch.Tensor) else t for t in results]))
        self.ops.append(op)

    def operation(self, func: Any, args: tuple, kwargs: dict) -> Any:
        op = self._op(func, args, kwargs)
        result = func(*args, **kwargs)
        self._note(op, result)
        return result

    def constant(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``torch.tensor(data)``'s lift to a tensor of its own: the value is written back at every replay, as
        a graph constant's is (the forward may change the tensor in place after building it)."""
        result = func(*args, **kwargs)
        op = _Op(func, [result], {}, [], constant=result.clone(), site=user_frame() if self.sites else "")
        if self.observed is not None:
            self.observed.append((op, [op.constant.clone()]))
        self.ops.append(op)
        return result

    def call_compiled(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A compiled region: recorded as one call, which every replay makes again."""
        if not self.active:
            return fn(*args, **kwargs)
        op = self._op(fn, args, kwargs)
        with self.paused():
            result = fn(*args, **kwargs)
        self._note(op, result)
        self.rerun += 1
        return result

    def refuse(self, site: HostileOp) -> None:
        """What a CUDA capture does, without automatic breaks, at an operation it cannot hold."""
        raise RuntimeError(
            f"operation not permitted when stream is capturing (debug recording, automatic breaks off): {site}"
        )

    def note_hostile(self, site: HostileOp) -> None:
        if site not in self.hostile:
            self.hostile.append(site)

    # ------------------------------------------------------------------------------------- segments
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Code run inside (a break, a compiled region) runs as it is, unrecorded and off the mode stack."""
        active, self.active = self.active, False
        try:
            if isinstance(_get_current_dispatch_mode(), _Recorder):
                with _pop_mode_temporarily():
                    yield
            else:
                yield
        finally:
            self.active = active

    def end_segment(self) -> None:
        if self.ops:
            self.steps.append(self.ops)
        self.ops = []

    def agree(self) -> None:
        if self.consensus is not None and not self.consensus.vote(True):
            raise graphs.PeerCaptureFailed("another rank's capture of this signature failed")

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """An eager break: as :meth:`graphs._BreakableCapture.run_break`, the segment so far ends, ``fn`` runs,
        its tensor results are cloned into bridges that the next segment reads, and replays call it again."""
        self.end_segment()
        token = graphs._ACTIVE.set(None)  # nested breaks are plain calls inside this one
        try:
            with self.paused():
                self.agree()  # a collective of ours, between segments: not the forward's
                result = fn(*args, **kwargs)
                leaves, spec = flatten(result)
                bridges = [leaf.clone() for leaf in leaves]
        finally:
            graphs._ACTIVE.reset(token)
        self.steps.append(graphs._EagerStep(fn, args, kwargs, spec, bridges))
        return unflatten(spec, bridges)

    # ------------------------------------------------------------------------------------- the record
    def finish(self) -> RecordedGraph:
        """The record as a graph. Call it while the caller still holds the forward's result: what the result
        holds is kept (written where it is at every replay)."""
        self.end_segment()
        kept = self._kept()
        memory = _Memory(len(self.tensors), {slot: self.tensors[slot] for slot in kept})
        _plan_frees([s for s in self.steps if isinstance(s, list)], kept)
        self.tensors, self._slot_of = [], {}
        steps: list[Any] = []
        for step in self.steps:
            if isinstance(step, list):
                step = graphs._GraphStep(RecordedSegment(step, memory, not steps, self.inference))
            elif not steps:  # a break first: an empty segment starts each replay afresh
                steps.append(graphs._GraphStep(RecordedSegment([], memory, True, self.inference)))
            steps.append(step)
        return RecordedGraph(steps, rerun=self.rerun, hostile=self.hostile, observed=self.observed)

    def _kept(self) -> set[int]:
        """The slots whose tensors something besides the record holds (an output, an attribute, a break's
        argument), and every slot sharing memory with one of those (its views, its base)."""
        tensors = self.tensors
        held = {slot for slot in range(len(tensors)) if _references(tensors, slot) > _ONLY_OURS}
        by_storage: dict[int, list[int]] = {}
        for slot, tensor in enumerate(tensors):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer:
                by_storage.setdefault(pointer, []).append(slot)
        kept = set(held)
        for slots in by_storage.values():
            if not held.isdisjoint(slots):
                kept.update(slots)
        return kept


def _plan_frees(segments: list[list[_Op]], kept: set[int]) -> None:
    """Give each operation the temporaries it is the last to touch, so that a replay holds no more memory
    than eager does."""
    last: dict[int, _Op] = {}
    for ops in segments:
        for op in ops:
            for _, slot in op.slots:
                last[slot] = op
            for _, slot in op.outputs:
                last[slot] = op
    for slot, op in last.items():
        if slot not in kept:
            op.frees.append(slot)


def record_breakable(
    fn: Callable[[], Any],
    *,
    breaker: Any = None,
    consensus: Any = None,
    sites: bool = False,
    observe: bool = False,
) -> tuple[RecordedGraph, Any]:
    """Record ``fn()`` as a :class:`RecordedGraph` and return it with ``fn``'s (real) result.

    The counterpart of :func:`~bcg_diffusion.core.graphs.capture_breakable` for any device (see the module
    docstring). ``breaker`` (an :class:`~bcg_diffusion.core.auto_breaks.AutoBreaker` for the tensors'
    device type) makes host reads automatic breaks; without one they raise as a CUDA capture would.
    ``consensus``: as for a capture. ``sites``: note each operation's source line; ``observe``: keep a
    copy of every operation's results, in order (both for :func:`first_difference`).

    Raises whatever ``fn`` raised, :class:`NotRecordable` for what a record cannot replay, and RuntimeError
    when a capture or recording is already active in this context.
    """
    if graphs._ACTIVE.get() is not None:
        raise RuntimeError("record_breakable cannot nest: a breakable capture is already active in this context")
    recording = _BreakableRecording(breaker, consensus, sites, observe)
    token = graphs._ACTIVE.set(recording)
    try:
        with _Recorder(recording), _HostReads(recording):
            recording.active = True
            try:
                result = fn()
            finally:
                recording.active = False
        recording.agree()
        graph = recording.finish()
    except BaseException as exc:
        if consensus is not None and isinstance(exc, Exception) and not isinstance(exc, graphs.PeerCaptureFailed):
            graphs._vote_failure(consensus, exc)
        raise
    finally:
        graphs._ACTIVE.reset(token)
    return graph, result


# ------------------------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class Difference:
    """Where a replay first parts from eager: the segment (0-based, among the graph's segments), the
    operation's position in it, what it is, where the eager forward ran it, and how they differ."""

    segment: int
    index: int
    op: str
    where: str
    how: str

    def __str__(self) -> str:
        return f"segment {self.segment}, operation {self.index} ({self.op}) at {self.where or '?'}: {self.how}"


class _Observer:
    """Notes each operation one segment replays, with a copy of its results, in ``seen``."""

    def __init__(self, seen: list[tuple[int, int, _Op, list[Any]]], segment: int) -> None:
        self.seen, self.segment, self.count = seen, segment, 0

    def __call__(self, op: _Op, results: list[Any]) -> None:
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in results]
        self.seen.append((self.segment, self.count, op, copies))
        self.count += 1


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two results are the same: tensors of one dtype and shape with the same bytes (NaN equal to
    itself), or equal Python values of one type."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _shapes(values: list[Any]) -> str:
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{'x'.join(map(str, t.shape))}]"
        for t in values
        if isinstance(t, torch.Tensor)
    )


def first_difference(graph: RecordedGraph, fresh: RecordedGraph) -> Difference | None:
    """Replay ``graph`` on its inputs as they are now and compare it, operation by operation, with ``fresh``:
    a recording (``observe=True, sites=True``) of the eager forward on the same inputs. Returns the first
    operation whose results differ, or where the eager forward ran another operation (it took another
    path), or None when every operation agrees. The replay writes ``graph``'s outputs, as any replay does.
    A break whose result changed raises :class:`~bcg_diffusion.core.graphs.BreakResultMismatch`."""
    seen: list[tuple[int, int, _Op, list[Any]]] = []
    segments = graph.segments
    for number, segment in enumerate(segments):
        segment.observer = _Observer(seen, number)
    try:
        graph.replay()
    finally:
        for segment in segments:
            segment.observer = None
    expected = fresh.observed or []
    for position, (number, index, op, results) in enumerate(seen):
        if position >= len(expected):
            return Difference(number, index, op.name, op.site, "the eager forward ran no such operation")
        eager_op, eager_results = expected[position]
        if eager_op.name != op.name:
            return Difference(number, index, op.name, eager_op.site, f"the eager forward ran {eager_op.name} here")
        if len(results) != len(eager_results) or not all(map(same_bytes, results, eager_results)):
            how = f"its result ({_shapes(results)}) differs from eager's"
            return Difference(number, index, op.name, eager_op.site, how)
    if len(expected) > len(seen):
        eager_op = expected[len(seen)][0]
        how = f"the eager forward ran {eager_op.name} after the replay's last operation"
        return Difference(seen[-1][0] if seen else 0, len(seen), eager_op.name, eager_op.site, how)
    return None
