"""Shared test setup: the `cuda` marker skips cleanly on machines without a GPU, and the run ends with a
short account of what did not run and why (one or two lines per reason).

Two settings only make the suite faster, on small machines above all; neither changes what a test computes:

- on a machine of 4 cores or fewer, inductor compiles in the test process (``TORCHINDUCTOR_COMPILE_THREADS=1``)
  instead of first starting a pool of worker processes, each importing torch (about 18 s on 2 cores);
- once the tests are collected, everything imported so far (torch, diffusers, transformers: about 400,000
  objects that live as long as the process) is frozen out of the garbage collector's view (``gc.freeze``), so a
  full collection, which every ``restore()`` runs, takes microseconds instead of about 0.4 s. Objects the tests
  make are collected as before.
"""

from __future__ import annotations

import gc
import os
import re
from collections import Counter

if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402 - after the environment inductor reads on import
import torch  # noqa: E402

CUDA_SKIP = "needs a CUDA GPU"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return re.sub(r"^Skipped: ", "", reason).strip()


def skip_lines(reasons: Counter[str]) -> list[str]:
    """One line per skip reason, most frequent first: "39 tests need a CUDA GPU (skipped)" for a reason that
    starts with "needs", "2 tests skipped: <reason>" otherwise."""
    lines = []
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        tests = f"{count} test" + ("s" if count != 1 else "")
        if reason.startswith("needs "):
            verb = "need" if count != 1 else "needs"
            lines.append(f"{tests} {verb} {reason.removeprefix('needs ')} (skipped)")
        else:
            lines.append(f"{tests} skipped: {reason}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """What did not run: skipped tests grouped by reason, and the tests ``-m`` deselected."""
    skipped = [report for report in terminalreporter.stats.get("skipped", []) if report.skipped]
    reasons = Counter(_skip_reason(report) for report in skipped)
    lines = skip_lines(reasons)
    deselected = len(terminalreporter.stats.get("deselected", []))
    if deselected:
        expression = config.getoption("markexpr", "") or config.getoption("keyword", "")
        how = f" by {expression!r}" if expression else ""
        tests = f"{deselected} test" + ("s" if deselected != 1 else "")
        lines.append(f"{tests} deselected{how}; `python -m pytest -q` runs the whole suite")
    if not lines:
        return
    terminalreporter.write_sep("-", "not run")
    for line in lines:
        terminalreporter.write_line(line)
