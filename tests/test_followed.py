"""The diffusers (and Cache-DiT) code under every patch is the code it was written for
(``bcg_diffusion.patches.followed``): each digest matches the installed packages, and a changed function
planted under each kind of patch (a function patch, a processor patch, a block path, an instance patch, a
step-cache mirror, the Cache-DiT carrier; a ControlNet's scale applied after its graphs in
``tests/test_published.py``) keeps the patch out, with a warning naming it, and the accelerated
pipeline gives eager's bytes with the changed code. Before this round a planted change went unseen: the
patch ran the old code and the images parted from eager with no warning."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from _caches import cache_config, cachedit_options
from _cases import run_case
from _checks import assert_graphs_ran, needs_compiler
from diffusers.models.transformers import transformer_qwenimage, transformer_z_image

from bcg_diffusion import BCGWarning, accelerate, eager, enable_cache, restore, stats
from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import followed
from bcg_diffusion.patches.attention import ZIMAGE_ATTENTION_PATCH, ZIMAGE_ROPE_PATCH
from bcg_diffusion.patches.block_glue import patch_blocks
from bcg_diffusion.patches.qwenimage import TEXT_SEQ_LEN_PATCH
from bcg_diffusion.patches.zimage_block import fused_block_forward


def _tested(package: str) -> bool:
    try:
        return importlib.metadata.version(package) in followed.TESTED[package]
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("patch", sorted(followed.FOLLOWED))
def test_every_digest_is_the_installed_code_of_the_tested_versions(patch):
    package = "cache-dit" if "Cache-DiT" in patch else "diffusers"
    if not _tested(package):
        pytest.skip(f"{package} is not a tested version: the digests are those of {followed.TESTED[package]}")
    assert followed.changed(patch) == []
    assert followed.installable(patch)


def _pipe(name):
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _equal_to_eager(pipe, name, case, steps=2):
    """Two accelerated calls (a capture, a replay) and one through eager(pipe): the same bytes."""
    images = [run_case(pipe, name, case, height=32, width=32, steps=steps) for _ in range(2)]
    with eager(pipe):
        reference = run_case(pipe, name, case, height=32, width=32, steps=steps)
    assert all(torch.equal(image, reference) for image in images)


ORIGINAL_SEQ_LEN = transformer_qwenimage.compute_text_seq_len_from_mask


def _masks_the_first_token(encoder_hidden_states, encoder_hidden_states_mask=None):
    """What a diffusers release might make of compute_text_seq_len_from_mask: the first token masked."""
    if encoder_hidden_states_mask is not None:
        encoder_hidden_states_mask = encoder_hidden_states_mask.clone()
        encoder_hidden_states_mask[:, 0] = 0
    return ORIGINAL_SEQ_LEN(encoder_hidden_states, encoder_hidden_states_mask)


def test_a_function_patch_over_changed_code_is_not_installed_and_the_images_follow_the_new_code(monkeypatch):
    monkeypatch.setattr(transformer_qwenimage, "compute_text_seq_len_from_mask", _masks_the_first_token)
    pipe = _pipe("qwen-image")
    reference = run_case(pipe, "qwen-image", "mask_two_lengths", height=32, width=32)  # eager, the new code
    with pytest.warns(BCGWarning, match=r"qwenimage.compute_text_seq_len_from_mask.*diffusers 0\.42"):
        accelerate(pipe, debug=True)
    try:
        assert TEXT_SEQ_LEN_PATCH.name not in stats(pipe)["patches"]
        assert transformer_qwenimage.compute_text_seq_len_from_mask is _masks_the_first_token
        _equal_to_eager(pipe, "qwen-image", "mask_two_lengths")  # the mask reaches the transformer
        assert torch.equal(run_case(pipe, "qwen-image", "mask_two_lengths", height=32, width=32), reference)
        assert_graphs_ran(pipe, components=("transformer",))
    finally:
        restore(pipe)


def _planted_call(original):
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)

    return __call__


def test_a_processor_patch_over_a_changed_processor_is_not_installed(monkeypatch):
    processor = transformer_z_image.ZSingleStreamAttnProcessor
    monkeypatch.setattr(processor, "__call__", _planted_call(processor.__call__))
    model = _pipe("z-image").transformer
    patches = MethodPatches()
    with pytest.warns(BCGWarning, match="zimage attention .* is not installed"):
        patched = ZIMAGE_ATTENTION_PATCH.apply(model, patches) + ZIMAGE_ROPE_PATCH.apply(model, patches)
    assert patched == 0 and len(patches) == 0
    assert all(type(m.processor) is processor for m in model.modules() if hasattr(m, "processor"))


@needs_compiler
@pytest.mark.heavy  # compiles with inductor on CPU
def test_fast_mode_over_a_changed_processor_keeps_diffusers_processor_and_its_compiled_bytes(monkeypatch):
    processor = transformer_z_image.ZSingleStreamAttnProcessor
    monkeypatch.setattr(processor, "__call__", _planted_call(processor.__call__))
    torch._dynamo.reset()
    pipe = _pipe("z-image")
    with pytest.warns(BCGWarning, match="zimage attention"):
        accelerate(pipe, mode="fast", debug=True)
    try:
        _equal_to_eager(pipe, "z-image", "no_cfg")
        assert stats(pipe)["compile_failure"] is None
    finally:
        restore(pipe)
        torch._dynamo.reset()


def test_a_block_path_over_a_changed_block_is_not_installed(monkeypatch):
    block = transformer_z_image.ZImageTransformerBlock
    original = block.forward
    monkeypatch.setattr(block, "forward", lambda self, *args, **kwargs: original(self, *args, **kwargs))
    model = _pipe("z-image").transformer
    patches = MethodPatches()
    with pytest.warns(BCGWarning, match="zimage fused block"):
        patched = patch_blocks(model, patches, lambda m: None if isinstance(m, block) else "not a block",
                               fused_block_forward, "zimage fused block")  # fmt: skip
    assert patched == 0 and not any("forward" in vars(m) for m in model.modules())


ORIGINAL_PAD = transformer_z_image.ZImageTransformer2DModel._pad_with_ids


def _pads_differently(self, *args, **kwargs):
    return ORIGINAL_PAD(self, *args, **kwargs)


def test_an_instance_patch_over_changed_code_is_not_installed_and_the_images_follow(monkeypatch):
    # Z-Image's caption buckets (both modes) pass pad masks through diffusers' patchify: a changed one keeps
    # them out, and every caption length gets a signature of its own.
    monkeypatch.setattr(transformer_z_image.ZImageTransformer2DModel, "_pad_with_ids", _pads_differently)
    pipe = _pipe("z-image")
    with pytest.warns(BCGWarning, match="zimage caption buckets"):
        accelerate(pipe, debug=True)
    try:
        assert "patchify_and_embed" not in vars(pipe.transformer)
        _equal_to_eager(pipe, "z-image", "two_lengths")
        [signature] = [s["signature"] for s in stats(pipe)["signatures"] if s["component"] == "transformer"]
        assert "caption_pad_masks" not in signature
    finally:
        restore(pipe)


def test_a_step_cache_mirror_over_changed_hooks_runs_its_calls_eagerly_with_eager_bytes(monkeypatch):
    from diffusers.hooks import mag_cache

    hook = mag_cache.MagCacheHeadHook
    original = hook.new_forward
    monkeypatch.setattr(
        hook, "new_forward", lambda self, module, *args, **kwargs: original(self, module, *args, **kwargs)
    )
    pipe = _pipe("z-image")
    enable_cache(pipe, cache_config("magcache", 6))
    reference = run_case(pipe, "z-image", "cfg", height=32, width=32, steps=6)
    accelerate(pipe, debug=True)
    try:
        with pytest.warns(BCGWarning, match="step caching: MagCache"):
            image = run_case(pipe, "z-image", "cfg", height=32, width=32, steps=6)
        assert torch.equal(image, reference)
        transformer = stats(pipe)["components"]["transformer"]
        assert transformer["eager_fallbacks"] == 6 and transformer["captures"] == 0
    finally:
        restore(pipe)


def test_the_cache_dit_carrier_over_changed_cache_dit_code_keeps_the_pipeline_eager(monkeypatch):
    cache_dit = pytest.importorskip("cache_dit")
    from cache_dit.caching.cache_contexts import cache_manager

    manager = cache_manager.CachedContextManager
    original = manager.can_cache
    monkeypatch.setattr(manager, "can_cache", lambda self, *args, **kwargs: original(self, *args, **kwargs))
    pipe = _pipe("z-image")
    cache_dit.enable_cache(pipe, **cachedit_options("static", 6))
    reference = run_case(pipe, "z-image", "cfg", height=32, width=32, steps=6)
    with pytest.warns(BCGWarning, match="step caching: Cache-DiT"):
        accelerate(pipe, debug=True)
    try:
        assert not stats(pipe)["active"] and "Cache-DiT's code" in stats(pipe)["reason"]
        assert torch.equal(run_case(pipe, "z-image", "cfg", height=32, width=32, steps=6), reference)
    finally:
        restore(pipe)


def test_a_verdict_is_kept_while_the_functions_stay_and_taken_again_when_one_changes(monkeypatch):
    assert followed.changed("zimage attention (RoPE outside autocast)") == []
    processor = transformer_z_image.ZSingleStreamAttnProcessor
    monkeypatch.setattr(processor, "__call__", _planted_call(processor.__call__))
    [line] = followed.changed("zimage attention (RoPE outside autocast)")
    assert "ZSingleStreamAttnProcessor.__call__ differs" in line and "diffusers 0.42." in line
    monkeypatch.undo()
    assert followed.changed("zimage attention (RoPE outside autocast)") == []


def test_an_unreadable_function_is_a_change(monkeypatch):
    monkeypatch.delattr(transformer_qwenimage, "compute_text_seq_len_from_mask")
    [line] = followed.changed(TEXT_SEQ_LEN_PATCH.name)
    assert "cannot be read" in line
