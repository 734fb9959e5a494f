"""CFG across two ranks checks that the ranks make the same pipeline call (CPU, gloo, tiny Qwen-Image, debug
mode): at the first step of every call both ranks exchange a fingerprint of it (CFG or not, guidance, steps,
the transformer's inputs), and on a mismatch both raise one error naming what differs, instead of combining
one rank's cond prediction with the other's uncond prediction or waiting forever for an exchange. The next
call after a raise works as usual. Each pipeline sharing the transformer finds its first step from its own
scheduler.

The checks of every test run in one pair of processes (:func:`reports`): each pair pays its imports and pipeline
builds, a few seconds on a small machine. A rank that raises ends the pair, and every test shows its error."""

from __future__ import annotations

import copy
from typing import Any

import _parallel
import pytest
import torch
from _cases import tiny_pipeline

from bcg_diffusion import accelerate, restore, stats

WORLD, STEPS, SIZE = 2, 3, 32
TIMEOUT = 300.0  # seconds; a pass takes well under a minute, a hang would block forever without it
PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"
PROMPTS = (PROMPT, "a grey wolf in the snow")  # one per rank in the prompt case
COUNTERS = ("cfg_split_calls", "cfg_exchanges")


def _call(
    pipe: Any,
    *,
    seed: int = 0,
    prompt: str = PROMPT,
    negative: str | None = NEGATIVE,
    scale: float = 4.0,
    steps: int = STEPS,
) -> torch.Tensor:
    """One true-CFG call (without CFG when ``negative`` is None)."""
    return pipe(
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pt",
    ).images


def _error(pipe: Any, **options: Any) -> str | None:
    """The error a call with ``options`` raises, as ``"Type: message"`` (None: it raised none)."""
    try:
        _call(pipe, **options)
    except Exception as exc:  # noqa: BLE001 - reported to the test process, which checks it
        return f"{type(exc).__name__}: {exc}"
    return None


def _counters(pipe: Any) -> dict[str, int]:
    return {key: stats(pipe)[key] for key in COUNTERS}


