"""GPU probe: FlashAttention-4's forward (the ``flash-attn-4`` package, CuTe DSL kernels for Hopper and
Blackwell) against the bf16 kernels fast mode uses, on the attention shapes of the pipelines issue 56 serves.

For each shape, ``[B, S, H, D]`` bf16 inputs as diffusers' processors hold them, each kernel replayed from a
CUDA graph (which also shows whether it captures): time, TFLOP/s (4·B·H·S²·D) and relative error against
float32 attention. The kernels:

* ``cudnn (fast mode)``: SDPA's cuDNN kernel on the transposed views, as ``patches.attention`` calls it;
* ``sdpa flash``: PyTorch's own flash kernel;
* ``fa4``: ``flash_attn.cute.interface.flash_attn_func`` on the ``[B, S, H, D]`` tensors as they are,
  after one eager call (its JIT compile, timed);
* ``sdpa flash (FA4 activated)``: SDPA's flash backend after ``torch.nn.attention.activate_flash_attention_impl
  ("FA4")``, where this PyTorch has it.

    python -m bench.probes.probe_fa4_attention [--shapes flux-1024,wan-81]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bcg_diffusion.patches.attention import _cudnn_attention
from bench.probes.probe_fast_floor import graph_replay_ms

SHAPES = {  # label: (batch, tokens, heads), head size 128
    "flux-1024": (1, 4096 + 512, 24),  # FLUX.1-dev and FLUX.2 klein at 1024² (512 text tokens)
    "flux-512": (1, 1024 + 512, 24),
    "qwen-edit-1024": (1, 8192 + 230, 24),  # Qwen-Image-Edit-2511: output and input image, ~230 text tokens
    "qwen-1024": (1, 4096 + 64, 24),
    "z-1024": (1, 4160, 30),
    "wan-81": (1, 21 * 30 * 52, 40),  # Wan 2.1 14B, 832x480, 81 frames: 32,760 tokens
}


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _fa4() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as error:  # the probe reports what is missing and goes on without it
        print(f"flash_attn.cute not importable: {type(error).__name__}: {error}")
        return None
    return lambda q, k, v: flash_attn_func(q, k, v)[0]


def _activate_fa4() -> bool:
    try:
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl("FA4")
    except Exception as error:
        print(f"activate_flash_attention_impl('FA4') failed: {type(error).__name__}: {error}")
        return False
    return True


def time_shapes(candidates: dict[str, Callable[..., torch.Tensor]], labels: list[str]) -> None:
    """Print each candidate's time, rate, error and first (eager) call at each shape of ``labels``."""
    torch.manual_seed(0)
    for label in labels:
        batch, tokens, heads = SHAPES[label]
        q, k, v = (torch.randn(batch, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * tokens * tokens * 128
        reference = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        print(f"\n-- {label}: q {tuple(q.shape)}, {flops / 1e9:.0f} GFLOP", flush=True)
        for name, fn in candidates.items():
            try:
                start = time.perf_counter()
                fn(q, k, v)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                ms, out = graph_replay_ms(lambda fn=fn, q=q, k=k, v=v: [fn(q, k, v) for _ in range(5)][-1])
            except Exception as error:  # a kernel refusing the shape or the capture is a result here
                print(f"   {name:30s}: failed: {type(error).__name__}: {str(error)[:300]}")
                continue
            ms /= 5
            error = ((out.float() - reference).norm() / reference.norm()).item()
            print(
                f"   {name:30s}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  rel. error {error:.5f}"
                f"  first call {first * 1e3:.0f} ms",
                flush=True,
            )
        del q, k, v, reference
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from " + ", ".join(SHAPES))
    labels = parser.parse_args().shapes.split(",")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    candidates: dict[str, Callable[..., torch.Tensor]] = {
        "cudnn (fast mode)": _cudnn_attention,
        "sdpa flash": _sdpa_flash,
    }
    fa4 = _fa4()
    if fa4 is not None:
        candidates["fa4"] = fa4
    time_shapes(candidates, labels)
    if fa4 is not None and _activate_fa4():
        print("\n== SDPA's flash backend with FA4 activated")
        time_shapes({"sdpa flash (FA4 activated)": _sdpa_flash}, labels)


if __name__ == "__main__":
    main()
