"""Breakable CUDA graphs: capture a function as graph segments separated by eager breaks.

A plain CUDA graph must capture a whole function. Real forwards hold operations that cannot be
captured (host syncs such as ``.item()``, copies from host memory, data-dependent shapes,
collectives). Mark such a function with :func:`eager_break`; :func:`capture_breakable` then records

    graph segment, eager step, graph segment, ..., graph segment

and :meth:`BreakableGraph.replay` replays the segments and re-runs the eager steps between them.
With a ``breaker`` (:mod:`bcg_diffusion.core.auto_breaks`), the capture also makes each single operation
it could not hold an eager step of its own, unmarked.

Contract of an eager break, during capture:

* the segment before it ends, is instantiated and replayed at once, so the break sees real data
  (capture alone executes nothing), then the break runs eagerly, then the next segment begins;
* its tensor arguments are held strongly for the life of the graph; on replay it is called again
  with the same argument objects, whose contents the previous segment has just rewritten;
* it may write into its arguments, and it may **return tensors**: a returned tensor is cloned
  into a buffer the graph owns, the following segments read that buffer, and each replay copies the
  fresh result into it. Returned Python values (ints, bools...) are frozen into the later segments,
  so a replay whose break returns a different value raises :class:`BreakResultMismatch` instead of
  silently replaying the wrong code path. The exception names the break and what it returned, so
  the caller can replay or capture the graph of that other path (a *branch*: the runner does, see
  :mod:`bcg_diffusion.core.runner`); :attr:`BreakableGraph.path` says which way every break went;
* it may run more than once per call: a replay that takes another branch starts that branch's
  graph from the beginning, which runs the breaks before the branch point again. A break must give
  the same result for the same inputs and change nothing a second run would see (host syncs,
  copies and Python decisions do; a break that counts its calls does not).

Memory: every segment and every capture of a :class:`GraphPool` allocates from one CUDA graph
memory pool. A pool block freed during capture A may be reused by capture B, which is safe only for
memory A rewrites before reading on each replay. Everything a graph reads across replays is
therefore held strongly: static inputs and outputs (by the caller), break arguments and results,
and every tensor created *outside* the capture that a captured kernel reads (weights, lazily built
RoPE tables kept in ``lru_cache``...), found by a dispatch mode that watches the capture.

Why our own module: the ``breakable-cuda-graphs`` package on PyPI is close, but it holds break
inputs by non-owning aliases, forbids breaks that return tensors, and synchronizes around every
segment; we need owned bridges, tensor-returning breaks and segment boundaries with no sync.

>>> pool = GraphPool(torch.device("cuda"))                       # doctest: +SKIP
>>> @eager_break
... def host_scale(x):
...     return x * float(x.abs().max().item())                   # a host sync
>>> def forward(x):
...     return host_scale(x.sin()).cos()
>>> static_x = torch.randn(8, device="cuda")                     # doctest: +SKIP
>>> graph, static_out = capture_breakable(lambda: forward(static_x), pool)  # doctest: +SKIP
>>> static_x.copy_(torch.randn(8, device="cuda")); graph.replay()            # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from . import python_state
from .tree import flatten, unflatten

__all__ = [
    "BreakResultMismatch",
    "BreakableGraph",
    "GraphPool",
    "PeerCaptureFailed",
    "call_untracked",
    "capture_breakable",
    "eager_break",
    "is_capturing",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# The capture in progress in this thread/context, or None. Breaks consult it on every call.
_ACTIVE: contextvars.ContextVar[_BreakableCapture | None] = contextvars.ContextVar("bcg_active_capture", default=None)

_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"

# For bcg_diffusion.core.hostile's finder: how many are active (one list item, so the check is one read),
# and whether the code running now is inside an eager break (what a break does is no capture's problem).
_FINDERS = [0]
_IN_BREAK: contextvars.ContextVar[bool] = contextvars.ContextVar("bcg_in_break", default=False)


class PeerCaptureFailed(RuntimeError):
    """Another rank's capture of this signature failed, so this rank abandons its capture too (raised
    through a capture's ``consensus``: see :func:`capture_breakable`)."""


