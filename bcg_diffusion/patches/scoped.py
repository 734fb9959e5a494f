"""Patches scoped to one model's attention processors, for fast mode.

A :class:`~bcg_diffusion.patches.FunctionPatch` swaps a module-level function for the whole process.
That is right for exact device-side equivalents, but fast-mode patches change rounding, and an eager
or exact-mode pipeline in the same process must keep diffusers' own arithmetic. So a
:class:`ProcessorPatch` gives each attention module of one model its own processor whose ``__call__``
runs diffusers' code unchanged except that chosen global names resolve to our functions, optionally
wrapped by a ``__call__`` of ours that takes extra keyword arguments.
"""

from __future__ import annotations

import copy
import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.hooks import MethodPatches
from .followed import FOLLOWED, installable

__all__ = ["ProcessorPatch"]

logger = logging.getLogger(__name__)


def _with_globals(fn: types.FunctionType, replacements: dict[str, Any]) -> types.FunctionType:
    """``fn``'s own code with a copy of its globals in which ``replacements`` are bound."""
    namespace = dict(fn.__globals__)
    namespace.update(replacements)
    rebound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(rebound, fn)


@dataclass(eq=False)
class ProcessorPatch:
    """Give every attention processor of class ``processor_class`` inside a model a ``__call__`` whose
    globals named in ``replacements`` are ours.

    Args:
        name: short name for logs and stats.
        processor_class: the processor class name (as diffusers spells it) to patch.
        processor_module: the module that defines that class (None: any). Needed where diffusers defines
            classes of one name in several modules (``WanAttnProcessor``: Wan's, Wan-Animate's, ChronoEdit's).
        replacements: global name in the processor's module -> our function.
        wrap_call: optional; takes the (rebound) ``__call__`` and returns the one to install, which
            may accept the keyword arguments named in ``accepts`` on top of the original's (diffusers'
            ``Attention`` passes a processor only the keyword arguments its signature names).
        accepts: the extra keyword arguments ``wrap_call``'s ``__call__`` takes.
        condition: optional; given the model, says why the patch does not apply to it (None: it does),
            e.g. a kernel that only pays off on some GPUs.
    """

    name: str
    processor_class: str
    processor_module: str | None = None
    replacements: dict[str, Callable[..., Any]] = field(default_factory=dict)
    wrap_call: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    accepts: tuple[str, ...] = ()
    condition: Callable[[torch.nn.Module], str | None] | None = None
    _subclasses: dict[type, type] = field(default_factory=dict, repr=False)

    def _subclass(self, cls: type) -> type:
        if cls not in self._subclasses:
            missing = [n for n in self.replacements if n not in cls.__call__.__globals__]
            if missing:
                raise ValueError(f"{cls.__name__}.__call__ does not use {missing}: diffusers changed; patch skipped")
            call = _with_globals(cls.__call__, self.replacements) if self.replacements else cls.__call__
            if self.wrap_call is not None:
                call = self.wrap_call(call)  # not functools.wraps: its __wrapped__ would hide the new signature
            self._subclasses[cls] = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__})
        return self._subclasses[cls]

    def _matches(self, processor: Any) -> bool:
        cls = type(processor)
        return cls.__name__ == self.processor_class and self.processor_module in (None, cls.__module__)

    def apply(self, model: torch.nn.Module, patches: MethodPatches) -> int:
        """Patch ``model``'s matching processors (recorded in ``patches``); returns how many.

        Returns 0 (and logs why) when ``condition`` says the patch does not apply to ``model``, and (with a
        warning) when the processor's code is not the code the patch was written for
        (:mod:`bcg_diffusion.patches.followed`). Raises ValueError when the processor's code no longer uses
        the names we replace.
        """
        reason = None if self.condition is None else self.condition(model)
        if reason is not None:
            logger.info("patch %s not applied to %s: %s", self.name, type(model).__name__, reason)
            return 0
        matching = [module for module in model.modules() if self._matches(module.__dict__.get("processor"))]
        if not matching or (self.name in FOLLOWED and not installable(self.name, stacklevel=4)):
            return 0  # nothing to patch, or diffusers' processor is not the code ours rearranges
        count = 0
        for module in matching:
            processor = module.__dict__["processor"]
            scoped = copy.copy(processor)
            scoped.__class__ = self._subclass(type(processor))
            patches.replace(module, "processor", scoped)
            count += 1
        return count
