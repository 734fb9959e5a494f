"""A record replays like a CUDA graph (bcg_diffusion.core.recording), on toy functions on the CPU: the new inputs'
values, the old Python values, memory written where it is, constants written again, host reads as breaks."""

from __future__ import annotations

import pytest
import torch

from bcg_diffusion.core.auto_breaks import AutoBreaker
from bcg_diffusion.core.graphs import BreakResultMismatch, eager_break
from bcg_diffusion.core.recording import first_difference, record_breakable

SCALE = 2.0


def _record(fn, breaker=True, **options):
    with torch.no_grad():
        return record_breakable(fn, breaker=AutoBreaker(None, device_type="cpu") if breaker else None, **options)


def test_a_replay_computes_the_new_inputs_with_the_python_values_of_its_capture():
    global SCALE
    x = torch.randn(4)
    graph, out = _record(lambda: (x * SCALE).sin())
    try:
        SCALE = 3.0  # a graph keeps 2.0
        x.copy_(torch.randn(4))
        graph.replay()
        assert torch.equal(out, (x * 2.0).sin())
    finally:
        SCALE = 2.0


def test_tensors_held_outside_are_written_where_they_are_and_temporaries_freed():
    x = torch.randn(4)
    cache = {}

    def forward():
        hidden = x + 1
        cache["kept"] = hidden[:2]  # a view of a temporary, held by someone else: its memory is kept
        return (hidden * 2).cos()

    graph, out = _record(forward)
    kept = cache["kept"]
    x.copy_(torch.randn(4))
    graph.replay()
    assert torch.equal(kept, (x + 1)[:2]) and torch.equal(out, ((x + 1) * 2).cos())
    assert cache["kept"] is kept  # no Python ran: the dict holds the capture's tensor, rewritten in place


def test_a_tensor_built_from_python_data_is_a_constant_written_again_at_every_replay():
    def forward():
        ids = torch.tensor([0.0, 1.0, 2.0])
        ids += 10  # changed in place after it was built: each replay starts from the value as built
        return ids * 2

    graph, out = _record(forward)
    for _ in range(2):
        graph.replay()
        assert torch.equal(out, torch.tensor([20.0, 22.0, 24.0]))


def test_host_reads_are_breaks_whose_values_a_replay_checks():
    x = torch.tensor([1.0, 2.0])

    def forward():
        return x * len(x.tolist()) + float(x.sum())

    graph, out = _record(forward)
    assert graph.num_breaks == 2
    x.copy_(torch.tensor([2.0, 1.0]))  # the same sum and list length, other values: tolist's result differs
    with pytest.raises(BreakResultMismatch):
        graph.replay()


def test_without_automatic_breaks_a_host_read_is_refused_as_cuda_would():
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        _record(lambda: x * float(x.sum()), breaker=False)


def test_marked_breaks_run_again_on_the_objects_of_the_capture():
    calls = []

    @eager_break
    def noted(t):
        calls.append(t.clone())
        return t * 2

    x = torch.randn(3)
    graph, out = _record(lambda: noted(x + 1) - 1)
    x.copy_(torch.randn(3))
    graph.replay()
    assert torch.equal(calls[-1], x + 1) and torch.equal(out, (x + 1) * 2 - 1)


def _hook_reads_scale(x):
    return x * SCALE


def test_first_difference_names_the_operation_and_its_line():
    global SCALE
    x = torch.randn(4)
    graph, _ = _record(lambda: _hook_reads_scale(x + 1).cos())
    try:
        SCALE = 5.0
        fresh, _ = _record(lambda: _hook_reads_scale(x + 1).cos(), sites=True, observe=True)
        found = first_difference(graph, fresh)
    finally:
        SCALE = 2.0
    assert found is not None and found.op == "aten.mul.Tensor" and found.index == 1
    assert "test_recording.py" in found.where and "_hook_reads_scale" in found.where
