"""Pipelines this package builds itself, with no download: tiny random ones for CPU tests and full-size
architectures with random weights for GPU latency (:mod:`.builders`), with a tokenizer made in code
(:mod:`.tokenizer`). Real checkpoints load through the same :func:`build_pipeline`.

>>> from bcg_diffusion.models import build_pipeline
>>> pipe = build_pipeline("z-image", "tiny")   # a CPU call takes about a second    # doctest: +SKIP
"""

from .builders import DEFAULT_PROMPTS, PIPELINE_NAMES, RANDOM_WEIGHTS, build_pipeline

__all__ = ["DEFAULT_PROMPTS", "PIPELINE_NAMES", "RANDOM_WEIGHTS", "build_pipeline"]
