"""Qwen-Image's image output projection taking cuDNN's FP8 attention output as it is
(``patches/fp8_output_projection.py``) on a GPU (marker: cuda): one attention module of Qwen-Image's width
with its output projection quantized by torchao's own ``quantize_``, cuDNN's FP8 attention fed by the fused
prologue, compiled whole by inductor. The direct path stays near the scaled one and near bf16 attention, and
a CUDA graph of the compiled function replays its bytes, again on changed inputs."""

from __future__ import annotations

import pytest
import torch
from _cases import qwen_attention_on_gpu
from _checks import compiled_and_replayed

from bcg_diffusion.kernels import cudnn_fp8_attention as cudnn_fp8
from bcg_diffusion.patches import fp8_output_projection as fp8_output
from bcg_diffusion.patches.attention import KERNEL_ATTRIBUTE, QK_PROLOGUE_ATTRIBUTE, qwen_joint_attention_per_group

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def test_compiled_direct_path_replays_and_stays_near_the_scaled_one():
    pytest.importorskip("torchao")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    reason = cudnn_fp8.unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    attn, hidden, text, args = qwen_attention_on_gpu()
    with torch.no_grad():
        bf16_attention = qwen_joint_attention_per_group(*args)  # SDPA, bf16 projection: the reference
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    quantize_(attn.to_out, config)
    setattr(attn, KERNEL_ATTRIBUTE, "cudnn-fp8")
    setattr(attn, QK_PROLOGUE_ATTRIBUTE, "fused")
    assert fp8_output.takes_fp8(attn)
    outputs = {}
    with torch.no_grad():
        for choice in ("scaled", "direct"):
            setattr(attn, fp8_output.FP8_OUTPUT_ATTRIBUTE, choice)
            outputs[choice] = qwen_joint_attention_per_group(*args)
        # other values on the second replay: each group's output descale must follow them
        compiled, replayed, captured, smaller = compiled_and_replayed(
            qwen_joint_attention_per_group, args, lambda: (hidden.mul_(0.25), text.mul_(0.25))
        )
    assert all(torch.equal(r, c) for r, c in zip(replayed, compiled, strict=True))
    assert all(torch.equal(c, s) for c, s in zip(captured, smaller, strict=True))
    image_errors = {
        "direct against scaled": _relative_error(outputs["direct"][0], outputs["scaled"][0]),
        "compiled direct against eager direct": _relative_error(compiled[0], outputs["direct"][0]),
        "direct against bf16": _relative_error(outputs["direct"][0], bf16_attention[0]),
        "scaled against bf16": _relative_error(outputs["scaled"][0], bf16_attention[0]),
    }
    print(f"\nimage stream, relative errors: {image_errors}")
    assert torch.equal(outputs["direct"][1], outputs["scaled"][1])  # the text stream: bf16 either way
    assert image_errors["direct against scaled"] < 3e-2 and image_errors["compiled direct against eager direct"] < 3e-2
    # rounded once instead of three times: no further from bf16 attention than the scaled path, give or take
    assert image_errors["direct against bf16"] < 1.1 * image_errors["scaled against bf16"] + 1e-3
    assert cudnn_fp8.refusals() == {}
