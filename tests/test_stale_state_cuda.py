"""The scenarios of tests/test_stale_state.py with real graphs on a GPU (marker: cuda), exact and fast mode.

One block's processor and its attributes, attributes that are not plain values, global settings, hooks and
instance forwards, a component replaced on the pipeline, and a forward that writes into its inputs: each
accelerated call equals the same call through ``eager(pipe)`` byte for byte (the eager forwards in exact mode,
the compiled blocks without graphs in fast mode), with the change seen by a new capture.
"""

from __future__ import annotations

import threading

import pytest
import test_stale_state as scenarios
import torch
from _cases import cuda_pipeline

from bcg_diffusion import restore, stats
from bcg_diffusion.core.graphs import GraphPool
from bcg_diffusion.core.runner import GraphRunner

pytestmark = pytest.mark.cuda

MODES = [{"mode": "exact"}, {"mode": "fast"}]


@pytest.fixture(params=MODES, ids=lambda options: options["mode"])
def options(request):
    return request.param


@pytest.fixture
def pipe():
    with cuda_pipeline("z-image", "tiny") as pipe:
        yield pipe
        if stats(pipe)["active"]:
            restore(pipe)


def test_one_blocks_processor_and_its_attributes(pipe, options):
    scenarios.test_one_blocks_processor_and_its_attributes_are_watched(pipe, options)


@pytest.mark.parametrize("change", scenarios.NON_PLAIN)
def test_attributes_that_are_not_plain_values(pipe, change, options):
    scenarios.test_attributes_that_are_not_plain_values_are_watched(pipe, change, options)


@pytest.mark.parametrize("setting", scenarios.SETTINGS)
def test_global_settings(pipe, setting, caplog, options):
    scenarios.test_a_call_under_other_global_settings_captures_graphs_of_its_own(pipe, setting, caplog, options)


def test_hooks_and_instance_forwards(pipe, options):
    scenarios.test_hooks_and_instance_forwards_added_after_the_capture_are_seen(pipe, options)


def test_a_component_replaced(pipe, options):
    scenarios.test_a_component_replaced_on_the_pipeline_is_accelerated_at_its_next_call(pipe, options)


def test_a_forward_that_writes_into_its_inputs_on_graphs():
    model = scenarios.WritesItsInput()
    runner = GraphRunner(model.forward, name="toy", pool=GraphPool("cuda"), lock=threading.RLock(), module=model)
    cache, expected_cache = torch.zeros(3, device="cuda"), torch.zeros(3, device="cuda")
    x = torch.full((3,), 3.0, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            out, expected = runner(x, cache), model(x, expected_cache)
            assert torch.equal(cache, expected_cache) and torch.equal(out, expected), (cache, expected_cache)
    assert runner.counters.captures == 1 and runner.counters.replays == 2
    assert runner.records()[0].written_inputs == [1]
    runner.close()
