"""True CFG across two ranks on CPU (gloo), tiny Qwen-Image, runner in debug mode: rank 0 computes the
cond calls, rank 1 the uncond calls, one exchange per step, and both ranks get the image one process
computes alone, byte for byte. The same split on two GPUs is ``bench.parallel``'s (not run yet)."""

from __future__ import annotations

from pathlib import Path

import _parallel
import pytest
import torch
from _cases import run_case

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline

WORLD, STEPS = 2, 4


def _pipe(name: str = "qwen-image"):
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _checks(rank: int) -> dict:
    pipe = _pipe()
    alone = {
        case: run_case(pipe, "qwen-image", case, height=32, width=32, steps=STEPS) for case in ("true_cfg", "no_cfg")
    }
    accelerate(pipe, debug=True, cfg_parallel=True)
    report = {"equal": {}, "counters": {}}
    for case in ("true_cfg", "no_cfg", "true_cfg"):
        image = run_case(pipe, "qwen-image", case, height=32, width=32, steps=STEPS)
        report["equal"][case] = report["equal"].get(case, True) and torch.equal(image, alone[case])
        report["counters"][case] = {k: stats(pipe)[k] for k in ("cfg_split_calls", "cfg_exchanges")}
    restore(pipe)
    report["restored"] = torch.equal(
        run_case(pipe, "qwen-image", "true_cfg", height=32, width=32, steps=STEPS), alone["true_cfg"]
    )
    return report


@pytest.mark.heavy  # two processes, each importing torch and building the pipeline
def test_each_rank_computes_one_half_and_both_get_one_process_bytes(tmp_path: Path) -> None:
    for report in _parallel.gloo_reports(_checks, WORLD, tmp_path):
        assert all(report["equal"].values()) and report["restored"], report
        # counters are cumulative, read after each call (the dict keeps the second true-CFG call's):
        # STEPS - 1 split steps per true-CFG call, the first step runs whole on both ranks
        counters = report["counters"]
        assert counters["no_cfg"]["cfg_exchanges"] == STEPS - 1  # the first call's; the no-CFG call added none
        assert counters["true_cfg"]["cfg_exchanges"] == 2 * (STEPS - 1)
        assert counters["true_cfg"]["cfg_split_calls"] == 2 * (STEPS - 1)  # each rank left one call per step


def test_cfg_parallel_needs_torch_distributed() -> None:
    pipe = _pipe()
    with pytest.raises(RuntimeError, match="torchrun"):
        accelerate(pipe, debug=True, cfg_parallel=True)
    with pytest.raises(TypeError, match="cfg_parallel"):
        accelerate(pipe, debug=True, cfg_parallel="yes")


CP_WORLD = 4


def _cp_checks(rank: int) -> dict:
    """Four ranks: context parallelism over ranks (0, 1) and (2, 3), CFG split between them. The
    calls are _parallel's, whose prompts' token counts divide by the context-parallel degree."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("cfg", "ring", "ulysses"))
    pipe = _pipe()
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2, mesh=mesh["ring", "ulysses"]))
    cpu = torch.device("cpu")
    reference = _parallel._call(pipe, 64, 64, True, cpu)  # context parallelism alone, eager
    report = {}
    for name, option in (("true", True), ("within", mesh["ulysses"].get_group())):
        try:
            accelerate(pipe, debug=True, cfg_parallel=option)
            report[name] = "accepted"
            restore(pipe)
        except ValueError as exc:
            report[name] = str(exc)
    accelerate(pipe, debug=True, cfg_parallel=mesh["cfg"].get_group())
    images = [_parallel._call(pipe, 64, 64, True, cpu) for _ in range(2)]
    report["equal"] = all(torch.equal(image, reference) for image in images)
    report["counters"] = {k: stats(pipe)[k] for k in ("cfg_split_calls", "cfg_exchanges")}
    restore(pipe)
    return report


@pytest.mark.heavy  # four processes
def test_cfg_across_context_parallel_groups_equals_context_parallelism_alone(tmp_path: Path) -> None:
    for report in _parallel.gloo_reports(_cp_checks, CP_WORLD, tmp_path):
        assert "cfg_parallel=True under context parallelism" in report["true"], report
        assert "different context-parallel groups" in report["within"], report
        assert report["equal"], report
        # _parallel's calls run 2 steps: the second of each is split
        assert report["counters"] == {"cfg_split_calls": 2, "cfg_exchanges": 2}, report
