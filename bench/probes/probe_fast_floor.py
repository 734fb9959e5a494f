"""GPU probe: where fast mode's time goes outside the matrix products, and what compiling more would save.

Answered (run 35, `bench/results/2026-12-01-h200/probe-fast-floor-run35.log`): half of Z-Image's VAE decode was PyTorch's group-norm moments, and Qwen-Image's fused norm + RoPE kernel was a looped reduction.

For full-size random-weight pipelines on one GPU, prints:

* the kernels of one whole fast-mode call, and per denoising step of a call without the decode:
  kernel time, kernel count and the gaps between kernels (inflated by the profiler's own overhead),
  with the top kernels;
* the VAE decode replayed from a CUDA graph: eager kernels against inductor-compiled (default mode,
  static shapes, so inductor may lay convolutions out channels-last), with the compile's cost and the
  largest difference;
* the text encoder (Z-Image: Qwen3 at 64 tokens) replayed from a CUDA graph, with its kernels.

    python -m bench.probes.probe_fast_floor --pipeline z-image [--pipeline qwen-image]
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bcg_diffusion import accelerate, restore
from bcg_diffusion.models import build_pipeline
from bench.cases import Case
from bench.measure import kernel_kind, timed_call


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of ``fn`` and the output it holds (two warm-ups on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph: torch.cuda.CUDAGraph, runs: int = 20) -> float:
    """Median ms of one replay of ``graph``, each followed by a host sync (the GPU idles between them)."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay_ms(fn: Callable[[], Any], runs: int = 20) -> tuple[float, Any]:
    """Median ms of ``fn`` replayed from one CUDA graph (two warm-ups on a side stream first)."""
    graph, out = capture_graph(fn)
    return replay_ms(graph, runs), out


def random_block(block: torch.nn.Module) -> torch.nn.Module:
    """``block`` with random weights at a sane scale (matrices ~ N(0, 1/fan_in), vectors ~ N(1, 0.02):
    norms and biases near their trained values), in bf16 for inference."""
    for parameter in block.parameters():
        if parameter.dim() > 1:
            torch.nn.init.normal_(parameter, std=parameter.shape[-1] ** -0.5)
        else:
            torch.nn.init.normal_(parameter, mean=1.0, std=0.02)
    return block.to(torch.bfloat16).eval()


