"""Diffusers pipelines beyond the two we tune, tiny and on the CPU in debug mode (bench.coverage): the
runner takes them, gives eager's bytes, and reports what a capture would meet outside the breaks."""

from __future__ import annotations

import pytest

from bench.coverage import TINY, check_tiny


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_pipeline_runs_the_runner_path_and_equals_eager(name):
    row = check_tiny(name)
    assert row["active"], row["reason"]
    assert row["identical"], row
    assert row["replays"] > 0 and row["signatures"] >= 2, row  # transformer and VAE at least
    assert all(" at " in op and "(" in op for op in row["hostile_ops"]), row["hostile_ops"]
