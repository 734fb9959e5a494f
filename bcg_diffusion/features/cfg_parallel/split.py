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

**The ranks check that they agree.** At the first step's cond call, before computing it, the ranks
exchange a fingerprint of the pipeline call (:func:`fingerprint`, one ``all_gather`` of a few dozen
int64): whether it does true CFG, ``true_cfg_scale``, ``guidance_scale``, the step count, the negative
prompt, and the shapes and exact checksums of the transformer's inputs (latents, prompt embeddings and
mask, the rest together). Ranks with other seeds or prompts would otherwise combine one rank's cond
prediction with the other's uncond prediction, and a call that does true CFG on one rank only would
leave the other waiting in an exchange forever. On any difference every rank raises the same
:class:`CfgMismatchError`, naming each field that differs with both ranks' values, and the next call
starts afresh. Reading the exchanged fingerprint is a host sync, once per pipeline call.

Whether a call does true CFG is known in advance from the arguments of the accelerated pipeline call
running it (:func:`bcg_diffusion.core.hooks.current_call`): ``true_cfg_scale > 1`` with a negative prompt
or negative embeddings, Qwen-Image's rule. The transformer called outside one (directly, or by a
pipeline that is not accelerated) gives no arguments: the ranks then also compare whether they paired
at the second step's cond call, one more small exchange, so that they never wait on each other.

Which step is the first comes from the calling pipeline's own scheduler (``step_index`` is None until
the first ``scheduler.step`` of a call), not from tensor values; pipelines sharing the transformer each
use theirs, and a call outside any accelerated pipeline call uses the scheduler of the pipeline the
split was made for.

Each prediction is computed by one rank with the shapes and kernels one GPU would use, and copied
exactly, so on GPUs of one kind the images are byte-identical to one GPU's (in exact mode, to one GPU
eager).

Requires: the pipeline does not use a cond prediction between the two calls of a step (Qwen-Image's
does not); every rank makes the same calls (checked as above). Z-Image batches its CFG into one call, so there is
nothing to split (it would change the batch, and with it the kernels).

With context parallelism on more ranks, each half of a step runs on a whole context-parallel group:
on four ranks, ranks 0 and 1 split the cond call's sequence, ranks 2 and 3 the uncond call's, and the
exchange pairs rank 0 with 2 and 1 with 3. :func:`check_across` checks such a layout.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...core.hooks import PipelineCall, current_call
from ...core.tree import flatten, unflatten
from .fingerprint import ADVICE, CallFacts, CfgMismatchError, call_facts, disagreements, fingerprint, tensors_of

__all__ = ["CfgSplit", "CfgSplitCounters", "check_across"]

logger = logging.getLogger(__name__)

COND, UNCOND = "cond", "uncond"
_UNREPORTED = object()  # a scheduler without step_index


class CfgSplitCounters:
    """``split``: calls this rank left to the other; ``exchanges``: steps whose predictions were swapped."""

    split: int = 0
    exchanges: int = 0


