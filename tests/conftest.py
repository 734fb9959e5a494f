"""Shared test setup: the `cuda` marker skips cleanly on machines without a GPU, and the run ends with a
short account of what did not run and why (one or two lines per reason).

Three settings only make the suite faster, on small machines above all; none changes what a test computes:

- on a machine of 4 cores or fewer, inductor compiles in the test process (``TORCHINDUCTOR_COMPILE_THREADS=1``)
  instead of first starting a pool of worker processes, each importing torch (about 18 s on 2 cores);
- once the tests are collected, everything imported so far (torch, diffusers, transformers: about 400,000
  objects that live as long as the process) is frozen out of the garbage collector's view (``gc.freeze``), so a
  full collection, which every ``restore()`` runs, takes microseconds instead of about 0.4 s. Objects the tests
  make are collected as before;
- after the last test of each file, once its module-scoped fixtures are torn down, a full collection frees what
  the file left and what is still alive is frozen too (:func:`pytest_runtest_teardown`): the modules imported
  on first use (inductor and dynamo, peft, torchao, diffusers' lazily loaded pipelines, gradio) and the caches
  that live as long as the process, about 700,000 more objects, which every later full collection would walk
  again (full collections took 40 of the 89 s of ``-m "not heavy"`` without this, 4 s with it; 2-core machine,
  2026-12-03). Objects a test makes are still collected as before: nothing is frozen while a file runs.

Every test leaves the process-wide settings as it found them (:func:`_process_settings`): a test that quantizes
with torchao's defaults (``set_inductor_config=True``) or flips a backend flag would otherwise change what every
later test computes or compiles, and the suite's results would depend on the order of its tests.
"""

from __future__ import annotations

import gc
import logging
import os
import re
from collections import Counter
from typing import Any

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


# torch's config modules whose every setting a test must leave as it found it (inductor's coordinate-descent
# tuning, dynamo's recompile limit, ...).
_CONFIG_MODULES = (
    "torch._inductor.config",
    "torch._dynamo.config",
    "torch._functorch.config",
    "torch.fx.experimental._config",
)
# (getter, setter) of process-wide flags outside those modules.
_FLAGS: dict[str, tuple[Any, Any]] = {
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    **{
        f"cudnn.{name}": (
            lambda name=name: getattr(torch.backends.cudnn, name),
            lambda value, name=name: setattr(torch.backends.cudnn, name, value),
        )
        for name in ("enabled", "benchmark", "deterministic", "allow_tf32")
    },
    **{
        f"cuda.matmul.{name}": (
            lambda name=name: getattr(torch.backends.cuda.matmul, name),
            lambda value, name=name: setattr(torch.backends.cuda.matmul, name, value),
        )
        for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    },
    **{
        f"{kind} attention": (
            getattr(torch.backends.cuda, f"{kind}_sdp_enabled"),
            getattr(torch.backends.cuda, f"enable_{kind}_sdp"),
        )
        for kind in ("flash", "mem_efficient", "math", "cudnn")
    },
}
# Environment variables that torch, its libraries and ours read while running (not only at import).
_ENVIRONMENT_PREFIXES = ("TORCH", "PYTORCH", "CUBLAS", "CUDNN", "NVIDIA_TF32", "BCG_")
_LOGGERS = ("", "bcg_diffusion", "torch", "diffusers", "transformers", "torchao")


def _settings() -> dict[str, Any]:
    import importlib

    saved: dict[str, Any] = {name: getter() for name, (getter, _) in _FLAGS.items()}
    for module in _CONFIG_MODULES:
        saved[module] = importlib.import_module(module).get_config_copy()
    saved["environment"] = {k: v for k, v in os.environ.items() if k.startswith(_ENVIRONMENT_PREFIXES)}
    saved["loggers"] = {name: logging.getLogger(name).level for name in _LOGGERS}
    return saved


def _restore_settings(saved: dict[str, Any]) -> None:
    """Put back what changed since :func:`_settings` (only that: writing a setting can have effects)."""
    import importlib

    for name, (getter, setter) in _FLAGS.items():  # the precision first: it also sets cuda.matmul.allow_tf32
        if getter() != saved[name]:
            setter(saved[name])
    for module in _CONFIG_MODULES:
        config = importlib.import_module(module)
        now = config.get_config_copy()
        changed = {key: value for key, value in saved[module].items() if now.get(key) != value}
        if changed:
            config.load_config(changed)
    for key in [k for k in os.environ if k.startswith(_ENVIRONMENT_PREFIXES) and k not in saved["environment"]]:
        del os.environ[key]
    os.environ.update({k: v for k, v in saved["environment"].items() if os.environ.get(k) != v})
    for name, level in saved["loggers"].items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(autouse=True)
def _process_settings():
    """Restore, after each test, the process-wide settings it changed without restoring them itself: torch's
    config modules (inductor, dynamo, functorch, symbolic shapes), the float32 matmul precision, determinism,
    cuDNN, reduced-precision and attention-backend flags, torch's environment variables and the log levels."""
    saved = _settings()
    yield
    _restore_settings(saved)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test and its module-scoped fixtures' teardown: collect, then freeze what survived."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()
    return result


# How to get the tests that a missing package skips running (CI installs these: .ci/run)
INSTALL_HINTS = {
    "torchao": 'pip install "torchao==0.17.0" (the fp8 extra)',
    "triton": 'pip install "triton==3.6.0"',
    "cache_dit": 'pip install "cache-dit==1.5.3" (the test extra)',
    "gguf": "pip install gguf (the test extra)",
    "peft": "pip install peft (the test extra)",
}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = re.sub(r"^Skipped: ", "", reason).strip()
    missing = re.match(r"could not import '([\w.]+)'", reason)
    if missing and missing.group(1).split(".")[0] in INSTALL_HINTS:
        name = missing.group(1).split(".")[0]
        return f"needs {name}: {INSTALL_HINTS[name]}"
    return reason


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
