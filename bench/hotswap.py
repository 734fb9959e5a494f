"""LoRA hot swap with the graphs kept, against dropping and recapturing them (what accelerate did before).

    python -m bench.hotswap --pipeline z-image --weights random-full --out bench-runs/hotswap

One pipeline, accelerated (exact, then fast mode), with a random LoRA on every attention projection
loaded after ``enable_lora_hotswap(target_rank=...)``. Each round hot-swaps another random LoRA of the
same rank and times the swap and the next call (wall clock, synchronised): once as bcg-diffusion does
now (graphs kept, the call replays), once with the graphs dropped after the swap, as before (the call
recaptures). Every image is checked against the same pipeline's eager call with that LoRA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bcg_diffusion import accelerate, eager, restore, stats
from bcg_diffusion.models import PIPELINE_NAMES, build_pipeline

from . import runs

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora_state_dicts(pipe: Any, count: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """``count`` random LoRAs of ``rank`` for the transformer's attention projections, on its device."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = pipe.transformer
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS), adapter_name="_shape")
    shapes = {key: value.shape for key, value in get_peft_model_state_dict(transformer, adapter_name="_shape").items()}
    transformer.delete_adapters("_shape")
    loras = []
    for seed in range(count):
        generator = torch.Generator(transformer.device).manual_seed(seed)
        loras.append(
            {
                f"transformer.{key}": torch.randn(
                    shape, generator=generator, device=transformer.device, dtype=transformer.dtype
                )
                * 0.02
                for key, shape in shapes.items()
            }
        )
    return loras


def _synchronized(fn: Any) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def measure(
    pipe: Any, loras: list[dict[str, torch.Tensor]], rank: int, call_kwargs: dict[str, Any], mode: str
) -> dict[str, Any]:
    def call() -> torch.Tensor:
        generator = torch.Generator("cpu").manual_seed(0)
        return pipe("a lighthouse at dusk", generator=generator, output_type="pt", **call_kwargs).images

    accelerate(pipe, mode=mode, debug=pipe.device.type != "cuda")
    try:
        pipe.enable_lora_hotswap(target_rank=rank)
        pipe.load_lora_weights(loras[0], adapter_name="style")
        call(), call()  # capture (and compile), then replay
        rows = {"kept": [], "dropped": []}
        for index, lora in enumerate(loras[1:], start=1):
            for how in ("kept", "dropped"):
                before = stats(pipe)
                _, swap = _synchronized(
                    lambda lora=lora: pipe.load_lora_weights(lora, adapter_name="style", hotswap=True)
                )
                if how == "dropped":  # what every load_lora_adapter did before: drop the graphs
                    pipe.transformer.forward.__bcg_runner__.invalidate("bench: drop after hot swap")
                image, next_call = _synchronized(call)
                with eager(pipe):
                    reference = call()
                after = stats(pipe)
                rows[how].append(
                    {
                        "lora": index,
                        "swap_s": swap,
                        "next_call_s": next_call,
                        "captures": after["captures"] - before["captures"],
                        "identical": bool(torch.equal(image, reference)),
                    }
                )
        return {
            how: {
                "swap_s": statistics.median(r["swap_s"] for r in runs),
                "next_call_s": statistics.median(r["next_call_s"] for r in runs),
                "runs": runs,
            }
            for how, runs in rows.items()
        } | {"compiles": stats(pipe)["compiles"]}
    finally:
        restore(pipe)
        pipe.unload_lora_weights()
        torch._dynamo.reset()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hotswap", description=__doc__.splitlines()[0], formatter_class=runs.HelpFormatter
    )
    parser.add_argument("--pipeline", choices=PIPELINE_NAMES, default="z-image", help="the pipeline to build")
    parser.add_argument("--weights", default="random-full", help="tiny | random-full | hub id | local path")
    parser.add_argument("--resolution", default="512x512", help="WxH")
    parser.add_argument("--steps", type=runs.at_least(2), default=8, help="denoising steps per call")
    parser.add_argument("--rank", type=runs.at_least(1), default=32, help="of every random LoRA")
    parser.add_argument("--swaps", type=runs.at_least(1), default=3, help="hot swaps timed per mode")
    parser.add_argument("--modes", default="exact,fast", help="comma-separated, from exact, fast")
    parser.add_argument("--out", type=Path, help="folder for hotswap.json (default: print only)")
    args = parser.parse_args(argv)
    try:  # checked here, kept as written: the record gives the arguments as strings
        width, height = runs.resolution(args.resolution)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --resolution: {exc}")
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    if not modes or any(m not in ("exact", "fast") for m in modes):
        parser.error(f"argument --modes: expected exact, fast or exact,fast, got {args.modes!r}")
    smoke = (
        f"python -m bench.hotswap --pipeline {args.pipeline} --weights tiny --resolution 64x64 --steps 2 --modes exact"
    )
    if runs.refuse_without_gpu("bench.hotswap", args.weights, [args.pipeline], smoke):
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: debug mode, timings meaningless
    pipe = build_pipeline(
        args.pipeline, args.weights, device=device, dtype=torch.bfloat16 if device == "cuda" else None
    )
    pipe.set_progress_bar_config(disable=True)
    loras = lora_state_dicts(pipe, args.swaps + 1, args.rank)
    guidance = {"true_cfg_scale": 1.0} if args.pipeline == "qwen-image" else {"guidance_scale": 0.0}
    call_kwargs = {"height": height, "width": width, "num_inference_steps": args.steps, **guidance}
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (debug mode, timings meaningless)"
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "gpu": gpu}
    ok = True
    for mode in modes:
        results[mode] = measure(pipe, loras, args.rank, call_kwargs, mode)
        kept, dropped = results[mode]["kept"], results[mode]["dropped"]
        ok &= all(r["identical"] for how in (kept, dropped) for r in how["runs"])
        ok &= all(r["captures"] == 0 for r in kept["runs"])
        print(
            f"{mode}: swap + next call, graphs kept {kept['swap_s']:.3f} + {kept['next_call_s']:.3f} s; "
            f"dropped and recaptured {dropped['swap_s']:.3f} + {dropped['next_call_s']:.3f} s; "
            f"identical to eager with the new LoRA: {all(r['identical'] for r in kept['runs'] + dropped['runs'])}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hotswap.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
