"""diffusers' ``FluxMultiControlNetModel.forward`` (0.42) in two halves: each condition's ControlNet call, then the
sum of their samples.

The wrapper calls a ControlNet per condition (its one ControlNet for every condition, as a Union ControlNet is
loaded, or the i-th ControlNet for the i-th), each of which multiplies its samples by that condition's scale, last,
then adds the conditions' samples up in order. :mod:`bcg_diffusion.features.controlnet_scale` runs the first half
as the ControlNet's graphs with every scale 1.0, and applies each condition's scale and the sum after them,
eagerly, as the same operations on the same operands: so one capture serves every list of scales of one length.

>>> outputs = each_condition(pipe.controlnet)(**kwargs)  # doctest: +SKIP
>>> torch.equal(summed(outputs)[0][0], pipe.controlnet(**kwargs)[0][0])  # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FOLLOWED_NAME", "conditions_nets", "each_condition", "summed"]

# Its entry in patches.followed.FOLLOWED: the wrapper's forward, then the ControlNet's it calls.
FOLLOWED_NAME = "controlnet scale, each condition (FLUX.1)"


def conditions_nets(wrapper: torch.nn.Module, conditions: int) -> list[torch.nn.Module]:
    """The ControlNet ``wrapper``'s forward calls for each of ``conditions`` conditions, in order (fewer where it
    holds fewer ControlNets than conditions, as its ``zip`` stops)."""
    nets = list(wrapper.nets)
    return nets * conditions if len(nets) == 1 else nets[:conditions]


def each_condition(wrapper: torch.nn.Module) -> Callable[..., list[Any]]:
    """``wrapper``'s forward up to its sum: a function with its arguments that returns each condition's ControlNet
    output (a pair of block samples and single-block samples, each a list or None), in order."""

    def forward(
        hidden_states: torch.Tensor,
        controlnet_cond: list[torch.Tensor],
        controlnet_mode: list[torch.Tensor],
        conditioning_scale: list[float],
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        timestep: torch.Tensor | None = None,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> list[Any]:
        nets = conditions_nets(wrapper, len(controlnet_cond))
        return [
            controlnet(
                hidden_states=hidden_states,
                controlnet_cond=image,
                controlnet_mode=mode[:, None],
                conditioning_scale=scale,
                timestep=timestep,
                guidance=guidance,
                pooled_projections=pooled_projections,
                encoder_hidden_states=encoder_hidden_states,
                txt_ids=txt_ids,
                img_ids=img_ids,
                joint_attention_kwargs=joint_attention_kwargs,
                return_dict=return_dict,
            )
            for image, mode, scale, controlnet in zip(controlnet_cond, controlnet_mode, conditioning_scale, nets)
        ]

    return forward


def summed(outputs: list[Any]) -> tuple[Any, Any]:
    """The wrapper's return value from :func:`each_condition`'s ``outputs``: the first condition's samples, each
    later condition's added in order where both have them. Raises ValueError for no outputs (the wrapper itself
    fails there, on a name it never bound)."""
    if not outputs:
        raise ValueError("FluxMultiControlNetModel was called with no condition")
    for i, (block_samples, single_block_samples) in enumerate(outputs):
        if i == 0:
            control_block_samples, control_single_block_samples = block_samples, single_block_samples
            continue
        if block_samples is not None and control_block_samples is not None:
            control_block_samples = [a + b for a, b in zip(control_block_samples, block_samples)]
        if single_block_samples is not None and control_single_block_samples is not None:
            control_single_block_samples = [a + b for a, b in zip(control_single_block_samples, single_block_samples)]
    return control_block_samples, control_single_block_samples
