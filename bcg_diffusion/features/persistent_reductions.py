"""Fast mode's one change to inductor's heuristics: a norm over a row of up to 4,096 elements reads it once.

Inductor writes a row reduction as a *persistent* kernel (the whole row in one program, read once) only
up to 1,024 elements; longer rows loop, reading each row twice for a norm (statistics, then the
normalization). The blocks' LayerNorms and RMSNorms with their modulation run over the model width:
3,072 for Qwen-Image, 3,840 for Z-Image. Widened to 4,096 (H200, ``bench.probes.probe_attention_kernels
--sections reductions``):

* Qwen-Image 1024², CFG batch, its two LayerNorm-with-modulation kernels 0.076 + 0.062 ms → 0.044 +
  0.052 ms, one block 4031 → 3983 µs in bf16; with FP8 (the row scales fused in) 0.101 + 0.082 ms →
  0.067 + 0.062 ms;
* the feed-forward's 10,240 to 12,288-element rows stay looped: persistent, the FP8 GELU-and-scale
  kernel took 0.428 ms instead of 0.371 ms, hence the limit.

Persistent reductions sum a row in another order, so bytes differ from inductor's default, as fast mode
allows (its contract is with its own compiled blocks). The setting applies only while our blocks compile
(:func:`widened`), through inductor's documented hook for its heuristics (``V.set_choices_handler``); where
inductor takes a choices class as a setting (``inductor_choices_class``), :func:`inductor_options` names it,
so compile caches keep kernels made under other heuristics apart.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

ROW_LIMIT = 4096  # elements per row; the next power of two above both models' widths

__all__ = ["ROW_LIMIT", "available", "choices_class", "inductor_options", "widened"]


def choices_class(row_limit: int = ROW_LIMIT) -> type:
    """Inductor's ``InductorChoices`` with persistent row reductions up to ``row_limit`` elements (one class
    per limit, built on first use: importing inductor costs seconds; other limits are for probes)."""
    return _choices_class(row_limit)


@functools.cache
def _choices_class(row_limit: int) -> type:
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    default = InductorChoices.should_use_persistent_reduction

    class WiderPersistentReductions(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if default(features, cooperative_reduction):
                return True
            if cooperative_reduction or not config.triton.persistent_reductions:
                return False
            if features.get_reduction_hint() != ReductionHint.INNER:
                return False
            # torch 2.14 and later cap a persistent row at a strict-reduction block size (deterministic sums):
            # keep that cap (2.14 names it strict_sum_*, 2.15 strict_reduction_* / strict_multirow_*)
            rblock, multirow = _strict_reduction(features)
            if (
                rblock is not None
                and not multirow
                and not V.graph.sizevars.statically_known_geq(rblock, features.reduction_numel)
            ):
                return False
            return V.graph.sizevars.statically_known_leq(features.reduction_numel, row_limit)

        def uuid(self) -> str:  # what torch 2.13's compile caches key on (inductor_choices_class)
            return f"bcg-diffusion-persistent-reductions-{row_limit}"

    # torch 2.11 pickles the class itself into its compile caches' key, by reference: a class that cannot
    # be found by its module and name makes inductor bypass its graph cache (every process compiles again)
    name = f"{_CLASS_PREFIX}{row_limit}"
    WiderPersistentReductions.__name__ = WiderPersistentReductions.__qualname__ = name
    WiderPersistentReductions.__module__ = __name__
    globals()[name] = WiderPersistentReductions
    return WiderPersistentReductions


_CLASS_PREFIX = "WiderPersistentReductions"


def _strict_reduction(features: Any) -> tuple[Any, bool]:
    """The strict-reduction block size the kernel's features ask for (None: none, or a torch before 2.14) and
    whether they allow several rows per block, under either name torch has given them."""
    for rblock, multirow in (
        ("strict_reduction_rblock", "has_strict_multirow_reduction"),
        ("strict_sum_rblock", "has_strict_sum_multirow_reduction"),
    ):
        if hasattr(features, rblock):
            return getattr(features, rblock)(), getattr(features, multirow)()
    return None, False


def __getattr__(name: str) -> type:
    """A choices class by its pickled name (``WiderPersistentReductions4096``), built on first use."""
    limit = name.removeprefix(_CLASS_PREFIX)
    if name.startswith(_CLASS_PREFIX) and limit.isdigit():
        return _choices_class(int(limit))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def available() -> bool:
    """Whether this torch's inductor has the heuristic to widen (``InductorChoices.should_use_persistent_reduction``,
    a static method taking the kernel's features and whether the reduction is cooperative); asked once."""
    try:
        from torch._inductor.choices import InductorChoices
    except ImportError:
        return False
    return isinstance(InductorChoices.__dict__.get("should_use_persistent_reduction"), staticmethod)


def widened(row_limit: int = ROW_LIMIT) -> contextlib.AbstractContextManager[Any]:
    """A context in which inductor compiles with :func:`choices_class`'s heuristics (this thread only;
    the handler in place before comes back on exit). Without the heuristic to widen, a null context.
    Entered at every compiled block call that runs Python (not at graph replays): about 25 µs on a CPU,
    beside about 200 µs for dynamo's own settings there."""
    if not available():
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_choices_handler(choices_class(row_limit)())


def inductor_options() -> dict[str, Any]:
    """``torch.compile`` options that name the heuristics in the compile caches' key, where inductor has
    the setting (``inductor_choices_class``); else none."""
    from torch._inductor import config

    if not available() or not hasattr(config, "inductor_choices_class"):
        return {}
    return {"inductor_choices_class": choices_class()}
