"""The wrappers of several ControlNets in two halves (``patches/multi_controlnet.py``): each condition's ControlNet
call, then their sum, give the wrapper's own bytes (here FLUX.1's, called directly; SD3's and Qwen-Image's through
their pipelines in ``tests/test_published.py``)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxMultiControlNetModel

from bcg_diffusion.patches.multi_controlnet import FLUX_WRAPPER, QWEN_IMAGE_WRAPPER, SD3_WRAPPER, SPLITS
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
        outputs = SPLITS[FLUX_WRAPPER].each_condition(wrapper)(**inputs)
        got = SPLITS[FLUX_WRAPPER].summed(outputs)
    assert len(outputs) == conditions
    assert _equal(got[0], want[0]) and _equal(got[1], want[1])


@pytest.mark.parametrize("wrapper", [FLUX_WRAPPER, SD3_WRAPPER, QWEN_IMAGE_WRAPPER])
def test_no_condition_is_refused(wrapper):
    with pytest.raises(ValueError, match="no condition"):
        SPLITS[wrapper].summed([])


def test_every_split_names_the_code_it_follows():
    """Each split's entry follows its wrapper's forward, then the ControlNet's forward it calls."""
    from bcg_diffusion.patches.followed import FOLLOWED, changed, resolve

    for path, split in SPLITS.items():
        assert list(FOLLOWED[split.followed])[0] == path and changed(split.followed) == []
        assert callable(resolve(list(FOLLOWED[split.followed])[1]))
