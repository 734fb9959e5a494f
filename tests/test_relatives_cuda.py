"""Real graphs on a GPU for the img2img and inpaint relatives of Qwen-Image and Z-Image (marker: cuda):
accelerated calls give eager's bytes.

Each relative is built from a fresh text-to-image pipeline's components (``cuda_pipeline``; that
pipeline itself is never accelerated). Weights come from ``BCG_TEST_WEIGHTS`` (comma-separated,
default ``tiny``); ``random-full`` builds the real architectures with random weights (needs ~60 GB
of GPU memory for Qwen-Image). The relatives encode their input image (and, inpainting, the masked
image) with ``vae.encode``, which stays eager; ``strength`` cuts the denoising steps (with 3 steps:
0.6 runs 2, 1.0 runs 3) without changing a signature.
"""

from __future__ import annotations

import _relatives as rel
import pytest
import torch
from _cases import GPU_WEIGHTS, cuda_pipeline
from _checks import assert_graphs_ran
from _relatives import RELATIVES

from bcg_diffusion import accelerate, restore

pytestmark = pytest.mark.cuda

# (height, width), multiples of 16; not the text-to-image GPU test's
RESOLUTIONS = {"tiny": ((96, 64), (80, 80)), "random-full": ((640, 640), (576, 1024))}


@pytest.fixture(scope="module", params=[(r, w) for w in GPU_WEIGHTS for r in RELATIVES], ids=str)
def relative(request):
    name, weights = request.param
    base, cls, _ = RELATIVES[name]
    with cuda_pipeline(base, weights) as text_to_image:  # a fresh one per relative, never accelerated
        pipe = cls(**text_to_image.components)
        pipe.set_progress_bar_config(disable=True)
        del text_to_image
        yield name, base, weights, pipe
        del pipe


def test_graphs_equal_eager_bytes(relative):
    name, base, weights, pipe = relative
    calls = rel.calls(name, RESOLUTIONS.get(weights, RESOLUTIONS["random-full"]))
    expected = {call: rel.call(pipe, base, call) for call in calls}
    for call, output in expected.items():
        assert torch.isfinite(output).all(), f"eager output not finite for {call}: the test would prove nothing"
    case, strength, *rest = calls[0]
    assert strength != 1.0 and not torch.equal(expected[calls[0]], rel.call(pipe, base, (case, 1.0, *rest)))
    accelerate(pipe)
    try:
        for call in calls:  # capture, then replay across captures
            assert torch.equal(rel.call(pipe, base, call), expected[call]), call
        first = assert_graphs_ran(pipe, captures=True)
        assert all(s["status"] == "captured" for s in first["signatures"]), first["signatures"]
        assert {"transformer", "vae"} <= {s["component"] for s in first["signatures"]}
        for call in reversed(calls):  # every signature known: nothing new is captured
            assert torch.equal(rel.call(pipe, base, call), expected[call]), call
        second = assert_graphs_ran(pipe, first, captures=False)
        if "mask_two_lengths" in RELATIVES[name][2]:  # the masked path must replay, not fall back
            assert any("bool" in s["signature"] or "int64" in s["signature"] for s in second["signatures"])
        print(
            f"\n{name}/{weights}: captures={second['captures']} replays={second['replays']} "
            f"graph memory={second['graph_memory_bytes'] / 2**20:.0f} MiB "
            f"capture time={second['capture_seconds']:.2f} s"
        )
    finally:
        restore(pipe)
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__
    assert "forward" not in pipe.text_encoder.__dict__
    assert torch.equal(rel.call(pipe, base, calls[0]), expected[calls[0]])
