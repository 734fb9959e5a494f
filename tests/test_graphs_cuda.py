"""The breakable capture core on a GPU, with small modules (marker: cuda)."""

from __future__ import annotations

import threading

import pytest
import torch

from bcg_diffusion.core.graphs import BreakableGraph, BreakResultMismatch, GraphPool, capture_breakable, eager_break
from bcg_diffusion.core.runner import GraphRunner

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


@pytest.fixture
def pool():
    return GraphPool(torch.device("cuda"))


def _capture(fn, pool, *args):
    """Warm up and capture fn(*args) on the pool's stream, the way the runner does."""
    caller = torch.cuda.current_stream()
    pool.stream.wait_stream(caller)
    with torch.cuda.stream(pool.stream):
        fn(*args)
        fn(*args)
        graph, out = capture_breakable(lambda: fn(*args), pool)
    caller.wait_stream(pool.stream)
    return graph, out


@eager_break
def host_scale(x: torch.Tensor) -> torch.Tensor:
    # A host sync: its Python value steers the result, so it cannot be captured.
    return x * (1.0 + float(x.abs().max().item()))


def forward_with_sync(x: torch.Tensor) -> torch.Tensor:
    return host_scale(x.sin() * 2).cos() + 1


def test_break_with_host_sync_replays_fresh_inputs(pool):
    static_x = torch.randn(64, 32, device="cuda")
    graph, out = _capture(forward_with_sync, pool, static_x)
    assert graph.num_breaks == 1 and graph.num_segments == 2
    assert torch.equal(out, forward_with_sync(static_x))  # capture already produced real results
    for _ in range(3):
        fresh = torch.randn(64, 32, device="cuda")
        static_x.copy_(fresh)
        graph.replay()
        assert torch.equal(out, forward_with_sync(fresh))


@eager_break
def write_into(buffer: torch.Tensor, source: torch.Tensor) -> None:
    buffer.copy_(source.cpu().to("cuda"))  # a round trip through host memory


def test_break_that_writes_into_an_argument(pool):
    static_x = torch.randn(128, device="cuda")
    buffer = torch.empty(128, device="cuda")

    def fn(x):
        y = x * 3
        write_into(buffer, y)
        return buffer + 1

    graph, out = _capture(fn, pool, static_x)
    assert graph.num_breaks == 1 and graph.num_segments == 2  # x * 3 | the round trip | buffer + 1
    for _ in range(3):
        fresh = torch.randn(128, device="cuda")
        static_x.copy_(fresh)
        graph.replay()
        assert torch.equal(out, fresh * 3 + 1)


def test_break_returning_a_python_value_is_checked_on_replay(pool):
    @eager_break
    def positive_count(x):
        return int((x > 0).sum().item())

    static_x = torch.ones(8, device="cuda")

    def fn(x):
        return x * positive_count(x)

    graph, out = _capture(fn, pool, static_x)
    assert graph.num_breaks == 1 and graph.num_segments == 1  # the break comes first: no segment before it
    static_x.copy_(torch.full((8,), 2.0, device="cuda"))
    graph.replay()  # same count: fine
    assert torch.equal(out, torch.full((8,), 16.0, device="cuda"))
    static_x.copy_(-torch.ones(8, device="cuda"))
    with pytest.raises(BreakResultMismatch):
        graph.replay()


def test_nested_containers_in_and_out():
    lock = threading.RLock()
    pool = GraphPool(torch.device("cuda"))

    def fn(items, extra, scale=1.0):
        a, b = items
        return {"sum": [a + b, (a * b,)], "scaled": extra["x"] * scale, "none": None}

    runner = GraphRunner(fn, name="toy", pool=pool, lock=lock)
    for _ in range(4):
        a, b, x = (torch.randn(16, device="cuda") for _ in range(3))
        out = runner([a, b], {"x": x}, scale=2.0)
        assert torch.equal(out["sum"][0], a + b) and torch.equal(out["sum"][1][0], a * b)
        assert torch.equal(out["scaled"], x * 2.0) and out["none"] is None
    assert runner.counters.captures == 1 and runner.counters.replays == 3 and runner.counters.eager_fallbacks == 0


def test_outputs_are_cloned_so_calls_do_not_alias(pool):
    runner = GraphRunner(lambda x: x * 2, name="toy", pool=pool, lock=threading.RLock())
    first_input, second_input = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    first = runner(first_input)
    second = runner(second_input)
    third = runner(first_input)
    assert torch.equal(first, first_input * 2) and torch.equal(second, second_input * 2)
    assert first.data_ptr() != third.data_ptr()
    # the outputs compared came from one capture and two replays of its graph, not from eager calls
    assert (runner.counters.captures, runner.counters.replays, runner.counters.eager_fallbacks) == (1, 2, 0)


