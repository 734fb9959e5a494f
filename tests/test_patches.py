"""Every patch against the original diffusers function, exactly, on random inputs."""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.patches.qwenimage import TEXT_SEQ_LEN_PATCH


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("seed", range(20))
def test_text_seq_len_from_mask_matches_original(seed):
    original = TEXT_SEQ_LEN_PATCH.original()
    generator = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 5, (), generator=generator))
    length = int(torch.randint(1, 40, (), generator=generator))
    states = torch.randn(batch, length, 8, generator=generator)
    kind = seed % 4
    if kind == 0:
        mask = None
    elif kind == 1:  # contiguous valid prefix per sample, as the pipeline builds it
        lengths = torch.randint(0, length + 1, (batch,), generator=generator)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
    elif kind == 2:  # any pattern, bool
        mask = torch.rand(batch, length, generator=generator) > 0.5
    else:  # float mask with an all-zero row
        mask = (torch.rand(batch, length, generator=generator) > 0.3).float()
        mask[0] = 0
    expected = original(states, mask)
    got = TEXT_SEQ_LEN_PATCH.replacement(states, mask)
    assert all(_equal(g, e) for g, e in zip(got, expected, strict=True))


def test_bad_mask_shape_raises_like_the_original():
    states = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="must match"):
        TEXT_SEQ_LEN_PATCH.replacement(states, torch.ones(2, 4))


def test_apply_and_revert_are_reference_counted():
    import diffusers.models.transformers.transformer_qwenimage as module

    original = module.compute_text_seq_len_from_mask
    assert TEXT_SEQ_LEN_PATCH.apply() and TEXT_SEQ_LEN_PATCH.apply()
    assert module.compute_text_seq_len_from_mask is TEXT_SEQ_LEN_PATCH.replacement
    assert TEXT_SEQ_LEN_PATCH.original() is original
    TEXT_SEQ_LEN_PATCH.revert()
    assert module.compute_text_seq_len_from_mask is TEXT_SEQ_LEN_PATCH.replacement  # one user left
    TEXT_SEQ_LEN_PATCH.revert()
    assert module.compute_text_seq_len_from_mask is original
    TEXT_SEQ_LEN_PATCH.revert()  # extra revert: harmless
    assert module.compute_text_seq_len_from_mask is original
