"""Every pipeline of ``bench.coverage``, tiny, in real graphs (marker: cuda): exact mode captures the
transformer (with automatic breaks where a capture meets something) and gives eager's bytes; every
transformer of the pipeline replayed its own graphs, and nothing fell back to eager (the VAE's replays
alone do not pass).

The published sizes and the speed-ups are ``python -m bench.coverage --size full --device cuda``
(``scripts/gpu_session.sh coverage``); this is the quick check that runs first."""

from __future__ import annotations

import pytest
from _checks import assert_report_ran, recorded_stats

import bench.coverage as coverage
from bench.coverage import check
from bench.coverage_models import TINY

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_pipeline_captures_and_equals_eager(name):
    with recorded_stats(coverage) as reports:
        result = check(name, "tiny", "cuda", runs=2, modes=("exact",))
    [(label, case)] = result["cases"].items()
    exact = case["exact"]
    assert "error" not in exact, exact
    signatures = [s for s in exact["graphs"]["signatures"] if s["component"].startswith("transformer")]
    print(
        f"\n{name}: "
        + "; ".join(f"{s['status']} {s['segments']}/{s['breaks']} {s['auto_breaks']}" for s in signatures)
    )
    assert signatures and all(s["status"] == "captured" for s in signatures), signatures
    assert exact["identical"] and case["eager"]["deterministic"], (label, exact)
    [report] = reports  # exact mode's, taken after its calls and before restore
    transformers = sorted(c for c in report["components"] if c.startswith("transformer"))  # Wan 2.2: two
    assert "transformer" in transformers, sorted(report["components"])
    assert_report_ran(report, captures=True, components=[*transformers, "vae"])  # each replayed by itself
