"""What the per-call check of the Python state the graphs read costs, per component, and what diffusers' own
per-call module walks cost beside it (host time, which a call pays before its first kernel).

Z-Image at full depth and tiny width (the number of modules and watched values is the full model's; the
check's cost does not depend on the width), on the GPU, in exact mode with ``quantize="fp8"`` (torchao's
weights are tensor subclasses, checked through their inner tensors) and without. Prints each component's
check in µs and how many values it watches, then ``pipe._execution_device`` (diffusers walks every module of
every component for group-offloading hooks) and ``pipe.transformer.dtype``.

    python -m bench.probes.probe_state_check
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline


def _ms(fn: Callable[[], Any], repeats: int = 50) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    warnings.simplefilter("ignore")
    pipe = build_pipeline("z-image", "tiny", device="cuda", dtype=torch.bfloat16, num_layers=30)
    pipe.set_progress_bar_config(disable=True)
    modules = {name: sum(1 for _ in getattr(pipe, name).modules()) for name in ("transformer", "text_encoder", "vae")}
    print(f"modules: {modules}")
    print(f"pipe._execution_device: {_ms(lambda: pipe._execution_device):.3f} ms")
    print(f"pipe.transformer.dtype: {_ms(lambda: pipe.transformer.dtype):.3f} ms")
    kwargs = dict(prompt="a fox", height=256, width=256, num_inference_steps=2, guidance_scale=0.0, output_type="pt")
    for quantize in (None, "fp8"):
        accelerate(pipe, quantize=quantize)
        for _ in range(2):
            pipe(**kwargs)
        before = {n: dict(c) for n, c in stats(pipe)["components"].items()}
        calls = 10
        for _ in range(calls):
            pipe(**kwargs)
        report = stats(pipe)
        for name, counters in report["components"].items():
            seconds = counters["state_check_seconds"] - before[name]["state_check_seconds"]
            checks = counters["state_checks"] - before[name]["state_checks"]
            watched = max((s["watched"] for s in report["signatures"] if s["component"] == name), default=0)
            print(f"quantize={quantize}: {name}: {seconds / max(checks, 1) * 1e6:.0f} us per check, "
                  f"{checks / calls:.0f} per call, {watched} values watched")  # fmt: skip
        restore(pipe)


if __name__ == "__main__":
    main()
