"""Context parallelism on CPU: two processes over gloo, tiny Qwen-Image, runner in debug mode.

Covers the bookkeeping that needs no GPU: the layout in the signature, the collectives patch applied and
reverted, eager-equal results, no recapture, a clear error for a text length that does not divide, and
the capture consensus (every rank abandons a capture that failed on one). The graphs themselves run in
``test_parallel_cuda.py`` on two GPUs.
"""

from __future__ import annotations

import _parallel
import pytest
import torch

pytestmark = pytest.mark.heavy  # starts two processes, each importing torch and building the pipeline

WORLD = 2


def _checks(rank: int) -> dict:
    report = _parallel.rank_checks("tiny", torch.device("cpu"), [(64, 64)])
    report["consensus"] = _parallel.consensus_protocol()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _parallel.gloo_reports(_checks, WORLD, tmp_path_factory.mktemp("parallel"))


def test_every_call_equals_context_parallel_eager(reports: list[dict]) -> None:
    for report in reports:
        assert report["cases"], report
        assert all(case["equal"] for case in report["cases"].values()), report["cases"]
        # the equalities prove something only if the accelerated calls captured and replayed (assert_graphs_ran)
        assert not report["graphs_not_run"], report["graphs_not_run"]
    # every rank ends with the whole image (diffusers gathers it), the same on all ranks
    assert reports[0]["cases"] == reports[1]["cases"]


def test_collectives_patched_while_accelerated_and_reverted(reports: list[dict]) -> None:
    for report in reports:
        assert any("collectives" in name for name in report["patches"]), report["patches"]
        assert report["patch_reverted"]
        assert report["collectives_ok"]


def test_no_recapture_over_50_calls(reports: list[dict]) -> None:
    for report in reports:
        assert report["captures_after_50_calls"] == report["captures_before_50_calls"] > 0
        assert report["eager_fallbacks"] == 0


def test_signature_includes_the_parallel_layout(reports: list[dict]) -> None:
    from bcg_diffusion.features.context_parallel import ParallelLayout

    for report in reports:
        degrees = (2, 1) if report["kind"] == "ulysses" else (1, 2)
        key = ParallelLayout(
            ulysses_degree=degrees[0], ring_degree=degrees[1], rank=report["rank"], anything=False
        ).key
        assert report["signatures"]
        assert all(repr(key) in signature["state"] for signature in report["signatures"]), report["signatures"]


def test_text_length_that_does_not_divide_gets_a_clear_error(reports: list[dict]) -> None:
    for report in reports:
        message = report["odd_length_error"]
        assert message and "context parallelism over 2 ranks" in message and "text_buckets" in message


def test_capture_consensus_makes_every_rank_see_a_failure(reports: list[dict]) -> None:
    for report in reports:
        assert report["consensus"] == [True, False]
