"""Our graphs and inductor's (``torch.compile(mode="reduce-overhead")``) in one process (marker: cuda).

Inductor's CUDA-graph trees clear cuBLAS's workspaces whenever they record and then empty the
allocator's cache; a graph of ours that had baked in a workspace allocated outside its pool then
replayed into freed memory (an illegal memory access, full-size Z-Image on an H200: run 50 in
``bench/results/2026-12-01-h200``). Our captures now take their workspaces from their own pool.

Runs at Z-Image's full widths (two layers, random weights): small matrix products never used the
workspace, so they could not show the bug. ``BCG_TEST_WITHOUT_FIX=blas-workspaces`` runs the same
test with the fix taken out, to show that it fails then (run it alone: the process may crash).
"""

from __future__ import annotations

import os

import pytest
import torch
from _checks import assert_graphs_ran

from bcg_diffusion import accelerate, restore
from bcg_diffusion.core import graphs as graphs_module
from bcg_diffusion.models import build_pipeline

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def base():
    pipe = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16, num_layers=2)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    del pipe
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def without_fix(monkeypatch):
    if os.environ.get("BCG_TEST_WITHOUT_FIX") == "blas-workspaces":
        monkeypatch.setattr(graphs_module, "_release_blas_workspaces", lambda: None)


def _call(pipe) -> torch.Tensor:
    out = pipe(
        "a lighthouse at dusk",
        height=512,
        width=512,
        num_inference_steps=4,
        guidance_scale=0.0,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    )
    return out.images.cpu()


@pytest.mark.parametrize("order", ["ours-first", "peer-first"])
def test_reduce_overhead_beside_our_graphs(base, order):
    from bench.modes import _compile_with_own_graphs, pipeline_copy

    expected = _call(base)
    ours, peer = pipeline_copy(base), pipeline_copy(base)
    _compile_with_own_graphs(peer.transformer)  # torch.compile(mode="reduce-overhead"), outputs cloned
    peer_expected = None
    try:
        if order == "peer-first":
            peer_expected = _call(peer)
            _call(peer)
        accelerate(ours)
        assert torch.equal(_call(ours), expected)
        assert torch.equal(_call(ours), expected)
        before = assert_graphs_ran(ours)
        if order == "ours-first":
            peer_expected = _call(peer)  # inductor records its graphs now, after ours
            _call(peer)
        torch.cuda.empty_cache()  # what inductor's recording does too: freed memory goes back to the driver
        for _ in range(8):  # many replays of each, interleaved
            assert torch.equal(_call(ours), expected)
            assert torch.equal(_call(peer), peer_expected)
        torch.cuda.synchronize()
        assert_graphs_ran(ours, before, captures=False)
    finally:
        if hasattr(ours, "_bcg_state"):
            restore(ours)
        torch._dynamo.reset()
