"""Does inductor's cudagraph recording break graphs we captured earlier? (issue 19, item 4)

Answered (runs 49–50, `bench/results/2026-12-01-h200/`): yes at full width (an illegal memory access on the next replay), not with small GEMMs; clearing cuBLAS's workspaces around our captures fixes it.

Captures a few bf16 matrix products with our runner, then lets ``torch.compile(mode="reduce-overhead")``
record its own graphs (which clears cuBLAS's workspaces and empties the allocator's cache), then
replays ours many times against eager, with freshly filled tensors around. Each order runs in a
subprocess of its own, so a crash shows as an exit status instead of ending the probe.

    python -m bench.probes.probe_cublas_workspace            # every case, each in a subprocess
"""

from __future__ import annotations

import subprocess
import sys
import threading

import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Few rows against long rows: cuBLAS picks split-K kernels for these, which use its workspace.
    layers = [torch.nn.Linear(8192, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8192), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to("cuda", torch.bfloat16).eval()


def _reduce_overhead_peer() -> None:
    peer = torch.compile(_model(), mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            peer(torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)).clone()
    torch.cuda.synchronize()


def _clearing_workspaces(capture):
    """The fix under test: our captures take cuBLAS workspaces from their own pool and free them after."""

    def wrapped(*args, **kwargs):
        torch._C._cuda_clearCublasWorkspaces()
        try:
            return capture(*args, **kwargs)
        finally:
            torch._C._cuda_clearCublasWorkspaces()

    return wrapped


def run(order: str) -> int:
    from bcg_diffusion.core import runner as runner_module
    from bcg_diffusion.core.graphs import GraphPool
    from bcg_diffusion.core.runner import GraphRunner

    if order.endswith("-fixed"):
        runner_module.capture_breakable = _clearing_workspaces(runner_module.capture_breakable)

    model = _model()
    runner = GraphRunner(model.forward, name="probe", pool=GraphPool("cuda"), lock=threading.RLock())
    x = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        if order.startswith("peer-first"):
            _reduce_overhead_peer()
        expected = model(x)
        assert torch.equal(runner(x), expected)  # capture
        assert torch.equal(runner(x), expected)  # replay
        if order.startswith("ours-first"):
            _reduce_overhead_peer()
        torch.cuda.empty_cache()
        junk = [torch.full((8 << 20,), 1.0, device="cuda") for _ in range(16)]  # 32 MiB each
        with torch.cuda.stream(runner.pool.stream):
            junk += [torch.full((8 << 20,), 1.0, device="cuda") for _ in range(16)]
        wrong = 0
        for _ in range(50):
            wrong += not torch.equal(runner(x), expected)
        torch.cuda.synchronize()
        damaged = sum(not bool((j == 1.0).all()) for j in junk)
    print(f"{order}: {wrong}/50 replays differ from eager, {damaged}/32 other tensors overwritten", flush=True)
    return 1 if wrong or damaged else 0


def run_pipelines(order: str) -> int:
    """The benchmark's case that crashed (2026-11-29, run 9): full-size random-weight Z-Image-Turbo at 512²,
    8 steps, our exact graphs and reduce-overhead on two copies of one pipeline, calls interleaved."""
    from bcg_diffusion import accelerate
    from bcg_diffusion.core import runner as runner_module
    from bench.modes import _compile_with_own_graphs, pipeline_copy

    if order.endswith("-fixed"):
        runner_module.capture_breakable = _clearing_workspaces(runner_module.capture_breakable)
    from bcg_diffusion.models import build_pipeline

    base = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16)
    base.set_progress_bar_config(disable=True)

    def call(pipe):
        generator = torch.Generator("cpu").manual_seed(0)
        kwargs = dict(height=512, width=512, num_inference_steps=8, guidance_scale=0.0, output_type="pt")
        return pipe("a lighthouse at dusk", generator=generator, **kwargs).images.cpu()

    with torch.no_grad():
        expected = call(base)
        ours, peer = accelerate(pipeline_copy(base)), pipeline_copy(base)
        _compile_with_own_graphs(peer.transformer)
        first = [ours, peer] if order.startswith("ours-first") else [peer, ours]
        for pipe in first:
            call(pipe), call(pipe)
        wrong = 0
        for _ in range(6):
            wrong += not torch.equal(call(ours), expected)
            call(peer)
    print(f"pipelines {order}: {wrong}/6 interleaved calls of ours differ from eager", flush=True)
    return 1 if wrong else 0


def main() -> int:
    if len(sys.argv) > 2:
        return run_pipelines(sys.argv[2])
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    print("cuBLAS functions in torch._C:", [n for n in dir(torch._C) if "ublas" in n.lower()])
    status = 0
    for order in ("ours-first", "peer-first", "ours-first-fixed", "peer-first-fixed"):
        done = subprocess.run([sys.executable, "-m", "bench.probes.probe_cublas_workspace", order])
        print(f"{order}: exit status {done.returncode}", flush=True)
        status |= done.returncode != 0
    for order in ("ours-first", "ours-first-fixed"):
        command = [sys.executable, "-m", "bench.probes.probe_cublas_workspace", "pipelines", order]
        done = subprocess.run(command)
        print(f"pipelines {order}: exit status {done.returncode}", flush=True)
        status |= done.returncode != 0
    return status


if __name__ == "__main__":
    sys.exit(main())
