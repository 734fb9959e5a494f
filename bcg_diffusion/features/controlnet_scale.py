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
signature). Also to the wrappers of several ControlNets of :data:`ONE_CONDITION` (``FluxMultiControlNetModel``, as
InstantX's FLUX.1 Union ControlNet card loads it; SD3's, Qwen-Image's) called with one condition, so a list of one
scale: their forward then returns their first ControlNet's output as it is, whose forward must be the one read too.
With several conditions a wrapper sums each ControlNet's scaled samples, and the list of scales keys its
graphs. Not to a ControlNet whose class overrides the forward, or one wrapped by diffusers' hooks. A scale given
as a tensor goes into the graph as one; a scale of any other type than ``int`` or ``float`` passes as it is.
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

__all__ = ["CONTROLNET_SCALE", "ONE_CONDITION", "SCALED_LAST", "ControlNetScale"]

CONTROLNET_SCALE = "controlnet scale after its graphs"  # its name in stats()["patches"]

# The ControlNet forwards whose only use of ``conditioning_scale`` is their last computation, ``sample *
# conditioning_scale`` on every tensor they return: dotted path -> its entry in patches.followed.FOLLOWED.
SCALED_LAST = {
    path: name for name, paths in FOLLOWED.items() if name.startswith("controlnet scale (") for path in paths
}
# The wrappers of several ControlNets whose forward, given one condition, calls their first ControlNet and returns
# its output as it is: the wrapper's forward -> its entry in FOLLOWED, whose second path is that ControlNet's forward.
ONE_CONDITION = {
    next(iter(paths)): name for name, paths in FOLLOWED.items() if name.startswith("controlnet scale, one condition")
}
_ARGUMENT = "conditioning_scale"

logger = logging.getLogger(__name__)


def _runs(forward: Callable[..., Any], path: str) -> bool:
    """Whether ``forward`` (a bound method) runs the function at ``path`` (False where diffusers has none)."""
    function = getattr(forward, "__func__", None)
    try:
        return function is not None and function is resolve(path)
    except (ImportError, AttributeError):
        return False  # a diffusers without that ControlNet


def _followed_name(forward: Callable[..., Any], table: dict[str, str]) -> str | None:
    """The entry of ``table`` (:data:`SCALED_LAST` or :data:`ONE_CONDITION`) whose function ``forward`` runs, or
    None."""
    return next((name for path, name in table.items() if _runs(forward, path)), None)


def _first_net_reason(module: Any, name: str) -> str | None:
    """Why a wrapper of several ControlNets (``module``, whose forward is :data:`ONE_CONDITION`'s entry ``name``)
    cannot have its scale applied after its graphs: its first ControlNet's forward is not the one that entry
    read (a subclass's own, diffusers' hooks). None where it is."""
    nets = getattr(module, "nets", None)
    net_forward = list(FOLLOWED[name])[1]
    if not nets or not _runs(nets[0].forward, net_forward):
        return f"its first ControlNet's forward is not {net_forward}"
    return None


def _one(scales: Any) -> Any:
    """The one scale of a list or tuple of one, else None."""
    return scales[0] if isinstance(scales, list | tuple) and len(scales) == 1 else None


class ControlNetScale(Feature):
    name = "controlnet scale"
    component = "controlnet"

    def __init__(self) -> None:
        self.applied = False

    @classmethod
    def create(cls, setup: Setup) -> ControlNetScale | None:
        return cls() if cls.component in setup.accelerated else None

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        label = type(target.module).__name__
        followed, several = _followed_name(target.original, SCALED_LAST), False
        if followed is None:  # a wrapper of several ControlNets, perhaps
            followed = _followed_name(target.original, ONE_CONDITION)
            several = followed is not None
        reason = "its forward is not one read" if followed is None else None
        if several and reason is None:
            reason = _first_net_reason(target.module, followed)
        if reason is not None:
            logger.info("%s keys its graphs on its conditioning scale: %s", label, reason)
            return call
        if not installable(followed, stacklevel=5):
            return call
        position = list(inspect.signature(target.original).parameters).index(_ARGUMENT)
        unit = [1.0] if several else 1.0  # what the graphs are called with
        self.applied = True

        def scaled_after(*args: Any, **kwargs: Any) -> Any:
            positional = len(args) > position
            given = args[position] if positional else kwargs.get(_ARGUMENT, 1.0)
            scale = _one(given) if several else given
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                return call(*args, **kwargs)  # a tensor (an input of the graph), several scales, another type
            if several and _first_net_reason(target.module, followed) is not None:
                return call(*args, **kwargs)  # its first ControlNet replaced since: the scale stays in the key
            if positional:
                args = (*args[:position], unit, *args[position + 1 :])
            else:
                kwargs = {**kwargs, _ARGUMENT: unit}
            outputs = call(*args, **kwargs)
            if scale == 1.0:
                return outputs
            samples, spec = flatten(outputs)
            return unflatten(spec, [sample * scale for sample in samples])

        return scaled_after

    def patch_names(self) -> list[str]:
        return [CONTROLNET_SCALE] if self.applied else []
