"""Fast mode under context parallelism on CPU: two processes over gloo, tiny Qwen-Image, runner in
debug mode. The blocks compile as regions between diffusers' collectives (which stay eager breaks),
and every call equals the same compiled blocks without graphs on the same ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _checks import needs_compiler

pytestmark = [pytest.mark.heavy, needs_compiler]  # two processes, each compiling with inductor

WORLD = 2


def _worker(rank: int, init_file: str, out: str) -> None:
    import _parallel

    from bcg_diffusion import accelerate, eager, restore, stats

    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.accelerator.device_count = lambda: 1  # as in test_parallel_cpu.py
    try:
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
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_fast_mode_compiles_between_the_collectives_and_equals_its_compiled_blocks(tmp_path: Path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(result["equal"]), result
        assert result["compiled_blocks"] > 0 and result["compiles"] > 0 and result["compile_failure"] is None, result
        assert result["eager_block_calls"] == 0 and result["replays"] > 0, result
