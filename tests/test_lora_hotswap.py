"""LoRA hot swap (diffusers' ``enable_lora_hotswap`` + ``load_lora_weights(..., hotswap=True)``) keeps the graphs.

A hot swap copies the new adapter's weights into the tensors the graphs read, so the captured graphs
(and fast mode's compiled blocks) stay valid: no invalidation, no new capture, and the image follows
the new LoRA exactly. A swap that cannot happen in place (a larger rank without ``target_rank``) gives
the tensors new storage, and the graphs are dropped as for any other LoRA change.
"""

from __future__ import annotations

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.models import build_pipeline

pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora_state_dict(pipe, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """A random LoRA for ``pipe.transformer``'s attention projections, keyed as ``load_lora_weights`` wants."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = pipe.transformer
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS), adapter_name="_shape")
    shapes = {key: value.shape for key, value in get_peft_model_state_dict(transformer, adapter_name="_shape").items()}
    transformer.delete_adapters("_shape")
    generator = torch.Generator("cpu").manual_seed(seed)
    return {
        f"transformer.{key}": (torch.randn(shape, generator=generator) * 0.2).to(transformer.dtype)
        for key, shape in shapes.items()
    }


def _call(pipe) -> torch.Tensor:
    out = pipe(
        "a red fox",
        height=64 if pipe.device.type == "cuda" else 32,
        width=64 if pipe.device.type == "cuda" else 32,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    )
    return out.images.detach().cpu()


def _reference(pipe) -> torch.Tensor:
    with eager(pipe):  # the pipeline's original methods on the same weights: eager with this LoRA
        return _call(pipe)


def _swap_keeps_graphs(pipe, **options) -> None:
    loras = [lora_state_dict(pipe, seed=1, rank=4), lora_state_dict(pipe, seed=2, rank=6)]
    accelerate(pipe, **options)
    try:
        pipe.enable_lora_hotswap(target_rank=8)
        pipe.load_lora_weights(loras[0], adapter_name="style")
        first = _call(pipe)
        assert torch.equal(first, _reference(pipe))
        before = assert_graphs_ran(pipe)
        compiles = before["compiles"]
        pipe.load_lora_weights(loras[1], adapter_name="style", hotswap=True)
        swapped = stats(pipe)
        assert swapped["hotswaps"] == before["hotswaps"] + 1
        assert swapped["invalidations"] == before["invalidations"], "a hot swap in place dropped the graphs"
        second = _call(pipe)
        assert not torch.equal(second, first), "the new LoRA changed nothing: the test would prove nothing"
        assert torch.equal(second, _reference(pipe))
        after = assert_graphs_ran(pipe, before, captures=False)  # replayed the graphs captured before the swap
        assert after["compiles"] == compiles, "the hot swap recompiled the blocks"
    finally:
        restore(pipe)


def test_hotswap_in_place_keeps_the_graphs_debug_mode():
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    _swap_keeps_graphs(pipe, debug=True)


def test_hotswap_that_needs_new_storage_drops_the_graphs():
    pipe = build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    loras = [lora_state_dict(pipe, seed=1, rank=4), lora_state_dict(pipe, seed=2, rank=8)]
    accelerate(pipe, debug=True)
    try:
        pipe.load_lora_weights(loras[0], adapter_name="style")
        _call(pipe)
        before = stats(pipe)
        # No enable_lora_hotswap: a larger rank cannot be copied into the old tensors.
        pipe.load_lora_weights(loras[1], adapter_name="style", hotswap=True)
        assert stats(pipe)["invalidations"] > before["invalidations"]
        assert stats(pipe)["hotswaps"] == before["hotswaps"]
        assert torch.equal(_call(pipe), _reference(pipe))
    finally:
        restore(pipe)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_hotswap_in_place_keeps_real_graphs(mode):
    pipe = build_pipeline("qwen-image", "tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    try:
        _swap_keeps_graphs(pipe, mode=mode)
    finally:
        torch._dynamo.reset()
