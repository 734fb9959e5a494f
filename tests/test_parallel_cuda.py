"""Context parallelism with graphs on two GPUs: ``torchrun`` runs ``tests/_parallel.py`` on every rank.

Needs two CUDA GPUs (skipped otherwise). Weights from ``BCG_TEST_WEIGHTS`` (comma-separated, as in
``test_pipelines_cuda.py``): ``random-full`` checks the full-size Qwen-Image at 512² and 1024²; the
default tiny weights take seconds. ``BCG_PARALLEL_KINDS`` picks the splits (default ``ulysses,ring``).
The CPU checks of ``test_parallel_cpu.py`` run here again on the GPU reports (all but the consensus
protocol, which the fault check exercises for real), plus the fault check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cases import GPU_WEIGHTS
from test_parallel_cpu import (  # noqa: F401 - collected here again, on the GPU reports
    test_collectives_patched_while_accelerated_and_reverted,
    test_every_call_equals_context_parallel_eager,
    test_no_recapture_over_50_calls,
    test_signature_includes_the_parallel_layout,
    test_text_length_that_does_not_divide_gets_a_clear_error,
)

pytestmark = pytest.mark.cuda

KINDS = [k.strip() for k in os.environ.get("BCG_PARALLEL_KINDS", "ulysses,ring").split(",") if k.strip()]


def _resolutions(weights: str) -> str:
    return "512x512,1024x1024" if weights == "random-full" else "64x64,128x128"


@pytest.fixture(scope="module", params=[(w, k) for w in GPU_WEIGHTS for k in KINDS], ids=str)
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    weights, kind = request.param
    out = tmp_path_factory.mktemp("parallel-" + re.sub(r"[^\w.-]", "_", f"{weights}-{kind}"))
    script = Path(__file__).with_name("_parallel.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)]
    command += ["--weights", weights, "--resolutions", _resolutions(weights), "--kind", kind, "--out", str(out)]
    # A hang (ranks out of step) is a failure, not a stuck test run.
    subprocess.run(command, check=True, timeout=600)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_one_rank_failing_capture_makes_every_rank_run_eagerly(reports: list[dict]) -> None:
    for report in reports:
        fault = report["fault"]
        assert fault["equal"] and fault["eager_fallbacks"] >= 1, fault
        expected = "injected capture failure" if fault["failing_rank"] else "PeerCaptureFailed"
        assert any(expected in reason for reason in fault["reasons"]), fault