def _disagreements(rank: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case's error, then whether the next agreeing call gives one process's image."""
    pipe = tiny_pipeline("qwen-image")
    alone = _call(pipe)
    accelerate(pipe, debug=True, cfg_parallel=True)
    report: dict[str, Any] = {"errors": {}, "recovered": {}}
    for name, options in cases.items():
        report["errors"][name] = _error(pipe, **options)
        report["recovered"][name] = torch.equal(_call(pipe), alone)
    restore(pipe)
    return report


def _values_checks(rank: int) -> dict[str, Any]:
    """Disagreements that the exchange survives (each rank still reaches every exchange)."""
    return _disagreements(
        rank,
        {"seed": {"seed": rank}, "prompt": {"prompt": PROMPTS[rank]}, "true_cfg_scale": {"scale": (4.0, 5.0)[rank]}},
    )


def _hang_checks(rank: int) -> dict[str, Any]:
    """Disagreements that leave one rank waiting in an exchange the other never makes, unless caught:
    another step count, and true CFG on rank 0 only (rank 1 has no negative prompt)."""
    report = _disagreements(
        rank, {"steps": {"steps": STEPS + rank}, "cfg_on_one_rank": {"negative": NEGATIVE if rank == 0 else None}}
    )
    # A pipeline that is not accelerated but shares the accelerated transformer (and the scheduler): its
    # calls' arguments are unknown to the split, so the ranks compare whether they paired at the second step.
    from diffusers import QwenImagePipeline

    pipe = tiny_pipeline("qwen-image")
    alone = _call(pipe)
    accelerate(pipe, debug=True, cfg_parallel=True)
    other = QwenImagePipeline(**pipe.components)
    other.set_progress_bar_config(disable=True)
    report["errors"]["unaccelerated_cfg_on_one_rank"] = _error(other, negative=NEGATIVE if rank == 0 else None)
    before = _counters(pipe)
    report["recovered"]["unaccelerated_cfg_on_one_rank"] = torch.equal(_call(other), alone)
    report["unaccelerated_exchanges"] = _counters(pipe)["cfg_exchanges"] - before["cfg_exchanges"]
    restore(pipe)
    return report


def _named(error: str) -> str:
    """What a mismatch error names as differing (the text before its advice)."""
    return error.split(". Every rank must")[0]


def _check_named(reports: list[dict[str, Any]], expected: dict[str, tuple[str, ...]]) -> None:
    """Every case raised the same error on both ranks, naming what ``expected`` says; the next call recovered."""
    for name, words in expected.items():
        errors = [report["errors"][name] for report in reports]
        assert errors[0] is not None and errors[0] == errors[1], (name, errors)
        assert errors[0].startswith("CfgMismatchError: cfg_parallel: the ranks disagree on "), (name, errors[0])
        assert all(word in _named(errors[0]) for word in words), (name, words, errors[0])
        assert "same seed" in errors[0], errors[0]  # says what to do
        assert all(report["recovered"][name] for report in reports), (name, reports)


def _own_scheduler_checks(rank: int) -> dict[str, Any]:
    """Two accelerated pipelines share the transformer, each with its own scheduler."""
    from diffusers import QwenImagePipeline

    pipe = tiny_pipeline("qwen-image")
    alone = _call(pipe)
    second = QwenImagePipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})
    second.set_progress_bar_config(disable=True)
    accelerate(pipe, debug=True, cfg_parallel=True)
    accelerate(second, debug=True, cfg_parallel=True)
    report: dict[str, Any] = {"equal": [], "counted": []}
    for caller in (pipe, second, second, pipe):
        before = _counters(pipe)
        report["equal"].append(torch.equal(_call(caller), alone))
        report["counted"].append({key: value - before[key] for key, value in _counters(pipe).items()})
    restore(second)
    restore(pipe)
    return report


def _all_checks(rank: int) -> dict[str, Any]:
    return {"values": _values_checks(rank), "hang": _hang_checks(rank), "own_scheduler": _own_scheduler_checks(rank)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each check's report per rank, in rank order, from one pair of processes."""
    ranks = _parallel.gloo_reports(_all_checks, WORLD, tmp_path_factory.mktemp("agreement"), timeout=TIMEOUT)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


@pytest.mark.heavy  # two processes, each importing torch and building the pipeline
def test_ranks_with_other_seeds_prompts_or_guidance_both_raise_naming_it(reports) -> None:
    values = reports["values"]
    _check_named(
        values,
        {
            "seed": ("latents checksum (rank 0: ",),
            "prompt": ("prompt embeddings",),
            "true_cfg_scale": ("true_cfg_scale (rank 0: 4.0, rank 1: 5.0)",),
        },
    )
    # only what differs is named (the advice after it names everything)
    assert "latents" not in _named(values[0]["errors"]["true_cfg_scale"]), values[0]
    assert "prompt" not in _named(values[0]["errors"]["seed"]), values[0]


@pytest.mark.heavy
def test_ranks_with_other_steps_or_cfg_on_one_rank_both_raise_instead_of_hanging(reports) -> None:
    hang = reports["hang"]
    _check_named(
        hang,
        {
            "steps": (f"steps (rank 0: {STEPS}, rank 1: {STEPS + 1})",),
            "cfg_on_one_rank": ("true CFG (rank 0: yes, rank 1: no)",),
            "unaccelerated_cfg_on_one_rank": ("whether this call does true CFG",),
        },
    )
    # the agreeing call of the pipeline that is not accelerated was split as usual
    assert all(report["unaccelerated_exchanges"] == STEPS - 1 for report in hang), hang


@pytest.mark.heavy
def test_each_pipeline_sharing_the_transformer_finds_its_first_step_in_its_own_scheduler(reports) -> None:
    for report in reports["own_scheduler"]:
        assert all(report["equal"]), report
        # the first step of every call runs whole on both ranks; each later step is split once
        assert report["counted"] == [{"cfg_split_calls": STEPS - 1, "cfg_exchanges": STEPS - 1}] * 4, report