class BreakResultMismatch(RuntimeError):
    """A break returned, on replay, something the captured segments after it were not built for.

    ``index`` is the break's position among the graph's breaks (0-based) and ``spec`` the structure
    of what it returned this time (see :mod:`bcg_diffusion.core.tree`): together with the specs of the
    breaks before it, they name the other path of the forward that this replay must take.
    """

    def __init__(self, message: str, index: int | None = None, spec: Hashable = None) -> None:
        super().__init__(message)
        self.index = index
        self.spec = spec


def is_capturing() -> bool:
    """True while :func:`capture_breakable` is recording in this context."""
    return _ACTIVE.get() is not None


def eager_break(fn: F) -> F:
    """Mark ``fn`` as an eager break: inside :func:`capture_breakable` it ends the current graph
    segment and runs eagerly (now and on every replay); anywhere else it is a plain call.

    Use it for code that cannot be captured: host syncs (``.item()``, ``.tolist()``, ``nonzero``),
    copies from host memory, data-dependent shapes, collectives. It can decorate a function or wrap
    one in place (``module.fn = eager_break(module.fn)``); ``functools.wraps`` keeps its metadata and
    ``__wrapped__`` gives back the original. In code that ``torch.compile`` traces it is a plain call
    too: compiled code runs inside a graph whole or not at all.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        capture = _ACTIVE.get()
        if capture is None:
            if _FINDERS[0]:
                token = _IN_BREAK.set(True)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _IN_BREAK.reset(token)
            return fn(*args, **kwargs)
        return capture.run_break(fn, args, kwargs)

    wrapper.__bcg_eager_break__ = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


class GraphPool:
    """One CUDA graph memory pool and one capture stream, shared by every capture of a pipeline.

    Sharing one pool lets the VAE's and every resolution's graphs reuse the same blocks, so total
    graph memory grows far slower than the number of captures. Captures and replays that share a
    pool must not run concurrently (the runners hold a lock for that).
    """

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a GraphPool needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._retired: list[tuple[Any, torch.cuda.Stream, torch.cuda.CUDAGraph]] = []
        self._open()

    def _open(self) -> None:
        with torch.cuda.device(self.device):
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
            # The allocators (device and pinned host) free a graph pool when its last graph is reset,
            # and assert if a later capture names it again. Captures here do reset graphs (an empty
            # segment, a failed capture, a signature evicted), so an empty anchor graph, never
            # replayed, holds the pool for the GraphPool's whole life.
            self._anchor = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.stream), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_EMPTY_GRAPH_WARNING)
                self._anchor.capture_begin(pool=self.handle)
                self._anchor.capture_end()

    def renew(self) -> None:
        """Move later captures to a fresh pool and stream; graphs captured so far keep the old ones.

        Needed after a capture that CUDA itself invalidated (an uncapturable op with no break):
        torch's ``capture_end`` then raises before it tells the allocators the capture is over, the
        old pool id stays marked as recording, and every later capture naming it would fail.
        """
        logger.warning("a capture failed inside CUDA; later captures of this pipeline use a new graph pool")
        self._retired.append((self.handle, self.stream, self._anchor))
        self._open()

    def reserved_bytes(self) -> int:
        """Device memory the pool holds now (the total size of its segments).

        Read from the allocator's snapshot, not ``MemPool.snapshot()``, which routes allocations to
        the pool while it runs.
        """
        handles = {tuple(self.handle)} | {tuple(retired[0]) for retired in self._retired}
        return sum(
            int(segment["total_size"])
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) in handles
        )


@dataclass
class _GraphStep:
    graph: torch.cuda.CUDAGraph

    def run(self) -> None:
        self.graph.replay()


@dataclass
class _EagerStep:
    """One eager break: the function, the exact arguments it was captured with, and its result bridges."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result_spec: Hashable
    bridges: list[torch.Tensor]

    def run(self) -> None:
        result = self.fn(*self.args, **self.kwargs)
        leaves, spec = flatten(result)
        if spec != self.result_spec:
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            raise BreakResultMismatch(
                f"eager break {name} returned a value of a different structure, shape or Python value than at "
                "capture; the graph segments after it were captured for the old value",
                spec=spec,
            )
        for bridge, fresh in zip(self.bridges, leaves):
            if bridge.data_ptr() != fresh.data_ptr():
                bridge.copy_(fresh)


