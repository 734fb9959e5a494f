"""GPU probe: the VAEs' encode and decode, eager against fast mode's fused encoder and decoder.

Image-conditioned pipelines encode their input and decode the result on every call: Qwen-Image-Edit a 1024²
image through Qwen-Image's causal 3-D VAE, FLUX.1 Kontext one through FLUX.1's 2-D ``AutoencoderKL``, Wan's
image-to-video 81 frames at 832x480 (the first frame, then zeros). This probe times each (random weights of
the published configs, bf16) eagerly, then fused (:mod:`bcg_diffusion.patches.wan_vae`,
:mod:`bcg_diffusion.patches.vae`) as fast mode runs it (``fused``), and for the causal VAEs with a single
frame still convolved in 3-D (``fused-3d``: the causal zeros joined, every time tap run), each as a median of
``--runs`` calls, with the SNR of its output against eager.

    python -m bench.probes.probe_vae_coders [--cases qwen-1024,qwen-512,flux-1024,wan-81] [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.models import build_pipeline
from bcg_diffusion.patches import vae as fused_2d
from bcg_diffusion.patches import wan_vae
from bench.coverage_models import _full_qwen_vae, _wan_vae

VARIANTS = ("eager", "fused-3d", "fused")


def _flux_vae(device: torch.device) -> torch.nn.Module:
    return build_pipeline("z-image", "random-full", device=device, dtype=torch.bfloat16, num_layers=1).vae


# name -> (VAE builder, input frames (None: a 2-D VAE), height, width)
CASES: dict[str, tuple[Callable[[torch.device], torch.nn.Module], int | None, int, int]] = {
    "qwen-1024": (_full_qwen_vae, 1, 1024, 1024),
    "qwen-512": (_full_qwen_vae, 1, 512, 512),
    "flux-1024": (_flux_vae, None, 1024, 1024),
    "wan-81": (_wan_vae, 81, 480, 832),
}


@contextlib.contextmanager
def _variant(vae: torch.nn.Module, name: str) -> Iterator[None]:
    patches = MethodPatches()
    try:
        if name.startswith("fused"):
            fusing = fused_2d if fused_2d.encoder_fusable(vae.encoder) else wan_vae
            fusing.fuse_encoder(vae.encoder, patches)
            fusing.fuse_decoder(vae.decoder, patches)
        if name == "fused-3d":
            patches.replace(wan_vae, "_last_tap_only", lambda conv, x, zeros: False)
        yield
    finally:
        patches.undo()


def median_ms(fn: Callable[[], torch.Tensor], runs: int) -> tuple[float, torch.Tensor]:
    """``fn()``'s median wall time over ``runs`` calls after one untimed call, each waited for, and its last output."""
    out = fn()  # warm-up: cuDNN's choices, the allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2], out


def _snr(out: torch.Tensor, reference: torch.Tensor) -> float:
    noise = (out.float() - reference.float()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(reference.float().pow(2).sum().item() / noise)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    print("| case | variant | encode ms | decode ms | encode SNR vs eager | decode SNR vs eager |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        build, frames, height, width = CASES[case]
        vae = build(device).to(torch.bfloat16)
        generator = torch.Generator(device).manual_seed(0)
        frame_dims = () if frames is None else (frames,)
        latent_frames = () if frames is None else (1 + (frames - 1) // 4,)
        video = torch.rand(1, 3, *frame_dims, height, width, generator=generator, device=device) * 2 - 1
        video = video.bfloat16()
        latents = torch.randn(1, 16, *latent_frames, height // 8, width // 8, generator=generator, device=device,
                              dtype=torch.bfloat16)  # fmt: skip
        references: list[torch.Tensor] = []
        for name in args.variants.split(","):
            if name == "fused-3d" and frames is None:
                continue  # a 2-D VAE: nothing to compare
            (encode_ms, encoded), (decode_ms, decoded) = _timed(vae, name, video, latents, args.runs)
            references = references or [encoded, decoded]
            print(f"| {case} | {name} | {encode_ms:.1f} | {decode_ms:.1f} | {_snr(encoded, references[0]):.1f} "
                  f"| {_snr(decoded, references[1]):.1f} |", flush=True)  # fmt: skip
        vae.to("meta")  # the next case's VAE in its place
        torch.cuda.empty_cache()


def _timed(
    vae: torch.nn.Module, name: str, video: torch.Tensor, latents: torch.Tensor, runs: int
) -> tuple[tuple[float, torch.Tensor], tuple[float, torch.Tensor]]:
    """``name``'s encode of ``video`` and decode of ``latents``: each (median ms, output)."""
    with torch.no_grad(), _variant(vae, name):
        encoded = median_ms(lambda: vae.encode(video).latent_dist.mode(), runs)
        decoded = median_ms(lambda: vae.decode(latents, return_dict=False)[0], runs)
    return encoded, decoded


if __name__ == "__main__":
    main()
