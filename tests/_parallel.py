"""One rank's checks of ``accelerate`` on a context-parallel Qwen-Image.

Shared by ``test_parallel_cpu.py`` (two spawned processes, gloo, tiny weights, debug mode) and
``test_parallel_cuda.py`` (torchrun, NCCL, graphs). On GPUs, by hand:

    torchrun --nproc_per_node=2 tests/_parallel.py --weights random-full --resolutions 512x512,1024x1024 --out DIR

Each rank writes ``rank<N>.json`` into ``--out``: byte-equality with context-parallel eager per case,
whether those calls ran their graphs (``tests/_checks.py``), counters, the error a non-divisible
prompt gets, the result of 100 eager collectives after replays, and (with graphs) what happened when
one rank's capture failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script by torchrun: the repository root is the parent folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _checks import assert_graphs_ran  # noqa: E402 - tests/ is on sys.path (the script's folder, or spawn's copy)

from bcg_diffusion import accelerate, restore, stats  # noqa: E402
from bcg_diffusion.models import build_pipeline  # noqa: E402
from bench.measure import image_md5  # noqa: E402

# Token counts with the offline tokenizer: 8 and 20 divide by 2 and 4 ranks, 10 by 2, 7 by neither.
PROMPT = "a red fox"
NEGATIVE = "blurry, low quality"
ODD_PROMPT = "a fox"
MASKED_SECOND = "a photo of a cat"  # 10 tokens, batched with PROMPT
STEPS = 2


def enable_context_parallel(pipe: Any, degree: int, kind: str = "ulysses") -> None:
    """diffusers' own context parallelism over ``degree`` ranks (``kind``: ulysses or ring)."""
    from diffusers import ContextParallelConfig

    options = {"ulysses_degree": degree} if kind == "ulysses" else {"ring_degree": degree}
    if kind == "ring" and pipe.transformer.device.type == "cuda":
        # Ring attention merges partial results by their log-sum-exp, which diffusers' default
        # "native" backend does not return.
        pipe.transformer.set_attention_backend("_native_cudnn")
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(**options))


def _call(
    pipe: Any, width: int, height: int, cfg: bool | str, device: torch.device, prompt: str = PROMPT
) -> torch.Tensor:
    """One pipeline call; ``cfg`` True for true CFG, ``"masked"`` for a batch of two prompts of
    different lengths (padded by the pipeline, with a text mask)."""
    return pipe(
        prompt=[prompt, MASKED_SECOND] if cfg == "masked" else prompt,
        negative_prompt=NEGATIVE if cfg is True else None,
        true_cfg_scale=4.0 if cfg is True else 1.0,
        width=width,
        height=height,
        num_inference_steps=STEPS,
        output_type="pt",
        generator=torch.Generator(device).manual_seed(0),
    ).images


def consensus_protocol() -> list[bool]:
    """The capture consensus with the last rank failing after one break: every rank casts two votes
    (the failing one: ok, then its failure) and all see the failure at the second."""
    from bcg_diffusion.features.context_parallel import CaptureConsensus

    consensus = CaptureConsensus(None)
    failing = dist.get_rank() == dist.get_world_size() - 1
    return [consensus.vote(True), consensus.vote(not failing)]


