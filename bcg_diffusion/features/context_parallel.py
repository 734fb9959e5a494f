"""Context parallelism (diffusers' ``enable_parallelism``) under breakable graphs.

With ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` (or
``ring_degree``), launched with ``torchrun``, diffusers splits the sequence across the ranks in
forward hooks and exchanges it in attention with collectives (all-to-all, all-gather). Those
collectives stay eager breaks (:mod:`bcg_diffusion.patches.collectives`): a collective replayed from a
CUDA graph bypasses the process group's bookkeeping, and the next ordinary collective after such
replays was seen to hang. Everything between the collectives is replayed on every rank.

This module holds what the rest of the package needs to know about the parallel layout:

* :func:`layout_of` reads it from a model, for the signature (graphs captured for one layout must
  never replay under another) and for the checks below;
* :func:`check_divisible` turns diffusers' bare ``assert`` on sequence lengths into a clear error;
* :class:`CaptureConsensus` keeps the ranks in step when a capture fails on one of them only;
* :func:`guarded` puts the first two around the transformer's runner.

The :class:`ContextParallel` feature, on an accelerated transformer, always guards against
``enable_parallelism`` called after ``accelerate`` (its collectives would not be breaks). Under a
parallel layout it also patches the collectives into breaks, makes every rank keep or abandon each
capture together (one vote per break), keys the signatures by the layout and checks that sequence
lengths divide among the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.hooks import MethodPatches, register_graph_safe_hooks
from ..patches import FunctionPatch
from ..patches.collectives import COLLECTIVES_PATCH, MASK_GATHER_PATCH
from .base import Feature, Setup, Target

__all__ = ["CaptureConsensus", "ContextParallel", "ParallelLayout", "check_divisible", "guarded", "layout_of"]

# diffusers' context-parallel hooks split the inputs on the device and gather the outputs with a
# collective that runs as an eager break (the patches above): graphs can hold them.
register_graph_safe_hooks("cp_input---", "cp_output---")


@dataclass(frozen=True)
class ParallelLayout:
    """How a context-parallel model is split: degrees, this rank, and the group that spans them.

    ``key`` is what goes into a signature; ``group`` is not hashable by value and stays out of it.
    """

    ulysses_degree: int
    ring_degree: int
    rank: int
    anything: bool  # diffusers' ulysses_anything / ring_anything (uneven splits)
    group: Any = None

    @property
    def degree(self) -> int:
        """How many ranks share one sequence."""
        return self.ulysses_degree * self.ring_degree

    @property
    def key(self) -> Hashable:
        return ("context_parallel", self.ulysses_degree, self.ring_degree, self.rank, self.anything)


def layout_of(model: Any) -> ParallelLayout | None:
    """The context-parallel layout diffusers' ``enable_parallelism`` gave ``model``; None if it has none.

    Reads ``model._parallel_config.context_parallel_config`` once it is set up (the mesh exists after
    the first ``enable_parallelism``). Tensor parallelism alone returns None: it needs no breaks.
    """
    parallel_config = getattr(model, "_parallel_config", None)
    cp_config = getattr(parallel_config, "context_parallel_config", None)
    if cp_config is None:
        return None
    mesh = getattr(cp_config, "_flattened_mesh", None)
    return ParallelLayout(
        ulysses_degree=int(cp_config.ulysses_degree or 1),
        ring_degree=int(cp_config.ring_degree or 1),
        rank=int(getattr(cp_config, "_rank", 0) or 0),
        anything=bool(cp_config.ulysses_anything or cp_config.ring_anything),
        group=mesh.get_group() if mesh is not None else None,
    )


def _plan_inputs(model: Any) -> dict[str, tuple[int, int | None]]:
    """Input names of the model's context-parallel plan that diffusers splits, with (dim, expected dims)."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    found: dict[str, tuple[int, int | None]] = {}
    for module_plan in (getattr(model, "_cp_plan", None) or {}).values():
        if not isinstance(module_plan, dict):
            continue
        for name, spec in module_plan.items():
            if isinstance(name, str) and isinstance(spec, ContextParallelInput) and not spec.split_output:
                found.setdefault(name, (spec.split_dim, spec.expected_dims))
    return found