def gpu_kernels(fn: Callable[[], Any]) -> list[Any]:
    """The profiler's events of the GPU kernels one ``fn()`` ran, in start order (``device_time`` in µs)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(kernels, key=lambda e: e.time_range.start)


def kernel_table(fn: Callable[[], Any], label: str, top: int = 25, per: int = 1) -> None:
    """Profile one ``fn()``; print kernel time, count, gaps and the top kernels (divided by ``per``)."""
    kernels = gpu_kernels(fn)
    busy = sum(e.device_time for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    gaps, small_gaps, last_end = 0.0, 0.0, None
    for e in kernels:
        if last_end is not None and e.time_range.start > last_end:
            gap = e.time_range.start - last_end
            gaps += gap
            small_gaps += gap if gap < 20 else 0
        last_end = max(last_end or 0, e.time_range.end)
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + e.device_time
    print(
        f"\n== {label}: per unit ({per}): kernels {len(kernels) / per:.0f}, kernel time {busy / per / 1e3:.3f} ms, "
        f"span {span / per / 1e3:.3f} ms, gaps {gaps / per / 1e3:.3f} ms (of which gaps < 20 us: "
        f"{small_gaps / per / 1e3:.3f} ms)"
    )
    print("   by kind (ms): " + ", ".join(f"{k} {v / per / 1e3:.3f}" for k, v in sorted(by_kind.items())))
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, times in rows:
        print(f"   {sum(times) / per / 1e3:8.3f} ms  x{len(times) / per:6.1f}  {name[:110]}")


def section(title: str, body: Callable[[], None]) -> None:
    print(f"\n######## {title}", flush=True)
    start = time.perf_counter()
    try:
        body()
    except Exception:
        traceback.print_exc()
    print(f"######## {title}: {time.perf_counter() - start:.1f} s", flush=True)


def vae_variants(pipe: Any, height: int, width: int) -> None:
    vae = pipe.vae
    factor = pipe.vae_scale_factor
    generator = torch.Generator("cuda").manual_seed(0)
    channels = getattr(vae.config, "z_dim", None) or vae.config.latent_channels
    frames = (1,) if hasattr(vae.config, "z_dim") else ()  # Qwen-Image's 3-D VAE: (B, C, frames, h, w)
    shape = (1, channels, *frames, height // factor, width // factor)
    latents = torch.randn(shape, generator=generator, device="cuda", dtype=vae.dtype)

    def eager() -> torch.Tensor:
        return vae.decode(latents, return_dict=False)[0]

    with torch.no_grad():
        ms, reference = graph_replay_ms(eager)
        reference = reference.clone()
        print(f"VAE {width}x{height} eager, replayed: {ms:.2f} ms")
        kernel_table(eager, f"VAE {width}x{height} eager", top=12)
        decoder = vae.decoder
        original = decoder.forward
        compiled = torch.compile(original, dynamic=False)
        decoder.forward = compiled
        try:
            start = time.perf_counter()
            eager()
            torch.cuda.synchronize()
            print(f"VAE compile (cold, first call): {time.perf_counter() - start:.1f} s")
            ms_c, out = graph_replay_ms(eager)
            diff = (out.float() - reference.float()).abs().max().item()
            print(f"VAE {width}x{height} compiled, replayed: {ms_c:.2f} ms (eager {ms:.2f}); max abs diff {diff:.4f}")
            kernel_table(eager, f"VAE {width}x{height} compiled", top=12)
        finally:
            decoder.forward = original


def text_encoder_kernels(pipe: Any, tokens: int = 64) -> None:
    """The text encoder replayed from a CUDA graph at ``tokens`` tokens (every token valid), with its
    kernels. (Its layers compiled by inductor did not capture here: transformers takes another mask
    path while a stream captures, which recompiles them under capture; inside the runner, whose
    mask preparation is an eager break, that would not happen.)"""
    encoder = pipe.text_encoder
    ids = torch.randint(0, 1000, (1, tokens), device="cuda")

    def run() -> torch.Tensor:
        return encoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-2]

    with torch.no_grad():
        ms, _ = graph_replay_ms(run)
        print(f"text encoder {tokens} tokens eager, replayed: {ms:.2f} ms")
        kernel_table(run, f"text encoder {tokens} tokens eager", top=12)


def fast_call_profile(pipe: Any, case: Case, components: tuple[str, ...]) -> None:
    accelerate(pipe, mode="fast", components=components)
    try:
        start = time.perf_counter()
        timed_call(pipe, case, torch.device("cuda"))
        print(f"fast first call: {time.perf_counter() - start:.1f} s")
        timed_call(pipe, case, torch.device("cuda"))
        walls = [timed_call(pipe, case, torch.device("cuda")) for _ in range(5)]
        print(
            "fast calls (median s): total {:.4f}, encode {:.4f}, denoise {:.4f}, decode {:.4f}".format(
                *(
                    statistics.median(getattr(w, k) for w in walls)
                    for k in ("total_s", "encode_s", "denoise_s", "decode_s")
                )
            )
        )
        kernel_table(lambda: pipe(**case.kwargs()), f"fast whole call {case.label}", top=30)
        kernel_table(
            lambda: pipe(**case.kwargs("latent")),
            f"fast call {case.label} without decode, per step",
            top=30,
            per=case.steps,
        )
    finally:
        restore(pipe)
        torch._dynamo.reset()


def probe(name: str) -> None:
    pipe = build_pipeline(name, "random-full", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    if name == "z-image":
        case = Case("z-image", 512, 512, 8, 0.0)
        with_te = ("transformer", "vae", "text_encoder")
        section("z-image fast-te call", lambda: fast_call_profile(pipe, case, with_te))
        section("z-image VAE 512", lambda: vae_variants(pipe, 512, 512))
        section("z-image VAE 1024", lambda: vae_variants(pipe, 1024, 1024))
        section("z-image text encoder", lambda: text_encoder_kernels(pipe))
    else:
        case = Case("qwen-image", 512, 512, 10, 4.0)
        section("qwen-image fast call", lambda: fast_call_profile(pipe, case, ("transformer", "vae")))
        section("qwen-image VAE 512", lambda: vae_variants(pipe, 512, 512))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", action="append", choices=("z-image", "qwen-image"))
    args = parser.parse_args()
    for name in args.pipeline or ["z-image"]:
        probe(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
