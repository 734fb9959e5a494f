"""GPU probe: Z-Image's time outside the transformer's blocks in fast mode: VAE decode and text encoder.

At Z-Image-Turbo 512², 8 steps, ``fast-fp8`` takes about 172 ms, of which the VAE decode is about 14.5 ms
and text encoding about 11 ms (run 110). This probe measures what fast mode could do with each:

* ``vae``: the FLUX.1 VAE decode at 512² and 1024², replayed from a CUDA graph: diffusers' own (``eager``,
  the reference of the differences), fast mode's group norms patched (``patched``, ``patches.group_norm``),
  channels-last eager (group norm's moments over NHWC), the decoder's resnet and upsampling blocks
  compiled by inductor with dynamic shapes (one compiled graph per block class and width, as fast mode
  compiles repeated blocks), channels-last with fused kernels (``fused``, ``patches.vae``, fast
  mode's default), and the whole decoder compiled with static shapes; each with its kernel
  time by kind, compile time, largest difference from eager's and PSNR against it (``--vae-variants``
  picks some);
* ``text-encoder``: Qwen3-4B's 36 layers at 64 tokens (the prompt's trimmed length), replayed: eager,
  compiled per layer (one graph for all), and compiled with torchao's row-wise FP8 on their linears;
* ``encode``: the whole ``encode_prompt`` of an accelerated pipeline (fast mode, FP8): wall time against
  the GPU's kernel time, so the host's share is known;
* ``z-block-512``: one Z-Image FP8 block at 512² as fast mode runs it, kernel time by class.

    python -m bench.probes.probe_outside_blocks [--sections vae,text-encoder,encode,z-block-512,gemms]
        [--vae-variants eager,patched,fused,decoder compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bcg_diffusion.core.hooks import MethodPatches
from bcg_diffusion.features import compiled_blocks as fast
from bcg_diffusion.patches.group_norm import patch_group_norms
from bcg_diffusion.patches.vae import fuse_decoder
from bench.probes.probe_fast_floor import graph_replay_ms, kernel_table, section


def _build() -> Any:
    from bcg_diffusion.models import build_pipeline

    pipe = build_pipeline("z-image", "random-full", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _group_norm_nhwc(module: torch.nn.GroupNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """Group norm on a channels-last ``[N, C, H, W]`` tensor, moments by ``var_mean`` over NHWC."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous(memory_format=torch.channels_last):
            return F.group_norm(x, module.num_groups, module.weight, module.bias, module.eps)
        n, c, h, w = x.shape
        g = module.num_groups
        nhwc = x.permute(0, 2, 3, 1).reshape(n, h * w, g, c // g)
        var, mean = torch.var_mean(nhwc, dim=(1, 3), correction=0, keepdim=True)
        scale = torch.rsqrt(var.float() + module.eps) * module.weight.float().view(1, 1, g, -1)
        shift = module.bias.float().view(1, 1, g, -1) - mean.float() * scale
        out = torch.empty_like(x)
        torch.addcmul(shift, nhwc, scale, out=out.permute(0, 2, 3, 1).view(n, h * w, g, c // g))
        return out

    return forward


def _first_then_replayed(fn: Callable[[], torch.Tensor]) -> tuple[float, float, torch.Tensor]:
    """``fn``'s first call in seconds (compiling, where it compiles), then its median ms replayed from a
    CUDA graph, and that replay's output in float32."""
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    ms, out = graph_replay_ms(fn)
    return first, ms, out.float()


@contextlib.contextmanager
def _vae_variant(vae: Any, name: str) -> Iterator[None]:
    patches = MethodPatches()
    decoder = vae.decoder
    try:
        if name == "patched":
            patch_group_norms(decoder, patches)
        elif name == "fused":
            fuse_decoder(decoder, patches)
        elif name == "channels-last":
            decoder.to(memory_format=torch.channels_last)
            for module in decoder.modules():
                if type(module) is torch.nn.GroupNorm:
                    patches.replace(module, "forward", _group_norm_nhwc(module))
        elif name == "blocks compiled":
            patches.replace(decoder, "_repeated_blocks", ["ResnetBlock2D", "Upsample2D"])
            fast.compile_repeated_blocks(decoder, patches)
        elif name == "decoder compiled":
            patches.replace(decoder, "forward", torch.compile(decoder.forward, dynamic=False))
        yield
    finally:
        patches.undo()
        decoder.to(memory_format=torch.contiguous_format)
        torch._dynamo.reset()


VAE_VARIANTS = ("eager", "patched", "channels-last", "blocks compiled", "fused", "decoder compiled")


def vae(variants: tuple[str, ...] = VAE_VARIANTS) -> None:
    pipe = _build()
    vae_ = pipe.vae
    del pipe
    torch.cuda.empty_cache()
    for size in (512, 1024):
        latents = torch.randn(1, 16, size // 8, size // 8, device="cuda", dtype=torch.bfloat16)
        reference = None
        for name in ("eager", *(v for v in variants if v != "eager")):
            with _vae_variant(vae_, name), torch.no_grad():
                z = latents.to(memory_format=torch.channels_last) if name == "channels-last" else latents

                def decode(z: torch.Tensor = z) -> torch.Tensor:
                    return vae_.decode(z, return_dict=False)[0]

                try:
                    first, ms, out = _first_then_replayed(decode)
                    reference = out.clone() if reference is None else reference
                    diff = (out - reference).abs().max().item()
                    mse = (out.clamp(-1, 1) - reference.clamp(-1, 1)).pow(2).mean().item()
                    psnr = 10 * math.log10(4.0 / mse) if mse else float("inf")  # images in [-1, 1]
                    print(
                        f"VAE {size}² {name:18s}: {ms:7.2f} ms replayed; first call {first:5.1f} s; "
                        f"max diff {diff:.4f}; PSNR {psnr:.1f} dB against eager"
                    )
                    kernel_table(decode, f"VAE {size}² {name}", top=10)
                except Exception as error:
                    print(f"VAE {size}² {name}: failed: {type(error).__name__}: {str(error)[:400]}")


def _layer_inputs(encoder: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen["hidden"] = args[0] if args else kwargs.pop("hidden_states")
            seen["kwargs"] = dict(kwargs)

    handle = encoder.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        encoder(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen["hidden"], seen["kwargs"]


def text_encoder() -> None:
    from bcg_diffusion.features.quantization import FP8, quantize_transformer, torchao_config

    pipe = _build()
    encoder = pipe.text_encoder
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    with torch.no_grad():
        hidden, kwargs = _layer_inputs(encoder, ids)
        print(
            "layer kwargs:",
            {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in kwargs.items()},
        )

        def layers() -> torch.Tensor:
            h = hidden
            for layer in encoder.layers:
                out = layer(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
            return h

        reference = None
        for name in ("eager", "compiled", "fp8 compiled"):
            patches = MethodPatches()
            try:
                if name == "fp8 compiled":

                    def linears(module: torch.nn.Module, fqn: str) -> bool:
                        return isinstance(module, torch.nn.Linear) and all(s % 16 == 0 for s in module.weight.shape)

                    quantize_transformer(encoder, torchao_config(FP8), linears)
                if name != "eager":
                    patches.replace(encoder, "_repeated_blocks", [type(encoder.layers[0]).__name__])
                    fast.compile_repeated_blocks(encoder, patches)
                first, ms, out = _first_then_replayed(layers)
                reference = out.clone() if reference is None else reference
                error = ((out - reference).norm() / reference.norm()).item()
                print(
                    f"text encoder layers, 64 tokens, {name:13s}: {ms:6.2f} ms replayed; first call {first:5.1f} s; rel. error {error:.4f}"
                )
                kernel_table(layers, f"text encoder layers {name}", top=10)
            except Exception as error:
                print(f"text encoder {name}: failed: {type(error).__name__}: {str(error)[:400]}")
            finally:
                patches.undo()
                torch._dynamo.reset()  # the FP8 variant comes last: its linears stay quantized


def encode() -> None:
    from bcg_diffusion import accelerate, restore
    from bench.cases import Case

    pipe = _build()
    case = Case("z-image", 512, 512, 8, 0.0)
    accelerate(pipe, mode="fast", quantize="fp8")
    try:
        pipe(**case.kwargs())
        pipe(**case.kwargs())
        prompt = case.kwargs()["prompt"]

        def run() -> Any:
            return pipe.encode_prompt(prompt=prompt, device=torch.device("cuda"), do_classifier_free_guidance=False)

        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3)
        walls.sort()
        print(f"encode_prompt wall: median {walls[5]:.2f} ms, min {walls[0]:.2f} ms")
        kernel_table(run, "encode_prompt (fast-fp8)", top=12)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    finally:
        restore(pipe)


def z_block_512() -> None:
    from bench.probes import probe_attention_kernels as blocks

    base, inputs, patches_ = blocks._z_block_case()
    inputs = {"512²": inputs["512²"]}
    blocks.time_block(base, inputs, patches_, [("z fp8 512², FF fused", "cudnn", False, "fused")],
                      prepare=blocks._fp8_feed_forward("fused"))  # fmt: skip


def _gemm_us(a: torch.Tensor, weights: list[torch.Tensor], fp8: bool) -> float:
    """µs of ``a @ w.T`` for each of ``weights`` in turn, replayed from a graph (bf16, or row-wise FP8 as
    torchao runs it: ``_scaled_mm`` with per-row scales and fast accumulation)."""
    if fp8:
        rows = torch.ones(a.shape[0], 1, device="cuda")
        a8 = a.to(torch.float8_e4m3fn)
        prepared = [(w.to(torch.float8_e4m3fn), torch.ones(1, w.shape[0], device="cuda")) for w in weights]

        def run() -> Any:
            return [
                torch._scaled_mm(a8, w.t(), scale_a=rows, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=True)
                for w, s in prepared
            ]
    else:

        def run() -> Any:
            return [a @ w.t() for w in weights]

    ms, _ = graph_replay_ms(lambda: [run() for _ in range(10)])
    return ms * 100  # µs per run: 10 runs per replay


def gemms() -> None:
    """Separate query, key and value projections (and Z-Image's two feed-forward inputs) against one
    product over their concatenated weights, bf16 and FP8, at the blocks' shapes."""
    cases = {  # label: (rows, width, outputs of each, how many)
        "Z-Image 512² q,k,v": (1088, 3840, 3840, 3),
        "Z-Image 1024² q,k,v": (4160, 3840, 3840, 3),
        "Z-Image 512² w1,w3": (1088, 3840, 10240, 2),
        "Z-Image 1024² w1,w3": (4160, 3840, 10240, 2),
        "Qwen-Image 1024² CFG q,k,v": (8192, 3072, 3072, 3),
        "Qwen-Image 512² CFG q,k,v": (2048, 3072, 3072, 3),
    }
    with torch.no_grad():
        for label, (rows, width, outputs, count) in cases.items():
            a = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            weights = [
                torch.randn(outputs, width, device="cuda", dtype=torch.bfloat16) * width**-0.5 for _ in range(count)
            ]
            fused = [torch.cat(weights)]
            flop = 2 * rows * width * outputs * count
            for fp8 in (False, True):
                apart, joined = _gemm_us(a, weights, fp8), _gemm_us(a, fused, fp8)
                print(
                    f"{label:28s} {'fp8 ' if fp8 else 'bf16'}: separate {apart:7.1f} us ({flop / apart / 1e6:5.0f} TFLOP/s), "
                    f"one product {joined:7.1f} us ({flop / joined / 1e6:5.0f} TFLOP/s), {apart / joined:.3f}x",
                    flush=True,
                )


SECTIONS = {
    "gemms": ("separate projections against one product over concatenated weights", gemms),
    "vae": ("VAE decode variants", vae),
    "text-encoder": ("text encoder layers: eager, compiled, FP8", text_encoder),
    "encode": ("encode_prompt in fast-fp8: wall against kernels", encode),
    "z-block-512": ("one Z-Image FP8 block at 512²", z_block_512),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--vae-variants", default=",".join(VAE_VARIANTS), help=f"of {', '.join(VAE_VARIANTS)}")
    args = parser.parse_args()
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), flush=True)
    for name in args.sections.split(","):
        title, body = SECTIONS[name]
        if name == "vae":
            section(title, functools.partial(body, tuple(args.vae_variants.split(","))))
        else:
            section(title, body)
        torch.cuda.empty_cache()
