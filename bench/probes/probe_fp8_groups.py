"""What each group of linears costs in quality under FP8, and what keeping it in bf16 costs in time.

For each group of the linears FP8 can take (``bcg_diffusion.features.quantization.block_linears``: attention
projections, attention output, MLP in, MLP out), one pipeline copy keeps that group in bf16 and
quantizes the rest with ``quantize="fp8"`` (through ``quantize_filter``), in fast mode. Each row gives its PSNR and largest difference against
bf16 eager, and its latency (median of ``--runs``, interleaved). The rows ``all fp8`` and ``bf16``
(fast, no quantization) frame them; ``attention out in bf16`` is ``quantize="fp8"``'s default.

    python -m bench.probes.probe_fp8_groups --pipeline z-image --weights random-full --out DIR
    python -m bench.probes.probe_fp8_groups --weights tiny --device cpu --config int8 --mode exact --size 32  # smoke

Answers issue 22's sensitivity table; random weights make the dB figures a lower bound of what trained
weights lose (their activations are better behaved), so read them relative to each other.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion import accelerate, restore
from bcg_diffusion.features.quantization import block_linears, default_filter
from bcg_diffusion.models import build_pipeline

from .. import measure
from ..cases import Case
from ..modes import pipeline_copy
from .probe_fp8_block import fp8_config

GROUPS = {
    "attention q/k/v": r"\.(to_q|to_k|to_v)$",
    "attention out": r"\.to_out\.0$",
    "mlp in": r"(\.net\.0\.proj|\.w1|\.w3)$",
    "mlp out": r"(\.net\.2|\.w2)$",
}


def _quantize_option(name: str, scaling: str = "row-wise") -> Any:
    if name == "fp8":
        return "fp8" if scaling == "row-wise" else fp8_config(scaling)
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.probe_fp8_groups", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pipeline", default="z-image", choices=("z-image", "qwen-image"))
    parser.add_argument("--weights", default="random-full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", default="fp8", choices=("fp8", "int8"), help="int8 weight-only: the CPU smoke run")
    parser.add_argument("--mode", default="fast", choices=("fast", "exact"))
    parser.add_argument(
        "--compare",
        default="groups",
        choices=("groups", "scaling"),
        help="groups: each group kept in bf16 in turn; scaling: row-wise against per-tensor FP8, on the "
        "default filter and on every block linear",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    debug = device.type != "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else None
    base = build_pipeline(args.pipeline, args.weights, device=device, dtype=dtype)
    base.set_progress_bar_config(disable=True)
    case = Case(args.pipeline, args.size, args.size, args.steps, args.guidance)
    reference = measure.timed_call(base, case, device).images  # bf16 eager
    selected = block_linears(base.transformer)
    rows: dict[str, dict[str, Any]] = {}
    pipes: dict[str, Any] = {}
    variants: dict[str, tuple[Any, str]] = {"bf16": (None, "row-wise")}
    if args.compare == "groups":
        variants["all fp8"] = (selected, "row-wise")
        for group, pattern in GROUPS.items():
            variants[f"{group} in bf16"] = (
                lambda module, fqn, p=re.compile(pattern): selected(module, fqn) and not p.search(fqn),
                "row-wise",
            )
    else:
        for scaling in ("row-wise", "per-tensor"):
            variants[f"{scaling}, default filter"] = (default_filter(base.transformer), scaling)
            variants[f"{scaling}, all block linears"] = (selected, scaling)
    for label, (chosen, scaling) in variants.items():
        pipe = pipeline_copy(base)
        options = (
            {} if chosen is None else {"quantize": _quantize_option(args.config, scaling), "quantize_filter": chosen}
        )
        accelerate(pipe, mode=args.mode, debug=debug, **options)
        first = measure.timed_call(pipe, case, device)
        rows[label] = {"first_call_s": first.total_s, "runs_s": []}
        pipes[label] = pipe
    for run in range(args.runs):
        for label in list(pipes) if run % 2 == 0 else list(pipes)[::-1]:
            timing = measure.timed_call(pipes[label], case, device)
            rows[label]["runs_s"].append(timing.total_s)
            rows[label]["images"] = timing.images
    for label, row in rows.items():
        images = row.pop("images")
        row["median_s"] = statistics.median(row["runs_s"])
        row["psnr_db"] = measure.psnr(images, reference)
        row["max_abs"] = (images.float() - reference.float()).abs().max().item()
        restore(pipes[label])
    lines = [f"{args.pipeline} {args.size}², {args.steps} steps, {args.mode} mode, {args.config} ({args.weights})", ""]
    lines += ["| linears | median (s) | PSNR vs bf16 eager (dB) | max diff |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['median_s']:.3f} | {r['psnr_db']:.1f} | {r['max_abs']:.3g} |" for k, r in rows.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8-groups.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "fp8-groups.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
