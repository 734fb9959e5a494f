"""Reliability on a GPU: failed captures, faults, two pools, long runs (marker: cuda)."""

from __future__ import annotations

import threading

import pytest
import torch

from bcg_diffusion import BCGWarning, eager_break
from bcg_diffusion.core.graphs import GraphPool
from bcg_diffusion.core.runner import GraphRunner

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


def _runner(fn, pool=None, **options):
    return GraphRunner(fn, name="toy", pool=pool or GraphPool(torch.device("cuda")), lock=threading.RLock(), **options)


WEIGHT = None


def _model(x):
    global WEIGHT
    if WEIGHT is None:
        WEIGHT = torch.randn(64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    if x.shape[0] == 3:  # one signature hits a host sync with no break (auto_breaks off): its capture fails
        x = x * float(x.abs().max().item())
    return torch.tanh(x @ WEIGHT) @ WEIGHT


def test_failed_capture_in_the_middle_does_not_disturb_other_signatures():
    runner = _runner(_model, auto_breaks=False)
    a, b, c = (torch.randn(n, 64, device="cuda") for n in (2, 3, 5))
    runner(a)
    with pytest.warns(BCGWarning, match="capture failed"):
        assert torch.equal(runner(b), _model(b))
    runner(c)  # captured after the failure, on the renewed pool
    assert runner.counters.captures == 2 and runner.counters.eager_fallbacks == 1
    scratch = []
    for step in range(8):
        x = torch.randn((2, 3, 5)[step % 3], 64, device="cuda")
        scratch.append(torch.randn(4096 + 512 * step, device="cuda"))
        if step % 2:
            scratch.pop(0)
        assert torch.equal(runner(x), _model(x))
    assert runner.counters.captures == 2
    # the loop's shapes are 2, 3, 5, 2, 3, 5, 2, 3: five replays, three more eager calls for the failed one
    assert runner.counters.replays == 5 and runner.counters.eager_fallbacks == 1 + 3


def test_exception_inside_a_break_during_capture_falls_back_for_that_signature():
    calls = {"n": 0}

    @eager_break
    def flaky(x):
        calls["n"] += 1
        if calls["n"] == 3:  # two warm-ups pass; the capture run fails
            raise RuntimeError("transient failure inside a break")
        return x.sum().item()

    def fn(x):
        return x * flaky(x)

    runner = _runner(fn)
    x = torch.ones(8, device="cuda")
    with pytest.warns(BCGWarning, match="transient failure inside a break"):
        assert torch.equal(runner(x), x * 8)
    record = runner.records()[0]
    assert record.status == "failed" and "transient failure" in record.reason
    y = torch.ones(4, device="cuda")
    assert torch.equal(runner(y), y * 4) and runner.counters.captures == 1  # another signature still captures
    assert torch.equal(runner(y), y * 4) and runner.counters.replays == 1  # and replays
    assert runner.counters.eager_fallbacks == 1  # the failed capture's call only


def test_out_of_memory_during_capture_falls_back_and_says_so():
    def fn(x):
        if torch.cuda.is_current_stream_capturing():
            torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB: out of memory, in capture only
        return x + 1

    runner = _runner(fn)
    x = torch.randn(16, device="cuda")
    with pytest.warns(BCGWarning, match="capture failed: .*(OutOfMemoryError|out of memory)"):
        assert torch.equal(runner(x), x + 1)
    assert runner.counters.eager_fallbacks == 1
    other = _runner(lambda x: x * 2, runner.pool)
    assert torch.equal(other(x), x * 2) and other.counters.captures == 1
    assert torch.equal(other(x), x * 2) and (other.counters.replays, other.counters.eager_fallbacks) == (1, 0)


def test_two_pools_do_not_disturb_each_other():
    first, second = _runner(lambda x: (x @ x.T).relu()), _runner(lambda x: x.sin() * 3)
    for step in range(6):
        x = torch.randn(8 + step % 2, 8, device="cuda")
        assert torch.equal(first(x), (x @ x.T).relu())
        assert torch.equal(second(x), x.sin() * 3)
    assert first.pool.handle != second.pool.handle
    assert first.counters.captures == 2 and second.counters.captures == 2
    # two shapes over six steps: two captures, then four replays each, none eager
    for runner in (first, second):
        assert (runner.counters.replays, runner.counters.eager_fallbacks) == (4, 0)


def test_long_run_keeps_memory_and_captures_flat():
    runner = _runner(lambda x: torch.tanh(x @ x.transpose(-1, -2)).sum(-1))
    shapes = [(1, 64, 32), (2, 64, 32), (1, 128, 32), (4, 16, 32)]
    for shape in shapes:  # warm-up: one capture per signature
        runner(torch.randn(shape, device="cuda"))
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for step in range(200):
        x = torch.randn(shapes[step % len(shapes)], device="cuda")
        out = runner(x)
        del x, out
    torch.cuda.synchronize()
    assert runner.counters.captures == len(shapes) and runner.counters.replays == 200
    assert runner.counters.eager_fallbacks == 0
    assert torch.cuda.memory_allocated() <= baseline, "allocated memory grew over 200 replays"
