"""A ControlNet's conditioning scale applied after its graphs: one capture serves every scale.

diffusers' single ControlNets end their forward by multiplying each sample they return by
``conditioning_scale``, a Python float. A graph replays the float it was captured with, so the runner would key
the ControlNet's graphs on it: every new scale (a slider in a demo, and 0.0 for the steps after a pipeline's
``control_guidance_end``) would capture again and keep that graph's memory until ``max_signatures`` evicts it.

Instead the runner is called with ``conditioning_scale=1.0`` and each tensor it returns is multiplied by the
call's scale afterwards, eagerly: one small kernel per sample it returns (six a step for a six-block FLUX.1
ControlNet). The bytes are eager's: multiplying by 1.0 gives every value back as it was, and the multiplication
afterwards is the forward's own last computation, the same operation on the same operands. A scale of 1.0 adds
nothing.

Applies, in both modes, to an accelerated ControlNet whose forward is one of :data:`SCALED_LAST` and is the code
it was read from (:mod:`bcg_diffusion.patches.followed`; changed code warns and keeps the scale in the
signature). Not to a ControlNet whose class overrides the forward, one wrapped by diffusers' hooks, or the
wrappers of several ControlNets (``FluxMultiControlNetModel``...), whose forward sums each ControlNet's scaled
samples: a list of scales keys their graphs. A scale given as a tensor goes into the graph as one; a scale
of any other type than ``int`` or ``float`` passes as it is.
``stats()["patches"]`` names it where it applies.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from ..core.tree import flatten, unflatten
from ..patches.followed import FOLLOWED, installable, resolve
from .base import Feature, Setup, Target

__all__ = ["CONTROLNET_SCALE", "SCALED_LAST", "ControlNetScale"]

CONTROLNET_SCALE = "controlnet scale after its graphs"  # its name in stats()["patches"]

# The ControlNet forwards whose only use of ``conditioning_scale`` is their last computation, ``sample *
# conditioning_scale`` on every tensor they return: dotted path -> its entry in patches.followed.FOLLOWED.
SCALED_LAST = {
    path: name for name, paths in FOLLOWED.items() if name.startswith("controlnet scale (") for path in paths
}
_ARGUMENT = "conditioning_scale"

logger = logging.getLogger(__name__)


def _followed_name(forward: Callable[..., Any]) -> str | None:
    """The :data:`SCALED_LAST` entry whose function ``forward`` (a bound method) runs, or None."""
    function = getattr(forward, "__func__", None)
    for path, name in SCALED_LAST.items():
        try:
            if function is not None and function is resolve(path):
                return name
        except (ImportError, AttributeError):
            continue  # a diffusers without that ControlNet
    return None


class ControlNetScale(Feature):
    name = "controlnet scale"
    component = "controlnet"

    def __init__(self) -> None:
        self.applied = False

    @classmethod
    def create(cls, setup: Setup) -> ControlNetScale | None:
        return cls() if cls.component in setup.accelerated else None

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        followed = _followed_name(target.original)
        if followed is None:
            logger.info("%s keys its graphs on its conditioning scale", type(target.module).__name__)
            return call
        if not installable(followed, stacklevel=5):
            return call
        position = list(inspect.signature(target.original).parameters).index(_ARGUMENT)
        self.applied = True

        def scaled_after(*args: Any, **kwargs: Any) -> Any:
            positional = len(args) > position
            scale = args[position] if positional else kwargs.get(_ARGUMENT, 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                return call(*args, **kwargs)  # a tensor (an input of the graph) or another type: as it is
            if positional:
                args = (*args[:position], 1.0, *args[position + 1 :])
            else:
                kwargs = {**kwargs, _ARGUMENT: 1.0}
            outputs = call(*args, **kwargs)
            if scale == 1.0:
                return outputs
            samples, spec = flatten(outputs)
            return unflatten(spec, [sample * scale for sample in samples])

        return scaled_after

    def patch_names(self) -> list[str]:
        return [CONTROLNET_SCALE] if self.applied else []
