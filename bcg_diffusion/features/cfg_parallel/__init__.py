"""CFG across GPUs (``cfg_parallel=True`` under ``torchrun``): the work is :mod:`.split` (with :mod:`.fingerprint`).

This feature decides where it applies (a true-CFG pipeline, two ranks, across the context-parallel
groups if there are any, a scheduler that reports its step), wraps the transformer's ``cache_context`` so each call knows
whether it is the cond or the uncond one, and puts the split around the transformer's runner call. The
split lives on the transformer, so every pipeline sharing it shares the split; each call finds its
pipeline (scheduler, arguments) through :func:`bcg_diffusion.hooks.current_call`, and the ranks check
at the first step of every call that they make the same one.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ...core.hooks import MethodPatches
from ...core.runner import BCGWarning
from ..base import Feature, Setup, Target
from .fingerprint import CfgMismatchError
from .split import CfgSplit, check_across

__all__ = ["CfgMismatchError", "CfgParallel", "CfgSplit", "check_across"]


def _refuse(reason: str) -> None:
    warnings.warn(f"bcg-diffusion: cfg_parallel is off: {reason}", BCGWarning, stacklevel=5)


class CfgParallel(Feature):
    name = "CFG across GPUs"
    component = "transformer"
    defaults = {"cfg_split_calls": 0, "cfg_exchanges": 0}

    def __init__(self, split: CfgSplit) -> None:
        self.split = split

    @classmethod
    def create(cls, setup: Setup) -> CfgParallel | None:
        option = setup.config.cfg_parallel
        if option is False or "transformer" not in setup.accelerated:
            return None
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("cfg_parallel needs torch.distributed initialised (launch with torchrun)")
        if setup.adapter.guidance_argument != "true_cfg_scale":
            _refuse(f"{type(setup.pipe).__name__} does not make separate cond and uncond calls (true CFG)")
            return None
        if setup.layout is not None and option is True:
            raise ValueError(
                "cfg_parallel=True under context parallelism: pass the process group of the two ranks that "
                'split CFG, built with the context-parallel mesh from one device mesh: mesh["cfg"].get_group() '
                "(docs/parallel.md)"
            )
        if not hasattr(setup.pipe.scheduler, "step_index"):
            _refuse(f"{type(setup.pipe.scheduler).__name__} does not report its step_index")
            return None
        if not hasattr(setup.modules["transformer"], "cache_context"):
            _refuse("the transformer has no cache_context, so its calls cannot be told apart")
            return None
        group = None if option is True else option
        # Weakly: the split lives on the transformer, which may outlive this pipeline.
        split = CfgSplit(group, weakref.ref(setup.pipe))
        if setup.layout is not None:
            check_across(group, setup.layout.group)
        return cls(split)

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        module = setup.modules["transformer"]
        original = module.cache_context
        split = self.split

        @contextlib.contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            with original(name, **kwargs), split.entered(name):
                yield

        patches.replace(module, "cache_context", cache_context)

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        split = self.split

        def split_call(*args: Any, **kwargs: Any) -> Any:
            return split.call(call, args, kwargs)

        return split_call

    def stats(self) -> dict[str, Any]:
        return {"cfg_split_calls": self.split.counters.split, "cfg_exchanges": self.split.counters.exchanges}
