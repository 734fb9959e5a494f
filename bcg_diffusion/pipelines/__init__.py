"""Per-pipeline adapters and the registry that picks one for a pipeline object."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from .base import PipelineAdapter
from .qwenimage import QwenImageAdapter
from .zimage import ZImageAdapter

__all__ = ["ADAPTERS", "PipelineAdapter", "adapter_for"]

logger = logging.getLogger(__name__)

ADAPTERS: tuple[PipelineAdapter, ...] = (QwenImageAdapter(), ZImageAdapter())


def adapter_for(pipe: Any) -> PipelineAdapter:
    """The adapter serving ``pipe``; the generic adapter (with a warning) for an unknown pipeline that
    has a ``transformer``.

    Raises:
        TypeError: ``pipe`` has no ``transformer`` component (UNet pipelines are not supported).
    """
    from ..core.runner import BCGWarning

    for adapter in ADAPTERS:
        if adapter.matches(pipe):
            if not adapter.is_tested(pipe):
                logger.info("%s uses the %s adapter but is not in its tested set", type(pipe).__name__, adapter.name)
            return adapter
    if getattr(pipe, "transformer", None) is None:
        raise TypeError(
            f"{type(pipe).__name__} has no `transformer` component; bcg-diffusion accelerates transformer-based "
            f"pipelines ({', '.join(a.name for a in ADAPTERS)} are tested)"
        )
    warnings.warn(
        f"bcg-diffusion has no adapter for {type(pipe).__name__}; using the generic one (transformer forward and "
        "VAE decode as graphs, any capture failure falls back to eager). Images should still be exact: check with "
        "debug=True and stats().",
        BCGWarning,
        stacklevel=3,
    )
    return PipelineAdapter()
