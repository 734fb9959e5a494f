"""What the README promises a newcomer: its CPU snippet runs as written, and importing the package and a
pipeline class prints nothing from the test environment's dependencies."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _snippet(heading: str) -> str:
    """The first Python block under ``## heading`` in the README."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_cpu_snippet_runs_as_written_and_prints_the_counters():
    done = subprocess.run(
        [sys.executable, "-c", _snippet("Try it on a CPU")], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counters = eval(done.stdout.strip().splitlines()[-1])  # the snippet's last line prints a dict
    assert counters["captures"] > 0 and counters["replays"] > 0 and counters["eager_fallbacks"] == 0, counters


def test_the_test_extra_installs_nothing_that_is_noisy_on_import():
    # torchao prints "Failed to load ... .so" and makes diffusers warn on every `from diffusers import ...`
    # where its compiled extensions do not match the installed torch (a CPU build): it comes with the fp8 extra
    # only, and the FP8 tests skip without it.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [r for r in extras["test"] if r.startswith("torchao")], extras["test"]
    assert any(r.startswith("torchao") for r in extras["fp8"]), extras["fp8"]


def test_importing_the_package_and_a_pipeline_prints_nothing_of_ours():
    code = "import bcg_diffusion, bcg_diffusion.models; from diffusers import ZImagePipeline, QwenImagePipeline"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # torchao's lines only appear where the fp8 extra is installed (CI installs it for the FP8 tests)
    torchao = ("torchao", "_pytree.py", "register_constant", "Unable to import `torchao`")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert [line for line in lines if not any(mark in line for mark in torchao)] == [], lines