def rank_checks(
    weights: str, device: torch.device, resolutions: list[tuple[int, int]], kind: str = "ulysses"
) -> dict[str, Any]:
    """Build Qwen-Image, split it over every rank, and compare accelerated calls with eager ones."""
    debug = device.type != "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    pipe = build_pipeline("qwen-image", weights, device=device, dtype=None if debug else torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    enable_context_parallel(pipe, world, kind)
    cases = [(w, h, cfg) for w, h in resolutions for cfg in (False, True)]
    if kind == "ulysses":
        # Two prompts of different lengths (8 and 10 tokens): the masked path, whose split text mask
        # Ulysses attention all-gathers (diffusers' ring attention passes masks through unsplit).
        cases.append((*resolutions[0], "masked"))
    eager = {case: _call(pipe, *case, device) for case in cases}
    fault_case = (resolutions[0][0] // 2, resolutions[0][1] // 2, False)
    fault_eager = _call(pipe, *fault_case, device)

    accelerate(pipe, debug=debug)
    report: dict[str, Any] = {"rank": rank, "world": world, "kind": kind, "debug": debug, "cases": {}}
    report["patches"] = stats(pipe)["patches"]
    # Why the compared calls did not run their graphs (assert_graphs_ran's message per round), if they
    # did not: recorded, not raised, so every rank stays in step and writes its report.
    report["graphs_not_run"] = []
    checked = None
    for round_ in range(2):  # capture, then replay
        for case in cases:
            image = _call(pipe, *case, device)
            entry = report["cases"].setdefault(str(case), {"md5_eager": image_md5(eager[case].cpu()), "equal": True})
            entry["equal"] = entry["equal"] and torch.equal(image, eager[case])
            entry[f"md5_round{round_}"] = image_md5(image.cpu())
        try:
            checked = assert_graphs_ran(pipe, checked, captures=round_ == 0)
        except AssertionError as exc:
            report["graphs_not_run"].append(f"round {round_}: {exc}")
            checked = stats(pipe)
    captures = stats(pipe)["captures"]
    for _ in range(50):
        _call(pipe, *cases[0], device)
    report["captures_before_50_calls"] = captures
    report["captures_after_50_calls"] = stats(pipe)["captures"]

    sums = []
    for _ in range(100):  # ordinary collectives after replays must still match up
        value = torch.full((1,), float(rank), device=device)
        dist.all_reduce(value)
        sums.append(value.item())
    report["collectives_ok"] = all(s == sum(range(world)) for s in sums)

    try:
        _call(pipe, *cases[0], device, prompt=ODD_PROMPT)
        report["odd_length_error"] = None
    except ValueError as exc:
        report["odd_length_error"] = str(exc)

    final = stats(pipe)
    report.update({key: final[key] for key in ("captures", "replays", "eager_fallbacks")})
    report["signatures"] = [s for s in final["signatures"] if s["component"] == "transformer"]
    if not debug:
        report["fault"] = _fault_check(pipe, fault_case, fault_eager, device)
    restore(pipe)
    import torch.distributed._functional_collectives as funcol
    from diffusers.models import attention_dispatch

    report["patch_reverted"] = attention_dispatch.funcol is funcol
    return report


def _fault_check(pipe: Any, case: tuple[int, int, bool], reference: torch.Tensor, device: torch.device) -> dict:
    """The last rank's capture of a new signature fails inside its last block (after many breaks);
    every rank must abandon that capture, run it eagerly, and stay in step."""
    failing = dist.get_rank() == dist.get_world_size() - 1

    def fail_while_capturing(module: Any, args: Any, kwargs: Any) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected capture failure")

    handle = pipe.transformer.transformer_blocks[-1].register_forward_pre_hook(fail_while_capturing, with_kwargs=True)
    if not failing:
        handle.remove()
    try:
        before = stats(pipe)["eager_fallbacks"]
        image = _call(pipe, *case, device)
        failed = [s for s in stats(pipe)["signatures"] if s["status"] == "failed"]
        return {
            "failing_rank": failing,
            "equal": torch.equal(image, reference),
            "eager_fallbacks": stats(pipe)["eager_fallbacks"] - before,
            "reasons": [s["reason"] for s in failed],
        }
    finally:
        handle.remove()


def _gloo_rank(rank: int, check: Any, world: int, folder: str) -> None:
    # One thread per rank: ranks with the default thread count each would oversubscribe a small
    # machine's cores (their OpenMP threads then wait on each other).
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    # diffusers picks a device by torch.accelerator.device_count(), 0 without one (a division by zero).
    torch.accelerator.device_count = lambda: 1
    try:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(check(rank)))
    finally:
        dist.destroy_process_group()


def gloo_reports(check: Any, world: int, folder: Path, timeout: float | None = None) -> list[dict[str, Any]]:
    """Run ``check(rank)`` (a module-level function returning a JSON-able report) in ``world`` spawned CPU
    processes joined by gloo, and return their reports in rank order. Skips the test without gloo.

    ``timeout`` (seconds, None: no limit): fail the test, killing the ranks, when they have not all
    finished by then, so that a collective one rank never reaches fails the test instead of blocking it."""
    import pytest
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    context = mp.spawn(_gloo_rank, args=(check, world, str(folder)), nprocs=world, join=False)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            _kill(context.processes)
            pytest.fail(
                f"the {world} ranks had not finished after {timeout:.0f} s: a collective that never completes?"
            )
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def _kill(processes: list[Any]) -> None:
    """End the spawned ranks still running (each by its own process object), and wait for them."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="tiny")
    parser.add_argument("--resolutions", default="512x512")
    parser.add_argument("--kind", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    try:
        resolutions = [tuple(int(v) for v in r.split("x")) for r in args.resolutions.split(",")]
        report = rank_checks(args.weights, device, resolutions, args.kind)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
