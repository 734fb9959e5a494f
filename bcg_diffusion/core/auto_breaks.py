"""Automatic eager breaks: a capture turns what it cannot hold into eager breaks by itself.

Marked breaks (:func:`~bcg_diffusion.core.graphs.eager_break`) need someone to know the model. With an
:class:`AutoBreaker`, the capture's own dispatch mode (``graphs._ExternalTensorTracker``) asks, for
every operation it records, whether CUDA would refuse it inside a capture (the kinds of
:mod:`bcg_diffusion.core.hostile`):

* **host syncs**: ``.item()``, ``if tensor:``, ``torch.equal``, copies to the host (``.cpu()``,
  ``.tolist()``);
* **data-dependent shapes**: ``nonzero``, ``masked_select``, boolean indexing;
* **copies from host memory that is not pinned**.

Each such operation becomes a one-operation eager break, the narrowest break there is: the segment
ends, the operation runs, the next segment begins, and every replay runs it again at that point.
Its results are checked on replay as a marked break's are: a Python value, a tensor shape or the
contents of a host tensor that changed raise :class:`~bcg_diffusion.core.graphs.BreakResultMismatch`,
so the runner replays (or captures) the path of the new value. Nothing downstream of a host read
is replayed with a stale value.

Two things a dispatch mode cannot reach, which the runner learns from a failed capture instead
(:meth:`~bcg_diffusion.core.runner.GraphRunner` retries it once):

* an operation that fails inside CUDA although nothing marks it hostile (a library kernel that
  synchronizes): :attr:`AutoBreaker.failed_op` names it, and later captures break around it;
* ``torch.tensor(data, device="cuda")``: its copy runs inside the constructor, below the
  dispatcher. An eager run under :class:`~bcg_diffusion.core.hostile.HostileOpFinder` names the innermost
  module that built a GPU tensor from Python data, and :func:`module_breaks` runs that module's
  ``forward`` as an eager break (the smallest enclosing function the finder can name).

Collectives are left to context parallelism's own breaks and consensus.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .graphs import eager_break
from .hostile import HostileOp, classify, innermost_module, user_frame

__all__ = ["BREAK_KINDS", "AutoBreaker", "OpBreak", "module_breaks", "modules_to_break", "refused_by_capture"]

logger = logging.getLogger(__name__)

# The kinds of hostile.classify that a one-operation break handles.
BREAK_KINDS = ("host sync", "data-dependent shape", "copy from host memory")
LEARNED = "failed inside an earlier capture"


class OpBreak:
    """The eager step of one automatic break: one ATen operation, run again on every replay.

    Returns ``(result, host_contents)``: the bytes of every host tensor in the result join the
    break's result spec, so a replay whose host copy reads other values raises
    :class:`~bcg_diffusion.core.graphs.BreakResultMismatch` (the Python that read them at capture is not
    replayed). An in-place operation returns no result of its own (its target is its first argument).
    """

    def __init__(self, func: Any) -> None:
        self.func = func
        self.mutates = func._schema.is_mutable
        self.__qualname__ = f"automatic break {func}"

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[bytes, ...]]:
        out = self.func(*args, **kwargs)
        host = tuple(
            leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            for leaf in tree_leaves(out)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
        )
        return (None if self.mutates else out), host


class AutoBreaker:
    """Decides, during one capture, which operations become eager breaks, and keeps what it made.

    ``root`` names the modules in the records (``transformer_blocks.3.attn``); ``learned`` holds
    operation names that failed inside an earlier capture, broken around wherever they run. Host
    syncs and data-dependent shapes count only on tensors of ``device_type`` (the capture's): the
    same operation on a host tensor is ordinary host work, which a capture does not mind.
    """

    def __init__(self, root: torch.nn.Module | None, learned: Iterable[str] = (), device_type: str = "cuda") -> None:
        self.names = {id(m): name for name, m in root.named_modules()} if root is not None else {}
        self.learned = set(learned)
        self.device_type = device_type
        self.made: list[HostileOp] = []
        self._seen: set[HostileOp] = set()
        self.failed_op: str | None = None  # the first operation that raised while recorded

    def wants(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The kind of break ``func`` needs here, or None to record it in the graph."""
        if self.learned and str(func) in self.learned:
            return LEARNED
        kind = classify(func, args, kwargs, ran=False)
        if kind not in BREAK_KINDS:
            return None
        if kind != "copy from host memory" and not any(
            isinstance(t, torch.Tensor) and t.device.type == self.device_type for t in tree_leaves((args, kwargs))
        ):
            return None
        return kind

    def run(self, capture: Any, func: Any, args: tuple, kwargs: dict, kind: str) -> Any:
        """Run ``func`` as an eager break of ``capture`` (a ``graphs._BreakableCapture``)."""
        site = HostileOp(str(func), kind, innermost_module(self.names), user_frame())
        if site not in self._seen:
            self._seen.add(site)
            self.made.append(site)
        step = OpBreak(func)
        result, _ = capture.run_break(step, args, kwargs)
        return args[0] if step.mutates else result

    def note_failure(self, func: Any) -> None:
        if self.failed_op is None:
            self.failed_op = str(func)


@contextlib.contextmanager
def module_breaks(root: torch.nn.Module, paths: Iterable[str]) -> Iterator[None]:
    """Run the ``forward`` of each submodule of ``root`` named in ``paths`` as an eager break, until exit.

    For code a dispatch mode cannot reach (see the module docstring). The wrapper is an instance
    attribute, removed on exit (a ``forward`` already set on the instance is put back); a capture's
    eager steps keep calling the original ``forward`` on replay.
    """
    undo: list[tuple[torch.nn.Module, Any]] = []
    try:
        for path in paths:
            module = root.get_submodule(path)
            undo.append((module, module.__dict__.get("forward")))
            module.forward = eager_break(module.forward)
        yield
    finally:
        for module, previous in reversed(undo):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def refused_by_capture(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA refusing an operation inside a capture (what a break can fix), as
    opposed to running out of memory or an error of the model's own."""
    text = str(exc)
    return "captur" in text and "out of memory" not in text


def modules_to_break(found: Iterable[HostileOp]) -> list[str]:
    """The modules to run as breaks for what a finder saw: those that built a GPU tensor from Python
    data (not the root: breaking it would leave nothing to capture)."""
    return sorted({op.module for op in found if op.on_gpu and op.module})
