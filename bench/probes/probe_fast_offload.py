"""Why does fast mode's image change once offload is enabled after accelerate? (issue 19, item 3)

Answered (run 49, `bench/results/2026-12-01-h200/probe-fast-offload-run49.log`): model offload keeps fast mode's image; sequential offload failed the block compile and retired the compiled blocks for good.

Tiny Z-Image in float32 on the GPU, ``accelerate(pipe, mode="fast")``: two calls, then
``enable_model_cpu_offload()`` (or the sequential offload) and two more, with dynamo's recompile and
graph-break logs on and the counters that say which path ran.

    python -m bench.probes.probe_fast_offload
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch

from bcg_diffusion import accelerate, eager, stats
from bcg_diffusion.models import build_pipeline

KEYS = ("captures", "replays", "eager_fallbacks", "invalidations", "compiles", "compile_failure")


def _run(pipe) -> torch.Tensor:
    return pipe(
        "a red fox",
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=0.0,
        output_type="pt",
        generator=torch.Generator("cpu").manual_seed(0),
    ).images.cpu()


def probe(offload: str) -> None:
    pipe = build_pipeline("z-image", "tiny", device="cuda", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    plain = _run(pipe)
    accelerate(pipe, mode="fast")
    first, second = _run(pipe), _run(pipe)
    with eager(pipe):
        reference = _run(pipe)
    before = {k: stats(pipe)[k] for k in KEYS}
    print(f"[{offload}] before offload: {before}")
    print(
        f"[{offload}] replay == reference: {torch.equal(second, reference)}, first == second: {torch.equal(first, second)}, "
        f"vs eager {float((second - plain).abs().max()):.2e}"
    )
    getattr(pipe, f"enable_{offload}_cpu_offload")()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        third, fourth = _run(pipe), _run(pipe)
    after = {k: stats(pipe)[k] for k in KEYS}
    print(f"[{offload}] after offload: {after}")
    for w in caught:
        print(f"[{offload}] warning: {w.category.__name__}: {str(w.message)[:300]}")
    print(
        f"[{offload}] after == before: {torch.equal(third, second)} / {torch.equal(fourth, second)}, "
        f"max diff {float((third - second).abs().max()):.2e}; after vs eager {float((third - plain).abs().max()):.2e}"
    )


def main() -> int:
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    logging.basicConfig(level=logging.WARNING)
    for offload in ("model", "sequential"):
        try:
            probe(offload)
        except Exception as exc:  # report and go on to the next case
            print(f"[{offload}] failed: {type(exc).__name__}: {exc}")
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
