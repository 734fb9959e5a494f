"""Reversible, reference-counted monkey-patches of graph-hostile diffusers internals.

A patch replaces a module-level function with a device-side equivalent that gives the same result
(tested exactly against the original) but can be captured in a CUDA graph. Patches are process-wide:
the first accelerated pipeline that needs one applies it, the last one restored reverts it.

Fast mode's patches (``scoped``, ``rope``, ``attention``, ``group_norm``) round differently from the
original, so they are instance patches of one accelerated model, undone by ``restore``.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .followed import FOLLOWED, installable

__all__ = ["FunctionPatch"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class FunctionPatch:
    """Replace ``attribute`` in each of ``modules`` by ``replacement`` while at least one user holds it.

    Args:
        name: short name for logs and stats.
        modules: dotted module paths that bind the function by name (the defining module and every
            module that imported it with ``from ... import``).
        attribute: the function's name in those modules.
        replacement: the device-side equivalent.

    ``apply()`` returns False (and logs why) when none of the modules has the attribute, e.g. a
    diffusers version that renamed it, and (with a warning) when the function it replaces is not the code
    the replacement was written for (:mod:`bcg_diffusion.patches.followed`); the caller then relies on the
    original function and the runner's automatic breaks.
    """

    name: str
    modules: tuple[str, ...]
    attribute: str
    replacement: Callable[..., Any]
    _originals: dict[str, Any] = field(default_factory=dict, repr=False)
    _users: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def original(self) -> Callable[..., Any]:
        """The unpatched function (for tests that compare against it)."""
        if self._originals:
            return next(iter(self._originals.values()))
        module = importlib.import_module(self.modules[0])
        return getattr(module, self.attribute)

    def apply(self) -> bool:
        with self._lock:
            if self._users == 0:
                if self.name in FOLLOWED and not installable(self.name, stacklevel=4):
                    return False  # diffusers' function is not the one ours copies: theirs runs, with a warning
                for path in self.modules:
                    try:
                        module = importlib.import_module(path)
                    except ImportError as exc:
                        logger.info("patch %s: module %s not importable (%s); skipped", self.name, path, exc)
                        continue
                    if not hasattr(module, self.attribute):
                        logger.info("patch %s: %s has no %s; skipped", self.name, path, self.attribute)
                        continue
                    self._originals[path] = getattr(module, self.attribute)
                    setattr(module, self.attribute, self.replacement)
                if not self._originals:
                    logger.warning("patch %s found nothing to patch in %s", self.name, self.modules)
                    return False
            self._users += 1
            return True

    def revert(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                for path, original in self._originals.items():
                    setattr(importlib.import_module(path), self.attribute, original)
                self._originals.clear()

    @property
    def active(self) -> bool:
        return self._users > 0
