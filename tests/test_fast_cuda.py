"""Fast mode on a GPU: compiled blocks captured as breakable graphs (marker: cuda).

The reference for fast mode is the same compiled blocks run without graphs (``with eager(pipe):``); it
must match byte for byte. Weights from ``BCG_TEST_WEIGHTS`` as in ``test_pipelines_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from _cases import CASES, GPU_WEIGHTS, cuda_pipeline, run_case

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.patches.attention import QWEN_ATTENTION_PATCH, ZIMAGE_ATTENTION_PATCH
from bcg_diffusion.patches.group_norm import VAE_GROUP_NORM_PATCH

pytestmark = pytest.mark.cuda

RESOLUTIONS = {"tiny": ((64, 64), (48, 96), (96, 96)), "random-full": ((512, 512), (768, 1344), (1024, 1024))}


@pytest.fixture(params=[(p, w) for w in GPU_WEIGHTS for p in ("qwen-image", "z-image")], ids=str)
def pipeline(request):
    name, weights = request.param
    with cuda_pipeline(name, weights) as pipe:
        yield name, weights, pipe


def test_fast_mode_equals_its_compiled_reference_and_stops_compiling(pipeline):
    name, weights, pipe = pipeline
    resolutions = RESOLUTIONS[weights]
    cases = list(CASES[name])
    eager_images = {(c, r): run_case(pipe, name, c, height=r[0], width=r[1]) for c in cases for r in resolutions}
    accelerate(pipe, mode="fast")
    try:
        for case in cases:
            for height, width in resolutions:
                image = run_case(pipe, name, case, height=height, width=width)
                with eager(pipe):  # the compiled blocks without graphs
                    reference = run_case(pipe, name, case, height=height, width=width)
                assert torch.equal(image, reference), (case, height, width)
                difference = (image.float() - eager_images[(case, (height, width))].float()).abs().max().item()
                assert difference < 0.1, f"fast mode strays from eager by {difference} on {case} {height}x{width}"
        warm = stats(pipe)
        assert warm["compiled_blocks"] > 0 and warm["eager_fallbacks"] == 0, warm["signatures"]
        # A compile per structural variant (mask or not, batch 1 or more...) and one per first size
        # change, then symbolic sizes: not one per resolution and text length (12 calls each here).
        assert 0 < warm["compiles"] <= 12 and warm["compile_failure"] is None, warm
        # Z-Image's VAE has group norms (Qwen-Image's has RMS norms only).
        expected = {"qwen-image": [QWEN_ATTENTION_PATCH.name], "z-image": [VAE_GROUP_NORM_PATCH]}[name]
        if name == "z-image" and torch.cuda.get_device_capability() >= (9, 0):  # cuDNN where measured faster
            expected.append(ZIMAGE_ATTENTION_PATCH.name)
        assert set(expected) <= set(warm["patches"]), warm["patches"]

        for case in cases:  # replay everything again: no capture, no compile
            for height, width in resolutions:
                run_case(pipe, name, case, height=height, width=width)
        again = stats(pipe)
        assert (again["captures"], again["compiles"]) == (warm["captures"], warm["compiles"])
    finally:
        restore(pipe)
    height, width = resolutions[0]
    restored = run_case(pipe, name, cases[0], height=height, width=width)
    assert torch.equal(restored, eager_images[(cases[0], resolutions[0])]), "restore must give eager back"
