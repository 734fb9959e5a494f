"""One check shared by every accelerated-vs-eager comparison: the graphs really captured and replayed.

An equality between an accelerated call and eager proves nothing when the accelerated path quietly
ran eagerly (a failed capture, a suspended runner, a miss): the two are then the same code. Every
test that compares with eager calls :func:`assert_graphs_ran` on the calls it compared.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bcg_diffusion import stats

# Inductor compiles C++ on CPU: the tests that compile (fast mode on CPU) need a compiler.
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler (g++)")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason='needs Triton (its interpreter): pip install "triton==3.6.0"'
)


def run_interpreted(script: str) -> None:
    """Run ``tests/<script>`` in a process of its own with ``TRITON_INTERPRET=1`` (Triton reads it when it
    is imported, which inductor may already have done in the test process) and assert it ended well:
    exit 0 and its last line of success, ``all cases within tolerance``."""
    from bcg_diffusion.kernels import TESTED_TRITON

    version = importlib.metadata.version("triton")
    if ".".join(version.split(".")[:2]) not in TESTED_TRITON:
        pytest.skip(f"needs Triton {' or '.join(TESTED_TRITON)}: the library keeps its kernels off under {version}")
    path = Path(__file__).with_name(script)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all cases within tolerance" in done.stdout


def assert_graphs_ran(
    pipe: Any,
    before: dict[str, Any] | None = None,
    *,
    captures: bool | None = None,
    components: Iterable[str] = (),
) -> dict:
    """Assert that ``pipe`` ran its accelerated path since ``before`` (a ``stats(pipe)`` taken earlier;
    None: since ``accelerate``): active, at least one replay, no eager fallback, no miss, no signature
    that failed to capture. ``captures=True`` also asks for a new capture, ``False`` for none.
    ``components`` (``("transformer",)``...): each of these runners must itself have replayed, with no
    fallback, miss or failed signature of its own, so that another component's replays (the VAE's)
    cannot stand in for it.

    Raises :class:`GraphsDidNotRun` (an AssertionError). Returns the new ``stats(pipe)``, to pass as
    ``before`` to the next check.
    """
    return assert_report_ran(stats(pipe), before, captures=captures, components=components)


class GraphsDidNotRun(AssertionError):
    """What :func:`assert_graphs_ran` raises: a test that is expected to fail only because its graphs do
    not run (a known limitation) says so with ``pytest.mark.xfail(strict=True, raises=GraphsDidNotRun)``,
    and any other failure of it still fails."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise GraphsDidNotRun(message)


_COUNTERS = ("captures", "replays", "eager_fallbacks", "misses")


def assert_report_ran(
    report: dict[str, Any],
    before: dict[str, Any] | None = None,
    *,
    captures: bool | None = None,
    components: Iterable[str] = (),
) -> dict:
    """:func:`assert_graphs_ran` on a ``stats`` report already taken (by code that gives the pipeline back
    before returning, like ``bench.coverage``: see :func:`recorded_stats`). Returns ``report``."""
    _check(report["active"], f"the pipeline runs eagerly: {report['reason']}")
    zero = dict.fromkeys(_COUNTERS, 0)
    old = before if before is not None else zero
    delta = {key: report[key] - old[key] for key in zero}
    failed = [s for s in report["signatures"] if s["status"] == "failed"]
    _check(not failed, f"signatures that failed to capture: {[(s['signature'], s['reason']) for s in failed]}")
    _check(delta["replays"] > 0, f"no replay since the last check: {delta}")
    _check(delta["eager_fallbacks"] == 0, f"calls fell back to eager: {delta}")
    _check(delta["misses"] == 0, f"calls missed their graphs: {delta}")
    if captures is not None:
        _check(
            (delta["captures"] > 0) == captures,
            f"captures {'expected' if captures else 'not expected'}: {delta}; per component: "
            f"{_component_deltas(report, before)}",
        )
    for name in components:
        counters = report["components"].get(name)
        _check(counters is not None, f"no runner for {name!r}; runners: {sorted(report['components'])}")
        previous = (before or {}).get("components", {}).get(name, zero)
        own = {key: counters[key] - previous[key] for key in zero}
        _check(own["replays"] > 0, f"{name} did not replay since the last check: {own}")
        _check(own["eager_fallbacks"] == 0 and own["misses"] == 0, f"{name} ran calls eagerly: {own}")
    return report


@contextlib.contextmanager
def recorded_stats(module: ModuleType) -> Iterator[list[dict[str, Any]]]:
    """Every report that ``module``'s code takes with ``stats(pipe)`` (``bench.coverage`` imports it by
    name) while inside, in order: the tests check them with :func:`assert_report_ran`, since those
    functions restore the pipeline before they return."""
    reports: list[dict[str, Any]] = []
    original = module.stats

    def recording(pipe: Any) -> dict[str, Any]:
        reports.append(original(pipe))
        return reports[-1]

    module.stats = recording
    try:
        yield reports
    finally:
        module.stats = original


def compiled_and_replayed(fn: Any, args: tuple[Any, ...], change_inputs: Any) -> tuple[Any, list[Any], list[Any], Any]:
    """``fn`` compiled whole by inductor (``fullgraph=True``), called on ``args``, then captured in a CUDA
    graph (after a warm-up on the capture stream) and replayed; then ``change_inputs()`` alters the inputs in
    place and the graph replays again. Returns the compiled call's outputs, a clone of the first replay's,
    the graph's output tensors after the second replay, and the compiled call's outputs on the changed
    inputs: a graph that replays the compiled function's bytes gives ``first replay == compiled`` and
    ``second replay == compiled on the changed inputs``. Resets dynamo before and after. Needs a GPU."""
    import torch

    torch._dynamo.reset()
    try:
        compiled_fn = torch.compile(fn, fullgraph=True)
        compiled = compiled_fn(*args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled_fn(*args)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = compiled_fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured]
        change_inputs()
        graph.replay()
        changed = compiled_fn(*args)
        torch.cuda.synchronize()
    finally:
        torch._dynamo.reset()
    return compiled, replayed, list(captured), changed


def _component_deltas(report: dict[str, Any], before: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """Each runner's counters that moved since ``before`` (what a failed capture check says about who
    captured, and why: a state change, an invalidation, an eviction)."""
    deltas = {}
    for name, counters in report["components"].items():
        previous = (before or {}).get("components", {}).get(name, {})
        moved = {
            key: value - previous.get(key, 0)
            for key, value in counters.items()
            if isinstance(value, int) and not isinstance(value, bool) and value != previous.get(key, 0)
        }
        if moved:
            deltas[name] = moved
    return deltas
