"""FLUX.1's wrapper of several ControlNets in two halves (``patches/flux_multi_controlnet.py``): each condition's
ControlNet call, then their sum, give the wrapper's own bytes."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxMultiControlNetModel

from bcg_diffusion.patches import flux_multi_controlnet
from bench.coverage_models import TINY


def _inputs(pipe, conditions: int) -> dict:
    """Keyword arguments of one ControlNet call, as FLUX.1's pipeline passes them, for ``conditions`` conditions."""
    torch.manual_seed(3)
    config = pipe.controlnet.config
    tokens, text = 16, 5
    return {
        "hidden_states": torch.randn(1, tokens, config.in_channels),
        "controlnet_cond": [torch.randn(1, tokens, config.in_channels) for _ in range(conditions)],
        "controlnet_mode": [torch.zeros(1, dtype=torch.long) for _ in range(conditions)],
        "conditioning_scale": [0.7, 0.3, 1.0][:conditions],
        "encoder_hidden_states": torch.randn(1, text, config.joint_attention_dim),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text, 3),
        "guidance": torch.tensor([3.5]) if config.guidance_embeds else None,
        "return_dict": False,
    }


def _equal(got, want) -> bool:
    if want is None or got is None:
        return got is want
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("nets, conditions", [(1, 1), (1, 3), (2, 2)])
def test_each_condition_then_the_sum_give_the_wrappers_bytes(nets, conditions):
    """One ControlNet for every condition (a Union ControlNet) or one per condition: the halves' result is the
    wrapper's, byte for byte."""
    pipe, _ = TINY["FLUX.1 ControlNet"]()
    controlnets = [pipe.controlnet] + [TINY["FLUX.1 ControlNet"]()[0].controlnet for _ in range(nets - 1)]
    wrapper = FluxMultiControlNetModel(controlnets).eval()
    inputs = _inputs(pipe, conditions)
    with torch.no_grad():
        want = wrapper(**inputs)
        outputs = flux_multi_controlnet.each_condition(wrapper)(**inputs)
        got = flux_multi_controlnet.summed(outputs)
    assert len(outputs) == conditions
    assert _equal(got[0], want[0]) and _equal(got[1], want[1])


def test_no_condition_is_refused():
    with pytest.raises(ValueError, match="no condition"):
        flux_multi_controlnet.summed([])