def check_divisible(model: Any, layout: ParallelLayout) -> Callable[[dict[str, Any]], None]:
    """A check of a forward's keyword arguments: every tensor the plan splits divides by the degree.

    diffusers splits sequences into equal parts and otherwise stops on a bare ``assert`` deep in its
    hooks. The check raises a ValueError that names the input, its length and the ways out. Inputs of
    the plan that the forward does not take under the same name are not checked (diffusers still is).

    >>> check = check_divisible(pipe.transformer, layout)                   # doctest: +SKIP
    >>> check({"encoder_hidden_states": torch.zeros(1, 7, 3584)})           # doctest: +SKIP
    ValueError: context parallelism over 2 ranks splits encoder_hidden_states along dim 1 ...
    """
    inputs = _plan_inputs(model)

    def check(kwargs: dict[str, Any]) -> None:
        if layout.anything:
            return
        for name, (dim, expected_dims) in inputs.items():
            value = kwargs.get(name)
            if not isinstance(value, torch.Tensor) or (expected_dims is not None and value.dim() != expected_dims):
                continue
            if value.shape[dim] % layout.degree:
                raise ValueError(
                    f"context parallelism over {layout.degree} ranks splits {name} along dim {dim} into equal "
                    f"parts, but its length is {value.shape[dim]} (shape {tuple(value.shape)}). Use a length "
                    f"that divides by {layout.degree}: for the text, bcg-diffusion's text_buckets pad every "
                    "prompt to a bucket; for the image, a resolution whose token count divides. diffusers' "
                    "ulysses_anything / ring_anything split unevenly, but run eagerly here."
                )

    return check


class CaptureConsensus:
    """Makes every rank of ``group`` keep or abandon a capture together.

    During a capture the collectives run as eager breaks. If one rank's capture fails between two
    breaks, that rank stops issuing collectives while the others wait in the next one: a hang. So
    each rank votes at every break it reaches and once at the end (1: still capturing) or where it
    failed (0), with one ``all_reduce(MIN)`` per vote; a rank that sees a 0 stops capturing with
    :class:`PeerCaptureFailed` and votes no more. Every rank then casts the same number of votes, all
    fall back to eager for that signature, and their next collectives match again. Votes happen
    only while capturing (outside any graph), never on replay.

    Needs: ``torch.distributed`` initialised and ``group`` spanning every rank that captures.
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        backend = str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self.votes = 0  # cast in this process, for tests and logs

    def vote(self, ok: bool) -> bool:
        """Cast this rank's vote; True when every rank voted ``ok``. A host sync (outside any graph)."""
        import torch.distributed as dist

        ballot = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        self.votes += 1
        return bool(ballot.item())


def guarded(
    forward: Callable[..., Any],
    state_key: Callable[[], Hashable] | None,
    model: Any,
    layout: ParallelLayout | None,
) -> tuple[Callable[..., Any], Callable[[], Hashable]]:
    """The transformer's runner callable and signature state, made aware of context parallelism.

    Returns ``(forward, state_key)``: the forward checks sequence lengths first (see
    :func:`check_divisible`) when ``layout`` is set; the state key adds ``layout.key`` to
    ``state_key()`` and raises RuntimeError if the model's parallel configuration is no longer the
    one ``accelerate`` saw (``enable_parallelism`` called afterwards: its collectives would not be
    breaks). The check runs when the runner calls the forward (warm-up, capture, eager), not on replay.
    """
    config_seen = getattr(model, "_parallel_config", None)
    layout_key = layout.key if layout is not None else None

    def key() -> Hashable:
        if getattr(model, "_parallel_config", None) is not config_seen:
            raise RuntimeError(
                "the transformer's parallel configuration changed after bcg_diffusion.accelerate(pipe) "
                "(enable_parallelism must come first, so that its collectives become eager breaks): call "
                "bcg_diffusion.restore(pipe), then accelerate(pipe) again"
            )
        return (state_key() if state_key is not None else None, layout_key)

    if layout is None:
        return forward, key
    check = check_divisible(model, layout)

    def checked_forward(*args: Any, **kwargs: Any) -> Any:
        check(kwargs)
        return forward(*args, **kwargs)

    return checked_forward, key


# diffusers' ulysses_anything / ring_anything gather sizes on the host: not capturable.
_ANYTHING = "diffusers' ulysses_anything / ring_anything gather sizes on the host (not supported)"


class ContextParallel(Feature):
    name = "context parallelism"
    component = "transformer"

    def __init__(self, layout: ParallelLayout | None) -> None:
        self.layout = layout
        self.patches: list[FunctionPatch] = []

    @classmethod
    def create(cls, setup: Setup) -> ContextParallel | None:
        return cls(setup.layout) if "transformer" in setup.accelerated else None

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        if self.layout is None:
            return
        if setup.group.consensus is None:
            setup.group.consensus = CaptureConsensus(self.layout.group)
        for patch in (COLLECTIVES_PATCH, MASK_GATHER_PATCH):
            if patch.apply():
                self.patches.append(patch)

    def runner_fn(
        self, target: Target, fn: Callable[..., Any], state_key: Callable[[], Hashable] | None
    ) -> tuple[Callable[..., Any], Callable[[], Hashable] | None]:
        if target.component != "transformer":
            return fn, state_key
        return guarded(fn, state_key, target.module, self.layout)

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component == "transformer" and self.layout is not None and self.layout.anything:
            target.runner.suspended = _ANYTHING
        return call

    def patch_names(self) -> list[str]:
        return [patch.name for patch in self.patches]

    def close(self) -> None:
        for patch in self.patches:
            patch.revert()
        self.patches.clear()
