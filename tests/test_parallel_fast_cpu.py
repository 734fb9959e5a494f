"""Fast mode under context parallelism on CPU: two processes over gloo, tiny Qwen-Image, runner in
debug mode. The blocks compile as regions between diffusers' collectives (which stay eager breaks),
and every call equals the same compiled blocks without graphs on the same ranks."""

from __future__ import annotations

from pathlib import Path

import _parallel
import pytest
import torch
from _checks import needs_compiler

pytestmark = [pytest.mark.heavy, needs_compiler]  # two processes, each compiling with inductor

WORLD = 2


def _checks(rank: int) -> dict:
    from bcg_diffusion import accelerate, eager, restore, stats

    pipe = _parallel.build_pipeline("qwen-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    _parallel.enable_context_parallel(pipe, WORLD)
    accelerate(pipe, mode="fast", debug=True)
    device = torch.device("cpu")
    images = [_parallel._call(pipe, 64, 64, cfg, device) for cfg in (False, True, False)]
    with eager(pipe):  # the same compiled blocks, no runner
        references = [_parallel._call(pipe, 64, 64, cfg, device) for cfg in (False, True)]
    report = stats(pipe)
    result = {
        "equal": [
            torch.equal(images[0], references[0]),
            torch.equal(images[1], references[1]),
            torch.equal(images[2], references[0]),
        ],
        "compiled_blocks": report["compiled_blocks"],
        "compiles": report["compiles"],
        "compile_failure": report["compile_failure"],
        "eager_block_calls": report["eager_block_calls"],
        "replays": report["replays"],
        "breaks": max(s["breaks"] for s in report["signatures"] if s["component"] == "transformer"),
    }
    restore(pipe)
    return result


def test_fast_mode_compiles_between_the_collectives_and_equals_its_compiled_blocks(tmp_path: Path) -> None:
    for result in _parallel.gloo_reports(_checks, WORLD, tmp_path):
        assert all(result["equal"]), result
        assert result["compiled_blocks"] > 0 and result["compiles"] > 0 and result["compile_failure"] is None, result
        assert result["eager_block_calls"] == 0 and result["replays"] > 0, result
