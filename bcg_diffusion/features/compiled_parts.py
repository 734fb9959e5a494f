"""Fast mode: chosen modules of one accelerated component compiled by inductor, inside its graphs.

The shape that the text encoders' layers (:mod:`.compiled_text_encoder`) and a ControlNet's blocks
(:mod:`.compiled_controlnet`) share: a subclass says which modules of its component compile (:meth:`CompiledParts.parts`),
and this base compiles them as the transformer's blocks compile (:func:`~.compiled_blocks.compile_modules`), lets the
user keep them eager (:func:`set_choice`, through each module's ``choose``), and reports ``{component}_compiles``,
``{component}_compile_seconds`` and ``{component}_compile_failure`` (:func:`compile_defaults` where it did not apply).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from ..core.hooks import MethodPatches
from .base import Feature, Setup
from .compiled_blocks import BlockCompiles, compile_modules

__all__ = ["CompiledParts", "compile_defaults", "set_choice"]

logger = logging.getLogger(__name__)


def compile_defaults(component: str) -> dict[str, Any]:
    """The ``stats()`` entries of ``component``'s compiles where nothing compiled (none, no time, no failure)."""
    return BlockCompiles().report(f"{component}_")


def set_choice(module: torch.nn.Module, attribute: str, compiled: bool) -> None:
    """Record on ``module`` whether fast mode may compile its parts (True) or keeps them eager (False). Raises
    TypeError for anything but True or False."""
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be True or False, got {compiled!r}")
    setattr(module, attribute, compiled)


class CompiledParts(Feature):
    """Applies in fast mode to its accelerated ``component``, unless :attr:`choice` on the module is False.

    Class attributes (besides :class:`~.base.Feature`'s): ``choice``, the module attribute :func:`set_choice`
    writes; ``patch_name``, its name in ``stats()["patches"]`` once something compiled.
    """

    choice: ClassVar[str] = ""
    patch_name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.compiled: BlockCompiles | None = None

    @classmethod
    def create(cls, setup: Setup) -> CompiledParts | None:
        return cls() if setup.config.mode == "fast" and cls.component in setup.accelerated else None

    def parts(self, setup: Setup, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The ``(name, module)`` pairs of ``module`` to compile; empty (after a log line saying why) for none."""
        raise NotImplementedError

    def prepare(self, setup: Setup, patches: MethodPatches) -> None:
        module = setup.modules[self.component]
        if getattr(module, self.choice, True) is False:
            return
        parts = self.parts(setup, module)
        if parts:
            self.compiled = compile_modules(parts, patches)
            logger.info("fast mode: compiling %d parts of %s (%s)", len(parts), type(module).__name__, self.component)

    def stats(self) -> dict[str, Any]:
        return {} if self.compiled is None else self.compiled.report(f"{self.component}_")

    def patch_names(self) -> list[str]:
        return [] if self.compiled is None else [self.patch_name]