@dataclass
class BreakableGraph:
    """The ordered graph segments and eager steps of one capture, plus what they must keep alive.

    ``replay()`` runs every step on the current stream. Static inputs must have been written and the
    outputs are overwritten in place: copy them out before the next replay.
    """

    steps: list[_GraphStep | _EagerStep]
    keepalive: list[Any] = field(default_factory=list)

    @property
    def num_segments(self) -> int:
        return sum(isinstance(step, _GraphStep) for step in self.steps)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(step, _EagerStep) for step in self.steps)

    @property
    def path(self) -> tuple[Hashable, ...]:
        """The result spec of every break, in order: which way each Python decision went at capture."""
        return tuple(step.result_spec for step in self.steps if isinstance(step, _EagerStep))

    def replay(self) -> None:
        """Run every step in order. Raises :class:`BreakResultMismatch` (with ``index`` set) when a
        break returns what it did not return at capture; the steps before it have run, none after."""
        index = 0
        for step in self.steps:
            if isinstance(step, _EagerStep):
                try:
                    step.run()
                except BreakResultMismatch as exc:
                    exc.index = index
                    raise
                index += 1
            else:
                step.run()

    def reset(self) -> None:
        """Free the graphs and drop every reference they held."""
        for step in self.steps:
            if isinstance(step, _GraphStep):
                step.graph.reset()
        self.steps.clear()
        self.keepalive.clear()


class _ExternalTensorTracker(TorchDispatchMode):
    """Keeps alive the storage of every CUDA tensor a captured op reads that the capture did not create.

    Such tensors (weights, RoPE tables cached by ``lru_cache``, buffers built during warm-up) have
    their addresses baked into the graph; if their last owner dropped them, a later capture could
    reuse the memory and the graph would read garbage. It also notes every side stream an op ran on,
    so the capture can join them before a segment ends. Recording happens only while a segment is
    being captured; the cost is a Python call per op, paid at capture time only.

    .. note::
        ``torch.compile`` does not run compiled frames under a (non-infra) dispatch mode: with
        ``fullgraph=True`` it raises "non-infra torch dispatch mode present", otherwise it silently runs
        the frame eagerly (checked with torch 2.13). Compiled regions are therefore called through
        :func:`call_untracked`, which records their tensor arguments and results at the boundary and
        pauses the tracker inside.
    """

    def __init__(self, capture_stream: torch.cuda.Stream, breaker: Any = None) -> None:
        super().__init__()
        self.recording = False
        self.capture_stream = capture_stream
        self.breaker = breaker  # an auto_breaks.AutoBreaker, or None
        self.produced: set[int] = set()
        self.kept: dict[int, torch.UntypedStorage] = {}
        self.side_streams: set[torch.cuda.Stream] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if not self.recording:
            return func(*args, **kwargs)
        if self.breaker is not None:
            kind = self.breaker.wants(func, args, kwargs)
            if kind is not None:
                return self.breaker.run(_ACTIVE.get(), func, args, kwargs, kind)
        self.note_reads((args, kwargs))
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.breaker is not None:  # the runner may break around it in its next capture
                self.breaker.note_failure(func)
            raise
        self.note_produced(out)
        return out

    def note_reads(self, tree: Any) -> None:
        """Keep the storages of the CUDA tensors in ``tree`` that the capture did not create; note the stream.
        A tensor subclass that wraps others (torchao's quantized weights) is looked into: its inner
        tensors are what the kernels read, and it has no storage of its own."""
        stream_noted = False
        for value in _plain_tensors(tree):
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                if not stream_noted:
                    stream = torch.cuda.current_stream()
                    if stream != self.capture_stream:
                        self.side_streams.add(stream)
                    stream_noted = True
                storage = value.untyped_storage()
                pointer = storage.data_ptr()
                if pointer and pointer not in self.produced and pointer not in self.kept:
                    self.kept[pointer] = storage

    def note_produced(self, tree: Any) -> None:
        """Mark the CUDA tensors in ``tree`` as created by the capture (they live in its pool)."""
        for value in _plain_tensors(tree):
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                self.produced.add(value.untyped_storage().data_ptr())


