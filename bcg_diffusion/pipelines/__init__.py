"""Per-pipeline adapters and the registry that picks one for a pipeline object."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from ..features.base import EXPERTS
from .base import PipelineAdapter
from .qwenimage import QwenImageAdapter
from .zimage import ZImageAdapter

__all__ = ["ADAPTERS", "TRANSFORMERS", "PipelineAdapter", "adapter_for", "first_transformer"]

logger = logging.getLogger(__name__)

ADAPTERS: tuple[PipelineAdapter, ...] = (QwenImageAdapter(), ZImageAdapter())
# The denoisers a pipeline can hold: its transformer and, in two-expert pipelines (Wan 2.2), the further experts.
TRANSFORMERS = ("transformer", *EXPERTS)


def first_transformer(pipe: Any) -> Any:
    """``pipe``'s transformer, else its second expert (Wan 2.2 built with ``transformer=None``), else None."""
    for name in TRANSFORMERS:
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    return None


def adapter_for(pipe: Any) -> PipelineAdapter:
    """The adapter serving ``pipe``; the generic adapter (with a warning) for an unknown pipeline that
    has a ``transformer``.

    A two-expert pipeline built with only its second expert (Wan 2.2 with ``transformer=None`` and a
    ``transformer_2``, as diffusers' own tests build it) is served too: whichever experts are present.

    Raises:
        TypeError: ``pipe`` has neither a ``transformer`` nor a ``transformer_2`` component (UNet pipelines
            are not supported).
    """
    from ..core.runner import BCGWarning

    for adapter in ADAPTERS:
        if adapter.matches(pipe):
            if not adapter.is_tested(pipe):
                logger.info("%s uses the %s adapter but is not in its tested set", type(pipe).__name__, adapter.name)
            return adapter
    if all(getattr(pipe, name, None) is None for name in TRANSFORMERS):
        raise TypeError(
            f"{type(pipe).__name__} has no `transformer` component; bcg-diffusion accelerates transformer-based "
            f"pipelines ({', '.join(a.name for a in ADAPTERS)} are tested)"
        )
    warnings.warn(
        f"bcg-diffusion has no adapter for {type(pipe).__name__}; using the generic one (transformer forward, "
        "VAE decode and a Qwen3 text encoder as graphs, any capture failure falls back to eager). "
        "Images should still be exact: check with debug=True and stats().",
        BCGWarning,
        stacklevel=3,
    )
    return PipelineAdapter()
