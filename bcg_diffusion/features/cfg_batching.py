"""Fast mode: true CFG's cond and uncond transformer calls of a step run as one batch.

The batching itself is :mod:`bcg_diffusion.cfg_batch`; this feature decides where it applies: asked
for (or left at None), supported by the adapter for this very pipeline class (relatives that call the
transformer differently, such as the Edit variants, do not batch), and not under context parallelism.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..cfg_batch import CfgBatcher
from ..patches.attention import TEXT_LENGTHS_KWARG
from ..runner import BCGWarning
from ..step_cache import has_cache_hooks
from .base import Feature, Setup, Target

__all__ = ["CfgBatching"]


class CfgBatching(Feature):
    name = "CFG batching"
    component = "transformer"
    defaults = {"cfg_batched": 0, "cfg_batch_dropped": 0}

    def __init__(self, setup: Setup) -> None:
        self.spec = setup.adapter.cfg_batch
        self.lock = setup.group.lock
        self.attention_kwargs = setup.attention_kwargs  # filled by the processor patches' prepare
        self.batcher: CfgBatcher | None = None

    @classmethod
    def create(cls, setup: Setup) -> CfgBatching | None:
        config = setup.config
        if config.mode != "fast" or config.batch_cfg is False or "transformer" not in setup.accelerated:
            return None
        if config.cfg_parallel is not False:  # the two calls of a step run on two GPUs instead
            if config.batch_cfg:
                warnings.warn("bcg-diffusion: batch_cfg=True is ignored with cfg_parallel", BCGWarning, stacklevel=4)
            return None
        if setup.adapter.cfg_batch is not None and setup.adapter.is_tested(setup.pipe) and setup.layout is None:
            return cls(setup)
        if config.batch_cfg:
            where = "with context parallelism" if setup.layout is not None else f"for {type(setup.pipe).__name__}"
            warnings.warn(
                f"bcg-diffusion: batch_cfg is not supported {where}; its CFG calls run one by one",
                BCGWarning,
                stacklevel=4,
            )
        return None

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != "transformer":
            return call
        lengths_key = TEXT_LENGTHS_KWARG if TEXT_LENGTHS_KWARG in self.attention_kwargs else None
        batcher = self.batcher = CfgBatcher(call, target.signature, self.spec, text_lengths_key=lengths_key)

        module = target.module

        def batched(*args: Any, **kwargs: Any) -> Any:
            with self.lock:  # the batcher keeps state between calls
                if has_cache_hooks(module):
                    # A cache keeps one state per call (cache_context "cond" / "uncond") and decides per
                    # call: one batch of both would mix them. Calls run one by one while a cache is on.
                    batcher.pass_through()
                    return call(*args, **kwargs)
                return batcher(*args, **kwargs)

        return batched

    def stats(self) -> dict[str, Any]:
        if self.batcher is None:
            return {}
        return {"cfg_batched": self.batcher.batched, "cfg_batch_dropped": self.batcher.dropped}
