"""Fast mode's CFG batching under a step cache (issue 36, item 3), CPU debug mode.

MagCache and TaylorSeer decide on host values alone, so true CFG's cond and uncond calls run as one batch
in one joint cache context (:mod:`bcg_diffusion.features.step_caching.cfg_join`): the decisions must be
the unbatched run's, and the images byte-equal to the same pipeline under ``eager(pipe)`` (which batches
the same way, without graphs). Against diffusers' unbatched run only rounding differs (batched GEMMs and,
with prompts of different lengths, the masked attention): compared with a tolerance of 1e-5.
FirstBlockCache and Cache-DiT keep the calls one by one, with the reason at INFO.

Fast mode runs here without compiled blocks (the tiny model's repeated blocks are cleared, as in
``test_cfg_batch.py``): exact-mode graphs in debug mode, plus CFG batching.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from _caches import (
    OTHER_LENGTH_NEGATIVE,
    SAME_LENGTH_NEGATIVE,
    ReplayCheck,
    cache_config,
    cachedit_options,
    cfg_decisions,
    stop_batching_at,
)

from bcg_diffusion import BCGWarning, accelerate, eager, restore, stats
from bcg_diffusion.features import cfg_batching
from bcg_diffusion.features.step_caching import JOINT_CONTEXT, enable_cache, kinds
from bcg_diffusion.features.step_caching.cfg_join import join_states, snapshot_state, split_state
from bcg_diffusion.models import build_pipeline

STEPS = 10
SIZE = (32, 32)


def _pipe():
    pipe = build_pipeline("qwen-image", "tiny", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _decisions(pipe, negative):
    return cfg_decisions(pipe, negative, steps=STEPS, size=SIZE)


def _run(pipe, negative):
    return _decisions(pipe, negative)[0]


def _fast(pipe, **options):
    """Fast mode without compiled blocks: exact-mode graphs (debug: eager) plus CFG batching."""
    pipe.transformer._repeated_blocks = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "bcg-diffusion: mode='fast' falls back", BCGWarning)
        accelerate(pipe, mode="fast", debug=True, **options)


CASES = [("magcache", SAME_LENGTH_NEGATIVE), ("magcache", OTHER_LENGTH_NEGATIVE), ("taylorseer", SAME_LENGTH_NEGATIVE)]


@pytest.mark.parametrize(("cache", "negative"), CASES)
def test_cfg_is_batched_under_the_cache_with_the_unbatched_decisions(cache, negative):
    pipe = _pipe()
    enable_cache(pipe, cache_config(cache, STEPS))
    expected, expected_decisions = _decisions(pipe, negative)  # diffusers, one by one
    assert True in expected_decisions and False in expected_decisions
    _fast(pipe)
    check = ReplayCheck(pipe)  # emulated replays: every run of a key traces the same ops, leaves what apply() sets
    try:
        for _ in range(2):  # the second call starts from the reset state, as the first
            before = stats(pipe)["cfg_batched"]
            image, decisions = _decisions(pipe, negative)
            report = stats(pipe)
            # Step 0 runs cond and uncond one by one, every later step as one batch.
            assert (report["cfg_batched"] - before, report["cfg_batch_dropped"]) == (STEPS - 1, 0), report
            assert decisions == expected_decisions
            torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)  # batched rounding only
            with eager(pipe):
                reference, reference_decisions = _decisions(pipe, negative)
            assert torch.equal(image, reference)
            assert reference_decisions == expected_decisions
        assert check.compared > 0
    finally:
        check.remove()
        restore(pipe)


def test_taylorseer_with_prompts_of_different_lengths_runs_one_by_one(caplog):
    pipe = _pipe()
    enable_cache(pipe, cache_config("taylorseer", STEPS))
    expected = _run(pipe, OTHER_LENGTH_NEGATIVE)
    _fast(pipe)
    try:
        with caplog.at_level(logging.INFO, logger=cfg_batching.__name__):
            image = _run(pipe, OTHER_LENGTH_NEGATIVE)
        assert stats(pipe)["cfg_batched"] == 0
        assert "TaylorSeer keeps outputs with the text's length" in caplog.text
        assert torch.equal(image, expected)
    finally:
        restore(pipe)


@pytest.mark.parametrize("cache", ["magcache", "taylorseer"])
@pytest.mark.parametrize(("how", "call"), [("drop", 8), ("alone", 11)])
def test_batching_that_stops_mid_call_keeps_the_unbatched_decisions(monkeypatch, cache, how, call):
    # drop: step 3's uncond call (call 8) is not served its speculated half and runs alone, from the uncond
    # state before the batch; step 4 runs one by one, step 5 joins again. alone: step 5's cond call (call 11)
    # runs alone; its uncond call too (it cannot join its own context), and step 6 joins again.
    pipe = _pipe()
    enable_cache(pipe, cache_config(cache, STEPS))
    expected, expected_decisions = _decisions(pipe, SAME_LENGTH_NEGATIVE)
    _fast(pipe)
    stop_batching_at(monkeypatch, how, call, STEPS)
    check = ReplayCheck(pipe)
    try:
        image, decisions = _decisions(pipe, SAME_LENGTH_NEGATIVE)
        report = stats(pipe)
        if how == "drop":
            assert (report["cfg_batched"], report["cfg_batch_dropped"]) == (STEPS - 3, 1), report
        else:
            assert (report["cfg_batched"], report["cfg_batch_dropped"]) == (STEPS - 2, 0), report
        assert decisions == expected_decisions
        torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)
        with eager(pipe):
            reference, reference_decisions = _decisions(pipe, SAME_LENGTH_NEGATIVE)
        assert torch.equal(image, reference) and reference_decisions == expected_decisions
        assert check.compared > 0
    finally:
        check.remove()
        restore(pipe)


def _first_block(pipe):
    # A threshold under which the tiny model both skips and computes (random weights: relative changes near 1).
    enable_cache(pipe, cache_config("first-block", STEPS, threshold=2.0))


def _cache_dit(pipe):
    cache_dit = pytest.importorskip("cache_dit")
    cache_dit.enable_cache(pipe, **cachedit_options("static", STEPS))


@pytest.mark.parametrize(
    ("enable", "reason"),
    [(_first_block, "FirstBlockCache decides on the first block's residual change"), (_cache_dit, "Cache-DiT")],
)
def test_first_block_cache_and_cache_dit_keep_cfg_one_by_one(caplog, enable, reason):
    pipe = _pipe()
    enable(pipe)
    expected = _run(pipe, SAME_LENGTH_NEGATIVE)
    _fast(pipe)
    try:
        with caplog.at_level(logging.INFO, logger=cfg_batching.__name__):
            image = _run(pipe, SAME_LENGTH_NEGATIVE)
        assert (stats(pipe)["cfg_batched"], stats(pipe)["cfg_batch_dropped"]) == (0, 0)
        assert f"CFG batching: not batched: {reason}" in caplog.text
        assert torch.equal(image, expected)  # one by one, uncompiled: eager's bytes
    finally:
        restore(pipe)


# ------------------------------------------------------------------------------------ join, split, snapshot
def _mag_state(residual, step=3, err=0.25):
    from diffusers.hooks.mag_cache import MagCacheState

    state = MagCacheState()
    state.previous_residual, state.head_block_input = residual, residual + 1
    state.step_index, state.accumulated_err, state.accumulated_ratio = step, err, torch.tensor(0.5)
    return state


def test_joint_states_split_back_into_what_they_were_joined_from():
    kind = kinds.KINDS["MagCacheState"]
    cond, uncond = _mag_state(torch.randn(1, 4, 8)), _mag_state(torch.randn(1, 4, 8))
    joint = join_states(kind, cond, uncond, (1, 1))
    assert torch.equal(joint.previous_residual, torch.cat([cond.previous_residual, uncond.previous_residual]))
    assert joint.accumulated_ratio is not cond.accumulated_ratio  # host tensors copied: hooks update them in place
    for half, original in zip(split_state(kind, joint, (1, 1)), (cond, uncond)):
        assert vars(half).keys() == vars(original).keys()
        for name, value in vars(original).items():
            got = getattr(half, name)
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
        assert (
            half.previous_residual.untyped_storage().data_ptr() != joint.previous_residual.untyped_storage().data_ptr()
        )
    saved = snapshot_state(kind, joint)
    joint.previous_residual.add_(1)  # a graph writes its buffer in place: the snapshot keeps the values
    assert torch.equal(saved.previous_residual[:1], cond.previous_residual)
    # Host fields must be equal, and per-sample tensors of one structure and shape.
    assert "step_index" in join_states(kind, cond, _mag_state(torch.randn(1, 4, 8), step=4), (1, 1))
    assert "structures or shapes" in join_states(kind, cond, _mag_state(torch.randn(1, 5, 8)), (1, 1))


def test_taylorseer_inactive_shapes_follow_the_batch():
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    kind = kinds.KINDS["TaylorSeerState"]
    cond, uncond = TaylorSeerState(is_inactive=True), TaylorSeerState(is_inactive=True)
    for state in (cond, uncond):
        state.update((torch.zeros(1, 4, 8),))
    joint = join_states(kind, cond, uncond, (1, 1))
    assert joint.inactive_shapes == ((2, 4, 8),)
    assert [half.inactive_shapes for half in split_state(kind, joint, (1, 1))] == [((1, 4, 8),), ((1, 4, 8),)]
    assert JOINT_CONTEXT not in ("cond", "uncond", kinds.DEFAULT_CONTEXT)
