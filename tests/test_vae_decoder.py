"""Fast mode's VAE decoder compiled by inductor (``features/vae_decoder.py``), on the CPU: the same decode up
to rounding, one compile per latent shape, the eager forward back on undo. On a GPU, fast mode compiles
Z-Image's decoder inside its graphs (``tests/test_fast_cuda.py``); on a CPU it patches the group norms
instead (``tests/test_group_norm.py``)."""

from __future__ import annotations

import pytest
import torch
from _checks import needs_compiler

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features.vae_decoder import _compilable, compile_decoder
from bcg_diffusion.models import build_pipeline


@needs_compiler
@pytest.mark.heavy
def test_the_compiled_decoder_decodes_the_same_and_undo_gives_the_eager_one_back():
    vae = build_pipeline("z-image", "tiny").vae
    assert _compilable(vae.decoder)
    latents = [
        torch.randn(1, vae.config.latent_channels, s, s, generator=torch.Generator().manual_seed(s)) for s in (8, 12)
    ]
    with torch.no_grad():
        expected = [vae.decode(z).sample for z in latents]
        patches = MethodPatches()
        record = compile_decoder(vae.decoder, patches)
        assert not _compilable(vae.decoder), "a decoder whose forward is replaced is not compiled again"
        got = [vae.decode(z).sample for z in latents]
        again = vae.decode(latents[0]).sample
        patches.undo()
        restored = vae.decode(latents[0]).sample
    for image, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(image, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, got[0])
    assert record.compiles == 2 and record.failure is None, record  # static shapes: one per latent size
    assert torch.equal(restored, expected[0]) and "forward" not in vae.decoder.__dict__


def test_the_compiled_decoder_is_an_opt_in_and_a_bad_choice_is_refused():
    from bcg_diffusion import accelerate, restore, stats
    from bcg_diffusion.features.vae_decoder import VAE_DECODER_COMPILED, choose
    from bcg_diffusion.patches.group_norm import VAE_GROUP_NORM_PATCH

    pipe = build_pipeline("z-image", "tiny")
    with pytest.raises(ValueError, match="choice must be one of"):
        choose(pipe.vae, "inductor")
    choose(pipe.vae, "compiled")
    accelerate(pipe, mode="fast", debug=True)
    try:  # on a CPU the opt-in keeps the patched norms: compiling would only cost there
        assert VAE_GROUP_NORM_PATCH in stats(pipe)["patches"] and VAE_DECODER_COMPILED not in stats(pipe)["patches"]
        assert stats(pipe)["vae_compiles"] == 0
    finally:
        restore(pipe)
