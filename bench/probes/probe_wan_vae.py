"""GPU probe: Wan's causal 3-D VAE decode of a 480p video, and what could make it faster.

Wan 2.1 / 2.2 decode 81 frames at 832x480 from 21 latent frames (16 channels, 60x104), one latent frame at
a time through causal 3-D convolutions that keep the previous frames' features in a Python-side cache. The
decode is seconds of a video call. This probe times ``vae.decode`` (random weights of the published
config, bf16 as ``from_pretrained(torch_dtype=torch.bfloat16)`` gives it, float32 as Wan's model cards
load it) eagerly, and variants that change the kernels but not the weights:

* ``cudnn-benchmark``: cuDNN picks each convolution's algorithm by timing them (``torch.backends.cudnn.
  benchmark``), instead of by its heuristics;
* ``channels-last``: the decoder's convolution weights and the latents channels-last (``channels_last_3d``),
  so cuDNN runs its NDHWC kernels;
* both together;
* ``fused``: fast mode's decoder (:mod:`bcg_diffusion.patches.wan_vae`: channels-last, each RMS norm
  with its SiLU one kernel, the convolutions padding for themselves), and with ``+cudnn-benchmark``;

each with its largest difference from eager and the kernel time by kind (convolution, elementwise...).

    python -m bench.probes.probe_wan_vae [--frames 21] [--dtypes bf16,fp32] [--variants eager,cudnn-benchmark,...]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.patches.wan_vae import fuse_decoder
from bench.coverage_models import _wan_vae
from bench.measure import kernel_kind
from bench.probes.probe_vae_coders import median_ms

VARIANTS = ("eager", "channels-last", "fused", "fused+cudnn-benchmark")


@contextlib.contextmanager
def _variant(vae: torch.nn.Module, name: str) -> Iterator[None]:
    benchmark = torch.backends.cudnn.benchmark
    formats = {}
    patches = MethodPatches()
    try:
        if name.startswith("fused"):
            fuse_decoder(vae.decoder, patches)
        torch.backends.cudnn.benchmark = "cudnn-benchmark" in name
        if "channels-last" in name:
            for module in vae.decoder.modules():
                if isinstance(module, torch.nn.Conv3d):
                    formats[module] = module.weight.data
                    module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)
        yield
    finally:
        patches.undo()
        torch.backends.cudnn.benchmark = benchmark
        for module, weight in formats.items():
            module.weight.data = weight


def _decode_ms(vae: torch.nn.Module, latents: torch.Tensor, runs: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        return median_ms(lambda: vae.decode(latents, return_dict=False)[0], runs)


def _kernel_ms(vae: torch.nn.Module, latents: torch.Tensor, top: list[str]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        vae.decode(latents, return_dict=False)
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if total:
            kinds[kernel_kind(event.key)] = kinds.get(kernel_kind(event.key), 0.0) + total / 1e3
            kernels.append((total / 1e3, f"{event.key[:90]} ({event.count}x)"))
    top.extend(f"{ms:.0f} ms {name}" for ms, name in sorted(kernels, reverse=True)[:8])
    return kinds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=21, help="latent frames (21: 81 video frames)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    base = _wan_vae(device)
    for dtype_name in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        vae = base.to(dtype)
        generator = torch.Generator(device).manual_seed(0)
        latents = torch.randn(1, 16, args.frames, 60, 104, generator=generator, device=device, dtype=dtype)
        reference = None
        tops: list[str] = []
        print(f"## Wan VAE decode, {args.frames} latent frames at 60x104 (832x480), {dtype_name}")
        print("| variant | median ms | max abs diff vs eager | kernel ms by kind |")
        print("|---|---|---|---|")
        for name in args.variants.split(","):
            with _variant(vae, name):
                inputs = (
                    latents.contiguous(memory_format=torch.channels_last_3d) if "channels-last" in name else latents
                )
                ms, out = _decode_ms(vae, inputs, args.runs)
                top: list[str] = []
                kinds = {} if args.no_profile else _kernel_ms(vae, inputs, top)
            reference = out if reference is None else reference
            diff = (out.float() - reference.float()).abs().max().item()
            by_kind = ", ".join(f"{kind} {value:.0f}" for kind, value in sorted(kinds.items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {ms:.1f} | {diff:.3g} | {by_kind} |", flush=True)
            tops.append(f"{name}: " + "; ".join(top))
        print("\nLongest kernels:\n" + "\n".join(tops))
        del reference, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
