"""Quantization: ``quantize="fp8"`` (or a torchao config) on the transformer before its graphs exist.

The work is :mod:`bcg_diffusion.quantize` (torchao's ``quantize_`` with our default filter); this
feature runs it before fast mode compiles the blocks, reports what it did, and gives the original
weights back on ``restore``. A quantization that fails midway has given them back itself before its
error leaves ``prepare`` (:func:`~bcg_diffusion.quantize.quantize_transformer`), so ``accelerate``
undoes the rest and raises it with the transformer as it was; ``close`` then has nothing to give back.
A transformer quantized by the user beforehand needs no feature: its weights are reported
(``stats()["quantized"]``) and captured as they are.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..hooks import MethodPatches
from ..quantize import Quantized, dequantize, quantize_transformer, quantized_weights
from ..runner import BCGWarning
from .base import Feature, Setup

__all__ = ["Quantization"]


class Quantization(Feature):
    name = "quantization"
    component = "transformer"
    defaults = {"quantized": None, "quantized_linears": 0}

    def __init__(self, setup: Setup) -> None:
        self.module = setup.modules["transformer"]
        self.option = setup.config.quantize
        self.filter = setup.config.quantize_filter
        self.done: Quantized | None = None

    @classmethod
    def create(cls, setup: Setup) -> Quantization | None:
        if setup.config.quantize is None and not quantized_weights(setup.modules["transformer"]):
            return None
        if setup.config.quantize is not None and "transformer" not in setup.accelerated:
            warnings.warn(
                "bcg-diffusion: quantize= applies to an accelerated transformer; it is not in components",
                BCGWarning,
                stacklevel=4,
            )
            return None
        return cls(setup)

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        # On failure quantize_transformer gives the weights back before raising: self.done stays None.
        if self.option is not None:
            self.done = quantize_transformer(self.module, self.option, self.filter)

    def stats(self) -> dict[str, Any]:
        if self.done is not None:
            return {"quantized": repr(self.done.config), "quantized_linears": len(self.done.names)}
        counts = quantized_weights(self.module)
        described = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
        return {"quantized": f"before accelerate: {described}" if counts else None}

    def close(self) -> None:
        if self.done is not None:
            dequantize(self.done)
            self.done = None
