"""diffusers' wrappers of several ControlNets (0.42) in two halves: each condition's ControlNet call, then the sum
of their samples.

A wrapper (``FluxMultiControlNetModel``, ``SD3MultiControlNetModel``, ``QwenImageMultiControlNetModel``) calls a
ControlNet per condition (its one ControlNet for every condition, as a Union ControlNet is loaded, or the i-th
ControlNet for the i-th), each of which multiplies its samples by that condition's scale, last, then adds the
conditions' samples up in order. :mod:`bcg_diffusion.features.controlnet_scale` runs the first half as the
wrapper's graphs with every scale 1.0, and applies each condition's scale and the sum after them, eagerly, as the
same operations on the same operands: so one capture serves every list of scales of one length.

Each :class:`Split` here is its wrapper's forward, rearranged; :data:`SPLITS` names the ``FOLLOWED`` entry of each
(:mod:`bcg_diffusion.patches.followed`: the wrapper's forward, then the ControlNet's it calls).

>>> split = SPLITS[FLUX_WRAPPER]  # doctest: +SKIP
>>> outputs = split.each_condition(pipe.controlnet)(**kwargs)  # doctest: +SKIP
>>> torch.equal(split.summed(outputs)[0][0], pipe.controlnet(**kwargs)[0][0])  # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FLUX_WRAPPER", "QWEN_IMAGE_WRAPPER", "SD3_WRAPPER", "SPLITS", "Split"]

_CONTROLNETS = "diffusers.models.controlnets"
FLUX_WRAPPER = f"{_CONTROLNETS}.controlnet_flux.FluxMultiControlNetModel.forward"
SD3_WRAPPER = f"{_CONTROLNETS}.controlnet_sd3.SD3MultiControlNetModel.forward"
QWEN_IMAGE_WRAPPER = f"{_CONTROLNETS}.controlnet_qwenimage.QwenImageMultiControlNetModel.forward"


@dataclass(frozen=True)
class Split:
    """One wrapper's forward in two halves.

    Args:
        followed: its entry in ``patches.followed.FOLLOWED``: the wrapper's forward, then its ControlNet's.
        each_condition: given the wrapper, a function with the wrapper's forward's arguments that returns each
            condition's ControlNet output, in order.
        summed: the wrapper's return value from those outputs; raises ValueError for none (the wrapper itself
            fails there, on a name it never bound).
        nets: given the wrapper and a number of conditions, the ControlNets its forward calls for them.
    """

    followed: str
    each_condition: Callable[[torch.nn.Module], Callable[..., list[Any]]]
    summed: Callable[[list[Any]], Any]
    nets: Callable[[torch.nn.Module, int], list[torch.nn.Module]]


def _refuse_none(outputs: list[Any], wrapper: str) -> None:
    if not outputs:
        raise ValueError(f"{wrapper} was called with no condition")


def _added(sums: list[torch.Tensor] | None, samples: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """Each of ``sums`` plus the matching one of ``samples``, where both are there (``sums`` where either is not)."""
    if samples is None or sums is None:
        return sums
    return [total + sample for total, sample in zip(sums, samples)]


# FLUX.1: FluxMultiControlNetModel.forward


def _flux_nets(wrapper: torch.nn.Module, conditions: int) -> list[torch.nn.Module]:
    nets = list(wrapper.nets)
    return nets * conditions if len(nets) == 1 else nets[:conditions]


def _flux_each_condition(wrapper: torch.nn.Module) -> Callable[..., list[Any]]:
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
        nets = _flux_nets(wrapper, len(controlnet_cond))
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


def _flux_summed(outputs: list[Any]) -> tuple[Any, Any]:
    _refuse_none(outputs, "FluxMultiControlNetModel")
    (blocks, single_blocks), *later = outputs
    for block_samples, single_block_samples in later:
        blocks, single_blocks = _added(blocks, block_samples), _added(single_blocks, single_block_samples)
    return blocks, single_blocks


# SD3: SD3MultiControlNetModel.forward


def _sd3_nets(wrapper: torch.nn.Module, conditions: int) -> list[torch.nn.Module]:
    return list(wrapper.nets)[:conditions]


def _sd3_each_condition(wrapper: torch.nn.Module) -> Callable[..., list[Any]]:
    def forward(
        hidden_states: torch.Tensor,
        controlnet_cond: list[torch.Tensor],
        conditioning_scale: list[float],
        pooled_projections: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        timestep: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> list[Any]:
        return [
            controlnet(
                hidden_states=hidden_states,
                timestep=timestep,
                encoder_hidden_states=encoder_hidden_states,
                pooled_projections=pooled_projections,
                controlnet_cond=image,
                conditioning_scale=scale,
                joint_attention_kwargs=joint_attention_kwargs,
                return_dict=return_dict,
            )
            for image, scale, controlnet in zip(controlnet_cond, conditioning_scale, wrapper.nets)
        ]

    return forward


def _sd3_summed(outputs: list[Any]) -> Any:
    _refuse_none(outputs, "SD3MultiControlNetModel")
    summed, *later = outputs
    for block_samples in later:  # each a one-element tuple of the ControlNet's samples, as is the sum
        summed = (tuple(total + sample for total, sample in zip(summed[0], block_samples[0])),)
    return summed


# Qwen-Image: QwenImageMultiControlNetModel.forward (one Union ControlNet only)


def _qwen_image_nets(wrapper: torch.nn.Module, conditions: int) -> list[torch.nn.Module]:
    return list(wrapper.nets) * conditions if len(wrapper.nets) == 1 else []


def _qwen_image_each_condition(wrapper: torch.nn.Module) -> Callable[..., list[Any]]:
    def forward(
        hidden_states: torch.Tensor,
        controlnet_cond: list[torch.Tensor],
        conditioning_scale: list[float],
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        timestep: torch.Tensor | None = None,
        img_shapes: list[tuple[int, int, int]] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> list[Any]:
        if len(wrapper.nets) != 1:  # diffusers' own refusal
            raise ValueError("QwenImageMultiControlNetModel only supports a single controlnet-union now.")
        controlnet = wrapper.nets[0]
        return [
            controlnet(
                hidden_states=hidden_states,
                controlnet_cond=image,
                conditioning_scale=scale,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                timestep=timestep,
                img_shapes=img_shapes,
                joint_attention_kwargs=joint_attention_kwargs,
                return_dict=return_dict,
            )
            for image, scale in zip(controlnet_cond, conditioning_scale)
        ]

    return forward


def _qwen_image_summed(outputs: list[Any]) -> Any:
    _refuse_none(outputs, "QwenImageMultiControlNetModel")
    summed, *later = outputs
    for block_samples in later:
        summed = _added(summed, block_samples)
    return summed


# wrapper's forward (dotted path) -> its split
SPLITS = {
    FLUX_WRAPPER: Split("controlnet scale, each condition (FLUX.1)", _flux_each_condition, _flux_summed, _flux_nets),
    SD3_WRAPPER: Split("controlnet scale, each condition (SD3)", _sd3_each_condition, _sd3_summed, _sd3_nets),
    QWEN_IMAGE_WRAPPER: Split(
        "controlnet scale, each condition (Qwen-Image)",
        _qwen_image_each_condition,
        _qwen_image_summed,
        _qwen_image_nets,
    ),
}
