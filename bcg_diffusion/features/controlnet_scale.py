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
signature). Also to the wrappers of several ControlNets (FLUX.1's ``FluxMultiControlNetModel``, as InstantX's
FLUX.1 Union ControlNet card loads one; SD3's; Qwen-Image's), whose forward calls a ControlNet per condition and
sums their scaled samples: their graphs run each condition's ControlNet at scale 1.0 and return the outputs apart;
each is multiplied by its condition's scale and they are summed after the graphs, as the wrapper sums them
(:mod:`bcg_diffusion.patches.multi_controlnet`). One capture serves every list of scales of one length. Each
ControlNet a wrapper calls must run the forward read too, or the scales go into the graphs.

Not to a ControlNet whose class overrides the forward, or one wrapped by diffusers' hooks. A scale given as a
tensor goes into the graph as one; a scale of any other type than ``int`` or ``float`` passes as it is.
``stats()["patches"]`` names it where it applies.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Hashable
from typing import Any

from ..core.tree import flatten, unflatten
from ..patches import multi_controlnet
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


def _runs(forward: Callable[..., Any], path: str) -> bool:
    """Whether ``forward`` (a bound method) runs the function at ``path`` (False where diffusers has none)."""
    function = getattr(forward, "__func__", None)
    try:
        return function is not None and function is resolve(path)
    except (ImportError, AttributeError):
        return False  # a diffusers without that ControlNet


def _followed_name(forward: Callable[..., Any]) -> str | None:
    """The :data:`SCALED_LAST` entry whose function ``forward`` runs, or None."""
    return next((name for path, name in SCALED_LAST.items() if _runs(forward, path)), None)


def _sized(scales: Any) -> bool:
    """Whether ``scales`` is a list or tuple: the scales of a wrapper of several ControlNets."""
    return isinstance(scales, list | tuple)


def _with_scale(args: tuple, kwargs: dict[str, Any], position: int, scale: Any) -> tuple[tuple, dict[str, Any]]:
    """A call's arguments with ``scale`` as its conditioning scale, given by position (``position``) or by name
    as the call gave it."""
    if len(args) > position:
        return (*args[:position], scale, *args[position + 1 :]), kwargs
    return args, {**kwargs, _ARGUMENT: scale}


def _number(scale: Any) -> bool:
    """Whether ``scale`` is a Python number, which a graph would replay as the constant it was captured with (a
    tensor is an input of the graph; a bool is left as it is)."""
    return isinstance(scale, int | float) and not isinstance(scale, bool)


def _scaled(outputs: Any, scale: float) -> Any:
    """``outputs`` with every tensor multiplied by ``scale``, as the ControlNet's forward ends (1.0: as they are)."""
    if scale == 1.0:
        return outputs
    samples, spec = flatten(outputs)
    return unflatten(spec, [sample * scale for sample in samples])


class ControlNetScale(Feature):
    name = "controlnet scale"
    component = "controlnet"

    def __init__(self) -> None:
        self.applied = False
        self.split: multi_controlnet.Split | None = None  # a wrapper of several: its forward in two halves

    @classmethod
    def create(cls, setup: Setup) -> ControlNetScale | None:
        return cls() if cls.component in setup.accelerated else None

    def runner_fn(
        self, target: Target, fn: Callable[..., Any], state_key: Callable[[], Hashable] | None
    ) -> tuple[Callable[..., Any], Callable[[], Hashable] | None]:
        if target.component != self.component:
            return fn, state_key
        split = next((split for path, split in multi_controlnet.SPLITS.items() if _runs(fn, path)), None)
        if split is not None and installable(split.followed, stacklevel=5):
            self.split = split
            return split.each_condition(target.module), state_key
        return fn, state_key

    def wrap_call(self, target: Target, call: Callable[..., Any]) -> Callable[..., Any]:
        if target.component != self.component:  # every runner's call passes through each feature
            return call
        if self.split is not None:
            return self._each_condition(target, call, self.split)
        followed = _followed_name(target.original)
        if followed is None:
            logger.info("%s keys its graphs on its conditioning scale", type(target.module).__name__)
            return call
        if not installable(followed, stacklevel=5):
            return call
        position = list(inspect.signature(target.original).parameters).index(_ARGUMENT)
        self.applied = True

        def scaled_after(*args: Any, **kwargs: Any) -> Any:
            scale = args[position] if len(args) > position else kwargs.get(_ARGUMENT, 1.0)
            if not _number(scale):
                return call(*args, **kwargs)  # a tensor (an input of the graph) or another type: as it is
            args, kwargs = _with_scale(args, kwargs, position, 1.0)
            return _scaled(call(*args, **kwargs), scale)

        return scaled_after

    def _each_condition(
        self, target: Target, call: Callable[..., Any], split: multi_controlnet.Split
    ) -> Callable[..., Any]:
        """A wrapper of several ControlNets, whose runner returns each condition's ControlNet output
        (``split.each_condition``): called with every scale 1.0 where each scale is a Python number and each
        ControlNet called runs the forward read, each output then multiplied by its condition's scale; else with
        the scales as given. Either way the outputs are summed after the graphs (``split.summed``)."""
        position = list(inspect.signature(target.original).parameters).index(_ARGUMENT)
        # resolved once here, not on every call: this runs before each of the ControlNet's replays
        net_forward = resolve(list(FOLLOWED[split.followed])[1])
        self.applied = True

        def scaled_after_each(*args: Any, **kwargs: Any) -> Any:
            given = args[position] if len(args) > position else kwargs.get(_ARGUMENT)
            scales = list(given) if _sized(given) and all(map(_number, given)) else None
            nets = split.nets(target.module, len(scales)) if scales is not None else []
            if scales is None or any(getattr(net.forward, "__func__", None) is not net_forward for net in nets):
                return split.summed(call(*args, **kwargs))  # the scales go into the graphs
            args, kwargs = _with_scale(args, kwargs, position, [1.0] * len(scales))
            outputs = call(*args, **kwargs)
            return split.summed([_scaled(output, scale) for output, scale in zip(outputs, scales)])

        return scaled_after_each

    def patch_names(self) -> list[str]:
        return [CONTROLNET_SCALE] if self.applied else []
