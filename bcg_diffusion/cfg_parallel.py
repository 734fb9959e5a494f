"""True CFG across two ranks: each step's cond call on rank 0, its uncond call on rank 1.

With true CFG (Qwen-Image's ``true_cfg_scale``), a pipeline calls its transformer twice per step,
inside ``transformer.cache_context("cond")`` and then ``cache_context("uncond")``, on the same latents.
The two calls are independent, so two GPUs can run one each. Every rank runs the same pipeline call
(same arguments and seed, launched with ``torchrun``, as context parallelism is):

* **the first step** of each pipeline call runs both calls on both ranks, as one GPU would. It shows
  whether this call does true CFG (an uncond call follows the cond call) and the cond output's shape;
* **every later step**, when it does: rank 0 computes the cond call; rank 1 returns from it at once
  with an empty buffer of the cond output's shape, which the pipeline only slices before the uncond
  call (views, no arithmetic). At the uncond call, rank 1 computes it, and one ``all_gather`` per
  output tensor exchanges the two predictions: rank 1's buffer receives rank 0's cond prediction, in
  place, and rank 0 gets rank 1's uncond prediction as that call's result. Both ranks then combine
  the same two tensors;
* a call without true CFG runs whole on every rank.

Each prediction is computed by one rank with the shapes and kernels one GPU would use, and copied
exactly, so on GPUs of one kind the images are byte-identical to one GPU's (in exact mode, to one GPU
eager). Which step is the first comes from the scheduler (``step_index`` is None until the first
``scheduler.step`` of a call), not from tensor values: no host sync.

Requires: the pipeline does not use a cond prediction between the two calls of a step (Qwen-Image's
does not); every rank makes the same calls. Z-Image batches its CFG into one call, so there is
nothing to split (it would change the batch, and with it the kernels).

With context parallelism on more ranks, each half of a step runs on a whole context-parallel group:
on four ranks, ranks 0 and 1 split the cond call's sequence, ranks 2 and 3 the uncond call's, and the
exchange pairs rank 0 with 2 and 1 with 3. :func:`check_across` checks such a layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .tree import flatten, unflatten

__all__ = ["CfgSplit", "CfgSplitCounters", "check_across"]

COND, UNCOND = "cond", "uncond"


@dataclass
class CfgSplitCounters:
    """``split``: calls this rank left to the other; ``exchanges``: steps whose predictions were swapped."""

    split: int = 0
    exchanges: int = 0


class CfgSplit:
    """Splits each true-CFG step's two transformer calls between the two ranks of ``group``.

    ``scheduler_of`` returns the pipeline's scheduler (read at every call: users swap schedulers).
    Raises ValueError unless ``group`` has exactly two ranks.
    """

    def __init__(self, group: Any, scheduler_of: Callable[[], Any]) -> None:
        import torch.distributed as dist

        if dist.get_world_size(group) != 2:
            raise ValueError(f"cfg_parallel needs a group of 2 ranks, got {dist.get_world_size(group)}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.scheduler_of = scheduler_of
        self.context: str | None = None  # the cache context the pipeline entered (the cache_context wrapper)
        self.paired = False  # this pipeline call's first step made an uncond call after its cond call
        self.shape: Any = None  # spec and leaf shapes of the cond output, from the first step
        self.pending: list[torch.Tensor] | None = None  # this step's cond leaves: computed (rank 0) or awaited (1)
        self.counters = CfgSplitCounters()

    @contextlib.contextmanager
    def entered(self, name: str) -> Iterator[None]:
        """Note the cache context ``name`` for the calls inside (wraps ``transformer.cache_context``)."""
        previous, self.context = self.context, name
        try:
            yield
        finally:
            self.context = previous

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One transformer call: run it, leave it to the other rank, or exchange (module docstring)."""
        if getattr(self.scheduler_of(), "step_index", 0) is None:  # the first step: both calls, both ranks
            out = fn(*args, **kwargs)
            if self.context == COND:
                leaves, spec = flatten(out)
                self.paired, self.shape = False, (spec, [(t.shape, t.dtype, t.device) for t in leaves])
            elif self.context == UNCOND and self.shape is not None:
                self.paired = True
            return out
        if not self.paired or self.context not in (COND, UNCOND):
            return fn(*args, **kwargs)
        spec, shapes = self.shape
        if self.context == COND:
            if self.rank == 0:
                out = fn(*args, **kwargs)
                self.pending = flatten(out)[0]
                return out
            self.pending = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in shapes]
            self.counters.split += 1
            return unflatten(spec, self.pending)
        if self.pending is None:
            raise RuntimeError("cfg_parallel: an uncond call came without a cond call before it in this step")
        if self.rank == 1:
            out = fn(*args, **kwargs)
            mine, received = flatten(out)[0], self.pending
        else:
            self.counters.split += 1
            mine = self.pending
            received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in shapes]
            out = unflatten(spec, received)
        self._exchange(mine, received)
        self.pending = None
        self.counters.exchanges += 1
        return out

    def _exchange(self, mine: list[torch.Tensor], received: list[torch.Tensor]) -> None:
        """Each rank sends ``mine`` and fills ``received`` with the other rank's, in place."""
        import torch.distributed as dist

        for own, other in zip(mine, received):
            slots = [torch.empty_like(own), other] if self.rank == 0 else [other, torch.empty_like(own)]
            dist.all_gather(slots, own.contiguous(), group=self.group)


def check_across(cfg_group: Any, cp_group: Any) -> None:
    """Raise ValueError unless ``cfg_group`` (two ranks that split CFG) runs across the context-parallel
    groups: its other rank is outside this rank's ``cp_group``, and every rank of ``cp_group`` has the
    same place in its own CFG group (so a whole context-parallel group computes one half of each step).

    A collective over ``cp_group`` (every rank of it calls this). With a device mesh, the groups are
    ``mesh["cfg"].get_group()`` and the context-parallel mesh ``mesh["ring", "ulysses"]``::

        mesh = init_device_mesh("cuda", (2, 1, 2), mesh_dim_names=("cfg", "ring", "ulysses"))
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2, mesh=mesh["ring", "ulysses"]))
        accelerate(pipe, cfg_parallel=mesh["cfg"].get_group())
    """
    import torch.distributed as dist

    me = dist.get_rank()
    cfg_ranks = (
        dist.get_process_group_ranks(cfg_group) if cfg_group is not None else list(range(dist.get_world_size()))
    )
    cp_ranks = dist.get_process_group_ranks(cp_group) if cp_group is not None else list(range(dist.get_world_size()))
    if set(cfg_ranks) & set(cp_ranks) != {me}:
        raise ValueError(
            f"cfg_parallel under context parallelism needs a group of two ranks from different context-parallel "
            f"groups; rank {me} has CFG ranks {cfg_ranks} and context-parallel ranks {cp_ranks}. Build both from "
            'one device mesh: cfg_parallel=mesh["cfg"].get_group() (docs/parallel.md)'
        )
    places = [None] * len(cp_ranks)
    dist.all_gather_object(places, dist.get_rank(cfg_group), group=cp_group)
    if len(set(places)) != 1:
        raise ValueError(
            f"cfg_parallel under context parallelism: the ranks {cp_ranks} of one context-parallel group have "
            f"places {places} in their CFG groups; they must all compute the same half (cond or uncond)"
        )