def test_side_stream_inside_a_segment(pool):
    side = torch.cuda.Stream()

    def fn(x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x.exp()
        # not joined here on purpose: the break must join it before its segment ends
        z = host_scale(x)
        torch.cuda.current_stream().wait_stream(side)
        return y + z

    static_x = torch.randn(256, device="cuda")
    graph, out = _capture(fn, pool, static_x)
    assert graph.num_breaks == 1 and graph.num_segments == 2
    fresh = torch.randn(256, device="cuda")
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fresh.exp() + host_scale(fresh))


def test_exception_in_a_break_leaves_no_capture_open(pool):
    @eager_break
    def boom(x):
        raise RuntimeError("boom inside a break")

    static_x = torch.randn(8, device="cuda")
    caller = torch.cuda.current_stream()
    pool.stream.wait_stream(caller)
    with torch.cuda.stream(pool.stream), pytest.raises(RuntimeError, match="boom inside a break"):
        capture_breakable(lambda: boom(static_x * 2) + 1, pool)
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(pool.stream):
        assert not torch.cuda.is_current_stream_capturing()
    graph, out = _capture(forward_with_sync, pool, static_x)  # the next capture works
    torch.cuda.synchronize()
    assert graph.num_breaks == 1 and graph.num_segments == 2
    assert torch.equal(out, forward_with_sync(static_x))


def test_uncapturable_op_without_a_break_falls_back_in_the_runner(pool):
    def fn(x):
        return x * float(x.sum().item())

    runner = GraphRunner(fn, name="toy", pool=pool, lock=threading.RLock(), auto_breaks=False)
    x = torch.randn(8, device="cuda")
    with pytest.warns(UserWarning, match="capture failed"):
        out = runner(x)
    assert torch.equal(out, fn(x))
    assert runner.counters.eager_fallbacks == 1 and runner.counters.captures == 0
    assert torch.equal(runner(x), fn(x))  # not retried, still correct
    assert runner.counters.eager_fallbacks == 2
    ok = GraphRunner(lambda x: x + 1, name="ok", pool=pool, lock=threading.RLock())
    assert torch.equal(ok(x), x + 1) and ok.counters.captures == 1  # CUDA state still usable
    assert torch.equal(ok(x), x + 1) and (ok.counters.replays, ok.counters.eager_fallbacks) == (1, 0)


def test_two_captures_share_the_pool_and_replay_interleaved():
    pool = GraphPool(torch.device("cuda"))
    lock = threading.RLock()
    weight = torch.randn(64, 64, device="cuda")

    def fn(x):
        h = (x @ weight).relu()
        h = host_scale(h)
        return (h @ weight).tanh()

    runner = GraphRunner(fn, name="toy", pool=pool, lock=lock)
    a_in, b_in = torch.randn(4, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    runner(a_in)
    runner(b_in)
    assert runner.counters.captures == 2
    keep = []
    for step in range(6):
        x = torch.randn(4 if step % 2 == 0 else 32, 64, device="cuda")
        keep.append(torch.randn(1000 + step * 317, device="cuda"))  # unrelated allocations and frees
        if step % 3 == 2:
            keep.clear()
        assert torch.equal(runner(x), fn(x))
    assert runner.counters.captures == 2 and runner.counters.replays == 6 and runner.counters.eager_fallbacks == 0


def test_lazily_cached_tensor_outlives_its_owner(pool):
    cache = {}

    def table(device):
        if "t" not in cache:
            cache["t"] = torch.arange(1024, device=device, dtype=torch.float32)
        return cache["t"]

    def fn(x):
        return x + table(x.device)

    runner = GraphRunner(fn, name="toy", pool=pool, lock=threading.RLock())
    x = torch.randn(1024, device="cuda")
    expected = fn(x)
    runner(x)
    cache.clear()  # the only owner drops the table the graph reads
    torch.cuda.empty_cache()
    scratch = [torch.full((1024,), 7.0, device="cuda") for _ in range(64)]
    assert torch.equal(runner(x), expected)
    # that result came from a replay of the graph that reads the dropped table, not from an eager call
    assert (runner.counters.captures, runner.counters.replays, runner.counters.eager_fallbacks) == (1, 1, 0)
    del scratch


def test_empty_first_segment_is_dropped(pool):
    static_x = torch.randn(8, device="cuda")
    graph, out = _capture(lambda x: host_scale(x) * 2, pool, static_x)
    assert isinstance(graph, BreakableGraph)
    assert graph.num_breaks == 1 and graph.num_segments == 1
    fresh = torch.randn(8, device="cuda")
    static_x.copy_(fresh)
    graph.replay()
    assert torch.equal(out, host_scale(fresh) * 2)
