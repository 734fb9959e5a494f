"""Each exact-mode hand patch against what the capture does without it (issue 23: keep a patch only
where it is faster than the automatic handling it replaces).

Qwen-Image's one exact-mode patch, ``TEXT_SEQ_LEN_PATCH`` (``bcg_diffusion.patches.qwenimage``),
replaces ``torch.as_tensor(text_seq_len, device=...)`` with a fill kernel. Without it, the capture
holds that tensor as a graph constant (``bcg_diffusion.core.python_data``). This runs eager, exact mode
with the patch, and exact mode with the adapter's patches removed, one after the other in one
process (a patch is process-wide, so the two cannot be alive together), and reports each one's
median latency, whether it equals eager, and its graphs' segments, breaks and constants.

    python -m bench.probes.probe_hand_patches --weights random-full --out DIR
    python -m bench.probes.probe_hand_patches --weights tiny --device cpu --size 64 --steps 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion import accelerate, restore, stats
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.pipelines.qwenimage import QwenImageAdapter

from .. import measure
from ..cases import Case


def _timed(pipe: Any, case: Case, device: torch.device, runs: int) -> tuple[list[float], list[torch.Tensor]]:
    calls = [measure.timed_call(pipe, case, device) for _ in range(runs + 1)]  # the first one captures
    return [c.total_s for c in calls[1:]], [c.images for c in calls]


def _graphs(pipe: Any) -> dict[str, Any]:
    report = stats(pipe)
    signatures = [s for s in report["signatures"] if s["component"] == "transformer"]
    keys = ("status", "segments", "breaks", "auto_breaks", "constants", "reason")
    return {"captures": report["captures"], "transformer": [{k: s[k] for k in keys} for s in signatures]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.probe_hand_patches", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--weights", default="random-full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    debug = device.type != "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else None
    pipe = build_pipeline("qwen-image", args.weights, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    case = Case("qwen-image", args.size, args.size, args.steps, args.guidance)
    rows: dict[str, dict[str, Any]] = {}
    times, images = _timed(pipe, case, device, args.runs)
    reference = images[0]
    rows["eager"] = {"latency_s": statistics.median(times), "runs_s": times}
    patches = QwenImageAdapter.patches
    for name, adapter_patches in (("hand patch", patches), ("no patch (automatic)", ())):
        QwenImageAdapter.patches = adapter_patches
        try:
            accelerate(pipe, debug=debug)
            times, images = _timed(pipe, case, device, args.runs)
            rows[name] = {
                "latency_s": statistics.median(times),
                "runs_s": times,
                "identical": all(torch.equal(image, reference) for image in images),
                "graphs": _graphs(pipe),
            }
        finally:
            restore(pipe)
            QwenImageAdapter.patches = patches
    for name, row in rows.items():
        layout = "; ".join(
            f"{s['segments']} segments, {s['breaks']} breaks, {len(s['constants'])} constants"
            for s in row.get("graphs", {}).get("transformer", [])[:1]
        )
        same = "" if name == "eager" else f" identical={row['identical']}"
        print(f"{name:22s} {row['latency_s']:.3f} s{same} {layout}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"environment": measure.environment(device), "args": vars(args) | {"out": str(args.out)}}
        (args.out / "hand-patches.json").write_text(json.dumps(record | {"rows": rows}, indent=2) + "\n")
    return 0 if all(row.get("identical", True) for row in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