def _plain_tensors(tree: Any) -> list[Any]:
    """The leaves of ``tree``, with every traceable wrapper subclass replaced by its inner tensors."""
    out: list[Any] = []
    pending = list(tree_leaves(tree))
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            pending.extend(getattr(value, name) for name in names)
        else:
            out.append(value)
    return out


@contextlib.contextmanager
def host_work() -> Iterator[None]:
    """Bookkeeping of ours during a capture that is not part of the forward (comparing a graph constant's
    values, building its host copy). A CUDA capture records no host work anyway; a debug recording
    (:mod:`bcg_diffusion.core.recording`), where the model's tensors are host tensors too, pauses for it."""
    paused = getattr(_ACTIVE.get(), "paused", None)
    if paused is None:
        yield
        return
    with paused():
        yield


def call_untracked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)``, a compiled region, as the active capture needs it called.

    ``torch.compile`` will not run compiled frames under a dispatch mode, and guards on the torch-function
    mode stack, so the modes of ours that say so (``pauses_for_compiled_code``) leave the stacks meanwhile.
    Outside a capture it is a plain call. During a CUDA capture the external-tensor tracker first keeps
    ``fn``'s tensor arguments that the capture did not create (as it would for any op), marks ``fn``'s tensor
    results as created by the capture, and is paused only in between. During a recording
    (:mod:`bcg_diffusion.core.recording`, debug mode), ``fn`` is recorded as one call that every replay makes
    again. Needs: ``fn`` reads no CUDA tensor from outside the capture except its arguments and what its
    owner holds for the graph's whole life (a module's parameters and buffers, a compiled function's
    constants).
    """
    if python_state.recording():
        # The read recorder's hook on nn.Module leaves meanwhile: dynamo traces attribute access itself.
        with python_state.paused():
            return call_untracked(fn, *args, **kwargs)
    # Torch-function modes that pause for compiled code (bcg_diffusion.core.python_data's, during warm-ups and
    # captures; a recording's) leave the stack meanwhile: torch.compile guards on that stack, and would
    # compile each block again.
    paused = []
    while getattr(mode := _get_current_function_mode(), "pauses_for_compiled_code", False):
        mode.__exit__(None, None, None)
        paused.append(mode)
    try:
        capture = _ACTIVE.get()
        if capture is not None:
            return capture.call_compiled(fn, args, kwargs)
        return _call_unwatched(fn, args, kwargs)
    finally:
        for mode in reversed(paused):
            mode.__enter__()


def _call_unwatched(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if getattr(_get_current_dispatch_mode(), "pauses_for_compiled_code", False):
        # bcg_diffusion.core.hostile's finder (debug mode): compiled code will not run under it either.
        # A block compiled with fullgraph=True holds no host sync, so nothing is missed inside.
        with _pop_mode_temporarily():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


class _BreakableCapture:
    """State of one capture in progress. Created and driven by :func:`capture_breakable` only."""

    def __init__(
        self, pool: GraphPool, capture_error_mode: str, track_external: bool, consensus: Any, breaker: Any = None
    ) -> None:
        self.pool = pool
        self.consensus = consensus
        self.peer_failed = False
        self.capture_error_mode = capture_error_mode
        self.steps: list[_GraphStep | _EagerStep] = []
        self.current: torch.cuda.CUDAGraph | None = None
        self.side_streams: set[torch.cuda.Stream] = set()
        self.tracker = _ExternalTensorTracker(pool.stream, breaker) if track_external else None

    def begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool.handle, capture_error_mode=self.capture_error_mode)
        self.current = graph
        # Fork the side streams joined at the end of the last segment into this one, so code that
        # joins them after the break (capture_stream.wait_stream(side)) waits on captured work,
        # not on work outside the capture, which CUDA refuses.
        capture_stream = torch.cuda.current_stream(self.pool.device)
        for stream in self.side_streams:
            stream.wait_stream(capture_stream)
        if self.tracker is not None:
            self.tracker.recording = True

    def end_segment(self) -> None:
        """End the open segment, keep it if it recorded any work, and replay it so its outputs are real."""
        if self.tracker is not None:
            self.tracker.recording = False
        self._join_side_streams()
        graph, self.current = self.current, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        empty = False
        for warning in caught:
            if _EMPTY_GRAPH_WARNING in str(warning.message):
                empty = True  # e.g. a break right at the start of the forward: nothing to replay
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        if empty:
            graph.reset()
            return
        graph.replay()
        self.steps.append(_GraphStep(graph))

    def _join_side_streams(self) -> None:
        # Work forked onto another stream during capture must join the capture stream before the
        # segment ends, or cudaStreamEndCapture fails with "unjoined". Joining an already joined
        # stream costs one event node.
        capture_stream = torch.cuda.current_stream(self.pool.device)
        if self.tracker is not None:
            self.side_streams |= self.tracker.side_streams
            self.tracker.side_streams.clear()
        for stream in self.side_streams:
            with torch.cuda.stream(stream):
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:
                capture_stream.wait_stream(stream)

    def note_stream(self) -> None:
        stream = torch.cuda.current_stream(self.pool.device)
        if stream != self.pool.stream:
            self.side_streams.add(stream)

    def call_compiled(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A compiled region inside this capture (see :func:`call_untracked`)."""
        tracker = self.tracker
        if tracker is None or not tracker.recording:
            return _call_unwatched(fn, args, kwargs)
        if _get_current_dispatch_mode() is not tracker:
            # Another mode sits above ours; popping ours would pop it instead. Let fn run under both.
            return fn(*args, **kwargs)
        tracker.note_reads((args, kwargs))
        tracker.__exit__(None, None, None)
        try:
            result = fn(*args, **kwargs)
        finally:
            tracker.__enter__()
        tracker.note_produced(result)
        return result

    def agree(self) -> None:
        """With a consensus (context parallelism), vote that this rank is still capturing; raise
        :class:`PeerCaptureFailed` if another rank's capture failed. Only
        between segments: the vote is a collective and must not be captured."""
        if self.consensus is not None and not self.consensus.vote(True):
            self.peer_failed = True
            raise PeerCaptureFailed("another rank's capture of this signature failed")

    def run_break(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.note_stream()
        self.end_segment()
        self.agree()
        # Nested breaks (a break calling another) run as plain calls inside the outer one.
        token = _ACTIVE.set(None)
        try:
            result = fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        leaves, spec = flatten(result)
        # Clone rather than adopt: the break may return a tensor someone else owns (a cache entry),
        # and replay writes into the bridge.
        bridges = [leaf.clone() for leaf in leaves]
        self.steps.append(_EagerStep(fn, args, kwargs, spec, bridges))
        self.begin_segment()
        return unflatten(spec, bridges)

    def abort(self) -> bool:
        """Close an open segment after an error, without hiding the error that caused it.

        Returns False when CUDA had invalidated the capture (``capture_end`` raised), so the pool
        must not be captured into again.
        """
        if self.tracker is not None:
            self.tracker.recording = False
        graph, self.current = self.current, None
        if graph is None:
            return True
        clean = True
        try:
            self._join_side_streams()
        except Exception as exc:  # the capture is already broken; report and continue closing it
            logger.debug("joining side streams while aborting a capture failed: %s", exc)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph.capture_end()
        except Exception as exc:  # expected: an invalidated capture cannot end cleanly
            logger.debug("ending an aborted capture segment raised (expected after a failed capture): %s", exc)
            clean = False
        try:
            graph.reset()
        except Exception as exc:
            logger.debug("resetting an aborted capture segment raised: %s", exc)
        return clean


def _release_blas_workspaces() -> None:
    """Drop PyTorch's cached cuBLAS / cuBLASLt workspaces (one per handle and stream), so that the next
    matrix product allocates a fresh one.

    Called right before and right after each capture. A workspace that the warm-ups allocated outside
    the pool would otherwise be baked into the graph while something else owns it: inductor's CUDA-graph
    trees (``torch.compile(mode="reduce-overhead")``) clear these caches whenever they record and then
    empty the allocator's cache, and the next replay of our graph used freed memory (an illegal memory
    access on an H200, full-size Z-Image next to reduce-overhead: ``bench/results/2026-12-01-h200``,
    run 50). Cleared before, the capture's first product takes its workspace from the graph pool;
    cleared after, that workspace is an ordinary freed block of the pool, like every other temporary
    of the graph, that only later captures into the same pool may reuse. Like inductor's, the release
    covers every thread's and stream's cached workspace; each is allocated again by its next product.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _vote_failure(consensus: Any, cause: Exception) -> None:
    """Tell the other ranks this capture failed (they wait in their next vote and stop too)."""
    try:
        consensus.vote(False)
    except Exception as exc:  # the capture's own error matters more; say what else went wrong
        logger.warning("telling the other ranks that a capture failed (%r) failed too: %r", cause, exc)


def capture_breakable(
    fn: Callable[[], Any],
    pool: GraphPool,
    *,
    capture_error_mode: str = "thread_local",
    track_external: bool = True,
    consensus: Any = None,
    breaker: Any = None,
) -> tuple[BreakableGraph, Any]:
    """Capture ``fn()`` as a :class:`BreakableGraph` and return it with ``fn``'s (real) result.

    Needs: the current stream is ``pool.stream`` (the capture stream, not the default stream), the
    caller has warmed ``fn`` up on that stream, and every tensor ``fn`` reads from outside is held
    by the caller (static inputs) or tracked (``track_external=True``). Segments begin and end
    directly: no synchronize or cache emptying per segment. cuBLAS's workspaces are released before
    and after the capture, so the graph's own come from the pool (see :func:`_release_blas_workspaces`):
    graphs recorded by others in the process (inductor's, which release them too) cannot free them.

    Returns ``(graph, result)``; ``result``'s tensors live in the pool and are rewritten by every
    replay. Because each segment is replayed as soon as it is captured, ``result`` holds real values.

    With ``consensus`` (a :class:`~bcg_diffusion.features.context_parallel.CaptureConsensus`, for context-parallel
    models whose breaks are collectives), every rank of its group votes at each break and at the end,
    and the capture succeeds on all ranks or on none.

    With ``breaker`` (a :class:`~bcg_diffusion.core.auto_breaks.AutoBreaker`; needs ``track_external``,
    whose dispatch mode consults it), every operation it names becomes an eager break of its own.

    Raises whatever ``fn`` raised (the capture is closed first, never left half-open),
    :class:`PeerCaptureFailed` when another rank's capture failed, and
    :class:`RuntimeError` if called while another capture is active in this context.
    """
    if _ACTIVE.get() is not None:
        raise RuntimeError("capture_breakable cannot nest: a breakable capture is already active in this context")
    if torch.cuda.current_stream(pool.device) != pool.stream:
        raise RuntimeError(
            "capture_breakable must run on the pool's capture stream: wrap it in torch.cuda.stream(pool.stream)"
        )
    capture = _BreakableCapture(pool, capture_error_mode, track_external, consensus, breaker)
    token = _ACTIVE.set(capture)
    _release_blas_workspaces()
    try:
        if capture.tracker is not None:
            capture.tracker.__enter__()
        try:
            capture.begin_segment()
            result = fn()
            capture.note_stream()
            capture.end_segment()
        finally:
            if capture.tracker is not None:
                capture.tracker.__exit__(None, None, None)
        capture.agree()
    except BaseException as exc:
        if not capture.abort():
            pool.renew()
        for step in capture.steps:
            if isinstance(step, _GraphStep):
                step.graph.reset()
        if consensus is not None and not capture.peer_failed and isinstance(exc, Exception):
            _vote_failure(consensus, exc)
        raise
    finally:
        _ACTIVE.reset(token)
        _release_blas_workspaces()
    keepalive: list[Any] = list(capture.tracker.kept.values()) if capture.tracker is not None else []
    return BreakableGraph(capture.steps, keepalive), result
