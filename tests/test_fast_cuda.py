"""Fast mode on a GPU: compiled blocks captured as breakable graphs (marker: cuda).

The reference for fast mode is the same compiled blocks run without graphs (``with eager(pipe):``); it
must match byte for byte. Weights from ``BCG_TEST_WEIGHTS`` as in ``test_pipelines_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from _cases import CASES, GPU_WEIGHTS, cuda_pipeline, run_case
from _checks import assert_graphs_ran
from torch._dynamo.utils import counters

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.features.compiled_text_encoder import COMPILED_TEXT_ENCODER
from bcg_diffusion.features.vae_decoder import VAE_DECODER_COMPILED
from bcg_diffusion.patches.attention import QWEN_ATTENTION_PATCH, ZIMAGE_ATTENTION_PATCH
from bcg_diffusion.patches.vae import VAE_FUSED_PATCH

pytestmark = pytest.mark.cuda

RESOLUTIONS = {"tiny": ((64, 64), (48, 96), (96, 96)), "random-full": ((512, 512), (768, 1344), (1024, 1024))}
# Dynamo compiles allowed over every case and resolution: one per structural variant of a block call, as
# in test_fast.py (blocks compile with dynamic shapes and no duck sizing, so a new resolution or text
# length compiles nothing). Qwen-Image: batch-1 calls (no CFG), CFG batches with text lengths (true
# CFG), CFG batches with a text mask (prompts of different lengths). Z-Image: modulated blocks and not,
# each with batch 1 (no CFG, and CFG after its truncation), batch 2 (CFG) and batch 2 with a caption
# mask (captions of different lengths); plus, on the GPU, one size range per batch size of the
# modulated blocks: inductor's matmul padding (pad_mm's is_mm_compute_bound) guards their token count
# below 85, which tiny Z-Image's main layers cross between 64x64 (64 tokens) and 96x96 (96 tokens), as
# seen on an H200 (8 compiles); full-size sequences are far above that bound.
COMPILES = {"qwen-image": 3, "z-image": 2 * 3 + 2}


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
        counters["aot_autograd"].clear()
        references = {}
        for case in cases:
            for height, width in resolutions:
                image = run_case(pipe, name, case, height=height, width=width)
                with eager(pipe):  # the compiled blocks without graphs
                    reference = references[(case, height, width)] = run_case(
                        pipe, name, case, height=height, width=width
                    )
                assert torch.equal(image, reference), (case, height, width)
                difference = (image.float() - eager_images[(case, (height, width))].float()).abs().max().item()
                assert difference < 0.1, f"fast mode strays from eager by {difference} on {case} {height}x{width}"
        # Every call above ran graphs (no fallback, no miss), each a capture or a replay.
        warm = assert_graphs_ran(pipe, captures=True)
        assert warm["compiled_blocks"] > 0 and warm["eager_fallbacks"] == 0, warm["signatures"]
        print(
            f"\n{name}/{weights}: compiles={warm['compiles']} text_encoder_compiles={warm['text_encoder_compiles']} "
            f"captures={warm['captures']} replays={warm['replays']}"
        )
        # One compile per structural variant (COMPILES), none per resolution or text length (9 and 12 calls here).
        assert 0 < warm["compiles"] <= COMPILES[name] and warm["compile_failure"] is None, warm
        # Z-Image's VAE is diffusers' 2-D decoder, fused (Qwen-Image's is 3-D, with RMS norms only); the
        # compiled decoder is an opt-in.
        expected = {"qwen-image": [QWEN_ATTENTION_PATCH.name], "z-image": [VAE_FUSED_PATCH]}[name]
        assert VAE_DECODER_COMPILED not in warm["patches"]
        if name == "z-image" and torch.cuda.get_device_capability() >= (9, 0):  # cuDNN where measured faster
            expected.append(ZIMAGE_ATTENTION_PATCH.name)
        if name == "z-image":  # its text encoder is accelerated: its layers compiled too, at the warm-ups
            expected.append(COMPILED_TEXT_ENCODER)
            assert warm["text_encoder_compiles"] > 0 and warm["text_encoder_compile_failure"] is None, warm
        assert set(expected) <= set(warm["patches"]), warm["patches"]
        # AOT autograd's cache kept every compiled block, so a new process starts warm: Z-Image's cuDNN
        # attention picks its backend with sdpa_kernel, whose private functions the cache refused
        # until fast mode marked them cacheable (6 s of a warm start on an H200, run 70).
        assert not counters["aot_autograd"].get("autograd_cache_bypass"), dict(counters["aot_autograd"])

        checked = warm
        for case in cases:  # replay everything again: no capture, no compile, the same bytes
            for height, width in resolutions:
                image = run_case(pipe, name, case, height=height, width=width)
                checked = assert_graphs_ran(pipe, checked, captures=False)
                assert torch.equal(image, references[(case, height, width)]), (case, height, width)
        again = stats(pipe)
        assert (again["captures"], again["compiles"]) == (warm["captures"], warm["compiles"])
        assert again["text_encoder_compiles"] == warm["text_encoder_compiles"]
        assert again["vae_compiles"] == 0, "the compiled VAE decoder is an opt-in"
    finally:
        restore(pipe)
    height, width = resolutions[0]
    restored = run_case(pipe, name, cases[0], height=height, width=width)
    assert torch.equal(restored, eager_images[(cases[0], resolutions[0])]), "restore must give eager back"
