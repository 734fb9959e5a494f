"""Fast mode: the transformer's repeated blocks compiled by inductor, inside the graphs.

The compiling itself is :mod:`bcg_diffusion.fast`; this feature decides when it applies (``mode="fast"``
with the transformer accelerated; under context parallelism the blocks compile as regions between the
collectives, which stay eager breaks), applies the adapter's fast-mode
processor patches first (scoped to this model), keeps a portable copy of the compile caches after each
call that compiled, and reports the compiles. Without blocks to compile, the pipeline keeps exact-mode
graphs and says so.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from .. import fast
from ..hooks import MethodPatches
from ..runner import BCGWarning
from .base import Feature, Setup, Target

__all__ = ["CompiledBlocks"]

logger = logging.getLogger(__name__)


class CompiledBlocks(Feature):
    name = "compiled blocks"
    component = "transformer"
    defaults = {
        "compiled_blocks": 0,
        "compiles": 0,
        "compile_seconds": 0.0,
        "compile_failure": None,
        "eager_block_calls": 0,
    }

    def __init__(self, cache_dir: str | None, breaks_inside: bool = False) -> None:
        self.cache_dir = cache_dir
        # Under context parallelism the collectives stay eager breaks inside the blocks: compiled
        # regions between them (dynamo breaks its graph there), not one graph per block.
        self.breaks_inside = breaks_inside
        self.compiled: fast.CompiledBlocks | None = None
        self.scoped_patches: list[str] = []
        self.compiles_saved = 0  # compiles when the portable compile cache was last written

    @classmethod
    def create(cls, setup: Setup) -> CompiledBlocks | None:
        if setup.config.mode != "fast":
            return None
        if "transformer" not in setup.accelerated:
            _fall_back("fast mode compiles the transformer, which is not among the accelerated components")
            return None
        return cls(setup.config.compile_cache_dir, breaks_inside=setup.layout is not None)

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        transformer = setup.modules["transformer"]
        if self.cache_dir is not None:
            fast.use_compile_cache_dir(self.cache_dir)
        for patch in setup.adapter.fast_patches:
            try:
                if patch.apply(transformer, patches):
                    self.scoped_patches.append(patch.name)
                    setup.attention_kwargs.update(patch.accepts)
            except ValueError as exc:
                warnings.warn(f"bcg-diffusion: fast-mode patch {patch.name} skipped: {exc}", BCGWarning, stacklevel=4)
        try:
            self.compiled = fast.compile_repeated_blocks(transformer, patches, fullgraph=not self.breaks_inside)
        except ValueError as exc:
            _fall_back(str(exc))
            return
        logger.info("fast mode: compiling %d blocks of %s", len(self.compiled.names), type(transformer).__name__)

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != "transformer" or self.compiled is None:
            return call
        compiled = self.compiled

        def saving_compile_cache(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            if compiled.compiles != self.compiles_saved:  # one comparison on a replayed step
                self._save_compile_cache()
            return result

        return saving_compile_cache

    def _save_compile_cache(self) -> None:
        """After a call that compiled something, keep a portable copy of the compile caches."""
        self.compiles_saved = self.compiled.compiles
        if self.cache_dir is None:
            return
        try:
            fast.save_compile_cache(f"{self.cache_dir}/{fast.ARTIFACTS_FILE}")
        except OSError as exc:
            warnings.warn(
                f"bcg-diffusion: could not save the compile cache in {self.cache_dir}: {exc}", BCGWarning, stacklevel=4
            )

    def stats(self) -> dict[str, Any]:
        if self.compiled is None:
            return {}
        return {
            "compiled_blocks": len(self.compiled.names),
            "compiles": self.compiled.compiles,
            "compile_seconds": self.compiled.compile_seconds,
            "compile_failure": self.compiled.failure,
            "eager_block_calls": self.compiled.eager_calls,
        }

    def patch_names(self) -> list[str]:
        return list(self.scoped_patches)


def _fall_back(reason: str) -> None:
    warnings.warn(
        f"bcg-diffusion: mode='fast' falls back to graphs of the eager blocks (not compiled): {reason}",
        BCGWarning,
        stacklevel=5,
    )
