"""diffusers' context-parallel collectives as eager breaks.

diffusers issues every collective of context parallelism through ``funcol``
(``torch.distributed._functional_collectives``) bound by name in two modules: the Ulysses all-to-alls
and the ring all-gather in ``attention_dispatch``, the output all-gather in ``hooks.context_parallel``.
The patch binds ``funcol`` there to a stand-in module whose ``all_to_all_single`` and
``all_gather_tensor`` are eager breaks that wait for their result; every other attribute is the real
module's. Likewise ``dist`` in ``attention_dispatch``, whose ``all_gather`` gathers a split attention
mask (the masked path) into argument buffers, which the break keeps and refills on every replay.
Outside a capture they are the same call followed by the wait diffusers does next anyway (its
``_wait_tensor``), so eager results are unchanged.

Fast mode compiles the blocks around them: each break is also ``torch.compiler.disable``-d, so
dynamo ends a compiled region before it and starts another after it (the blocks compile with
``fullgraph=False`` under context parallelism), and the break runs eagerly between the two, inside
the capture as everywhere else.

Why breaks and not collectives inside the graphs: a collective replayed from a CUDA graph skips the
process group's bookkeeping (sequence numbers, work tracking); on two H200s the next ordinary
collective after such replays hung. As a break, each collective runs eagerly on every replay, issued
by the process group exactly as in eager, and the graph segments between them replay.

diffusers' ``ulysses_anything`` / ``ring_anything`` modes also gather sizes on the host
(``gather_size_by_comm``); they are not covered, and a model using them keeps its transformer eager
(see :func:`bcg_diffusion.accelerate`).
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import torch
import torch.distributed as dist

from ..core.graphs import eager_break
from . import FunctionPatch

__all__ = ["COLLECTIVES_PATCH", "MASK_GATHER_PATCH"]


@functools.cache
def _functional_collectives() -> types.ModuleType:
    # Imported on first use: only context-parallel models call these, and torch builds without
    # distributed support must still import bcg_diffusion. Cached: the breaks run on every replay.
    return importlib.import_module("torch.distributed._functional_collectives")


def _waited(tensor: Any) -> Any:
    return tensor.wait() if isinstance(tensor, _functional_collectives().AsyncCollectiveTensor) else tensor


@torch.compiler.disable
@eager_break
def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
    """``funcol.all_to_all_single``, waited for, as an eager break."""
    return _waited(_functional_collectives().all_to_all_single(*args, **kwargs))


@torch.compiler.disable
@eager_break
def all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    """``funcol.all_gather_tensor``, waited for, as an eager break."""
    return _waited(_functional_collectives().all_gather_tensor(*args, **kwargs))


@torch.compiler.disable
@eager_break
def all_gather(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.all_gather`` (into its argument buffers) as an eager break."""
    return dist.all_gather(*args, **kwargs)


class _ModuleWithBreaks(types.ModuleType):
    """A module whose attributes are the real module's, except the collectives set on this object."""

    def __init__(self, real: str, breaks: dict[str, Any]) -> None:
        super().__init__(f"{real} (bcg-diffusion breaks)")
        self._real_name = real
        self.__dict__.update(breaks)

    def __getattr__(self, name: str) -> Any:  # only called for names not set here
        # Read on every replay (diffusers checks ``funcol.AsyncCollectiveTensor``, for one): copied
        # here on first use, so later reads are plain attribute hits. The real module's functions and
        # classes do not change while the process runs.
        value = getattr(importlib.import_module(self._real_name), name)
        self.__dict__[name] = value
        return value


COLLECTIVES_PATCH = FunctionPatch(
    name="diffusers context-parallel collectives (eager breaks)",
    modules=("diffusers.models.attention_dispatch", "diffusers.hooks.context_parallel"),
    attribute="funcol",
    replacement=_ModuleWithBreaks(
        "torch.distributed._functional_collectives",
        {"all_to_all_single": all_to_all_single, "all_gather_tensor": all_gather_tensor},
    ),
)
# The Ulysses attention all-gathers a sequence-split attention mask (Qwen-Image's masked path: prompts
# of different lengths, text buckets) with the plain ``dist.all_gather``.
MASK_GATHER_PATCH = FunctionPatch(
    name="diffusers context-parallel mask all-gather (eager break)",
    modules=("diffusers.models.attention_dispatch",),
    attribute="dist",
    replacement=_ModuleWithBreaks("torch.distributed", {"all_gather": all_gather}),
)
