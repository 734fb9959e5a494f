"""bcg-diffusion: breakable CUDA graphs for HuggingFace Diffusers pipelines.

>>> from bcg_diffusion import accelerate, restore, stats
>>> pipe = accelerate(pipe)        # doctest: +SKIP
"""

from .api import accelerate, eager, invalidate, restore, stats
from .config import AccelerateConfig
from .core.graphs import BreakResultMismatch, eager_break
from .core.runner import BCGWarning
from .features.step_caching import SkipCounter, disable_cache, enable_cache
from .warmup import warm_up

__all__ = [
    "AccelerateConfig",
    "BCGWarning",
    "BreakResultMismatch",
    "SkipCounter",
    "accelerate",
    "disable_cache",
    "eager",
    "eager_break",
    "enable_cache",
    "invalidate",
    "restore",
    "stats",
    "warm_up",
]

__version__ = "0.1.0"
