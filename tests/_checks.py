"""One check shared by every accelerated-vs-eager comparison: the graphs really captured and replayed.

An equality between an accelerated call and eager proves nothing when the accelerated path quietly
ran eagerly (a failed capture, a suspended runner, a miss): the two are then the same code. Every
test that compares with eager calls :func:`assert_graphs_ran` on the calls it compared.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from bcg_diffusion import stats

# Inductor compiles C++ on CPU: the tests that compile (fast mode on CPU) need a compiler.
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler (g++)")


def assert_graphs_ran(pipe: Any, before: dict[str, Any] | None = None, *, captures: bool | None = None) -> dict:
    """Assert that ``pipe`` ran its accelerated path since ``before`` (a ``stats(pipe)`` taken earlier;
    None: since ``accelerate``): active, at least one replay, no eager fallback, no miss, no signature
    that failed to capture. ``captures=True`` also asks for a new capture, ``False`` for none.

    Returns the new ``stats(pipe)``, to pass as ``before`` to the next check.
    """
    report = stats(pipe)
    assert report["active"], f"the pipeline runs eagerly: {report['reason']}"
    zero = {"captures": 0, "replays": 0, "eager_fallbacks": 0, "misses": 0}
    old = before if before is not None else zero
    delta = {key: report[key] - old[key] for key in zero}
    failed = [s for s in report["signatures"] if s["status"] == "failed"]
    assert not failed, f"signatures that failed to capture: {[(s['signature'], s['reason']) for s in failed]}"
    assert delta["replays"] > 0, f"no replay since the last check: {delta}"
    assert delta["eager_fallbacks"] == 0, f"calls fell back to eager: {delta}"
    assert delta["misses"] == 0, f"calls missed their graphs: {delta}"
    if captures is not None:
        assert (delta["captures"] > 0) == captures, f"captures {'expected' if captures else 'not expected'}: {delta}"
    return report