class CfgSplit:
    """Splits each true-CFG step's two transformer calls between the two ranks of ``group``.

    The calling pipeline (its scheduler and arguments) is the accelerated pipeline call running in this
    thread (:func:`~bcg_diffusion.core.hooks.current_call`); outside one, ``fallback_pipe()``: the pipeline the
    split was made for (a weak reference: None once it is gone). Raises ValueError unless ``group`` has
    exactly two ranks.
    """

    def __init__(self, group: Any, fallback_pipe: Callable[[], Any]) -> None:
        import torch.distributed as dist

        if dist.get_world_size(group) != 2:
            raise ValueError(f"cfg_parallel needs a group of 2 ranks, got {dist.get_world_size(group)}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.fallback_pipe = fallback_pipe
        self.context: str | None = None  # the cache context the pipeline entered (the cache_context wrapper)
        self.counters = CfgSplitCounters()
        self._unreported: set[type] = set()  # scheduler classes already warned about
        self._reset()

    def _reset(self) -> None:
        """Forget the pipeline call in progress (at its first step, and after a mismatch)."""
        self.cfg: bool | None = None  # the agreed decision: does this call do true CFG (None: unknown)
        self.paired = False  # this pipeline call's first step made an uncond call after its cond call
        self.confirm = False  # compare paired with the other rank at the next cond call (cfg unknown)
        self.shape: Any = None  # spec and leaf shapes of the cond output, from the first step
        self.device: torch.device | None = None  # of the first step's inputs: where the exchanges run
        self.pending: list[torch.Tensor] | None = None  # this step's cond leaves: computed (rank 0) or awaited (1)

    @contextlib.contextmanager
    def entered(self, name: str) -> Iterator[None]:
        """Note the cache context ``name`` for the calls inside (wraps ``transformer.cache_context``)."""
        previous, self.context = self.context, name
        try:
            yield
        finally:
            self.context = previous

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One transformer call: run it, leave it to the other rank, or exchange (module docstring).

        Raises CfgMismatchError, on every rank alike, when the ranks' pipeline calls differ."""
        caller = current_call()
        pipe = caller.pipe if caller is not None else self.fallback_pipe()
        if pipe is None:  # outside any accelerated call, and the pipeline the split was made for is gone
            self._reset()
            return fn(*args, **kwargs)
        scheduler = getattr(pipe, "scheduler", None)
        step_index = getattr(scheduler, "step_index", _UNREPORTED)
        if step_index is _UNREPORTED:
            self._warn_unreported(scheduler)
            return fn(*args, **kwargs)
        if step_index is None:
            return self._first_step(fn, args, kwargs, caller, scheduler)
        if self.confirm and self.context == COND:
            self._confirm_paired()
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

    def _first_step(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, caller: PipelineCall | None, scheduler: Any
    ) -> Any:
        """A call of the pipeline call's first step: run whole. Its cond call first checks that the ranks
        agree (every rank reaches it, whatever it does later) and records the output's shape; its uncond
        call pairs the step."""
        if self.context == COND:
            self._reset()
            self._agree(args, kwargs, call_facts(caller, scheduler))
            out = fn(*args, **kwargs)
            leaves, spec = flatten(out)
            self.shape = (spec, [(t.shape, t.dtype, t.device) for t in leaves])
            return out
        out = fn(*args, **kwargs)
        if self.context == UNCOND and self.shape is not None:
            # Agreed decisions make both ranks pair alike; an unknown one is confirmed at the next step.
            self.paired = self.cfg is not False
        return out

    def _agree(self, args: tuple, kwargs: dict, facts: CallFacts) -> None:
        """Exchange the fingerprints of this call; raise CfgMismatchError (after a reset) on any difference."""
        import torch.distributed as dist

        leaves = tensors_of((args, kwargs))
        self.device = leaves[0].device if leaves else torch.device("cpu")
        mine = fingerprint(facts, args, kwargs, self.device)
        rows = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(rows, mine, group=self.group)
        differ = disagreements(torch.stack(rows).tolist())  # the host sync, once per pipeline call
        if differ:
            self._reset()
            raise CfgMismatchError(f"cfg_parallel: the ranks disagree on {', '.join(differ)}. {ADVICE}")
        self.cfg = facts.cfg
        self.confirm = facts.cfg is None
        logger.debug("cfg_parallel: the ranks agree on the call (true CFG: %s)", facts.cfg)

    def _confirm_paired(self) -> None:
        """Both ranks compare whether their first step paired (a call whose CFG was not known in advance);
        raise CfgMismatchError (after a reset) when they differ, before either waits in an exchange."""
        import torch.distributed as dist

        self.confirm = False
        mine = torch.tensor([int(self.paired)], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(rows, mine, group=self.group)
        paired = [bool(row.item()) for row in rows]
        if paired[0] != paired[1]:
            self._reset()
            shown = ", ".join(f"rank {r}: {'yes' if p else 'no'}" for r, p in enumerate(paired))
            raise CfgMismatchError(
                "cfg_parallel: the ranks disagree on whether this call does true CFG, seen as an uncond call after "
                f"the first step's cond call ({shown}). {ADVICE}"
            )

    def _warn_unreported(self, scheduler: Any) -> None:
        """A scheduler without ``step_index``: its calls run whole on every rank (warned once per class)."""
        self._reset()
        kind = type(scheduler)
        if kind not in self._unreported:
            self._unreported.add(kind)
            logger.warning(
                "cfg_parallel: %s does not report its step_index, so the calls of pipelines using it run "
                "whole on every rank (not split)",
                kind.__name__,
            )

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
