"""GPU probe: where a FLUX.1-dev step at 1024² spends its time in fast mode, and what its products could gain.

Issue 56 asks FLUX.1-dev 1024², 28 steps for ``fast`` <= 3.3 s (0.117 s a step with the decode) and
``fast-fp8`` <= 2.4 s. This probe says how far the kernels a step cannot avoid already go:

* ``gemms``: each matrix product of a step at FLUX.1's shapes (4,096 image and 512 text tokens, width
  3,072, 24 heads of 128), cuBLAS bf16 and row-wise FP8, replayed from a CUDA graph and cycling through
  weight copies so that none stays in L2; next to the products fused the way a block could run them (a
  single block's query, key, value and MLP input as one product; a stream's query, key and value as one)
  and the up projection with cuBLAS's tanh-GELU epilogue. The step's sum of products at each speed.
* ``call``: one fast-mode call of the full-size pipeline (random weights) at 1024² without the decode,
  profiled per step: kernel time by kind (products, attention, the rest) and the top kernels; then the
  same with ``quantize="fp8"`` and with ``attention="fp8"`` as well. ``--pipeline`` profiles another of
  the benchmark's published pipelines (``qwen-image-edit``: where its ``fast-fp8`` time goes), and
  ``--modes`` picks the modes, ``eager`` among them.

    python -m bench.probes.probe_flux [--sections gemms,call] [--pipeline flux] [--modes eager,fast,...]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bcg_diffusion import accelerate, restore
from bench.cases import Case
from bench.probes.probe_block_kernels import _inputs, _tflops, _time_products
from bench.probes.probe_fast_floor import kernel_table, section

DIM, MLP = 3072, 12288
IMAGE, TEXT = 4096, 512
JOINT = IMAGE + TEXT
CUDA = torch.device("cuda")
DOUBLE, SINGLE = 19, 38


def _fp8_ms(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    fp8 = torch.float8_e4m3fn
    x8 = x.to(fp8)
    w8 = [w.to(fp8).t() for w in weights]  # column-major, as _scaled_mm wants its second operand
    scale_x, scale_w = torch.ones(x.shape[0], 1, device="cuda"), torch.ones(1, weights[0].shape[0], device="cuda")
    return _time_products(lambda i: torch._scaled_mm(x8, w8[i], scale_x, scale_w, out_dtype=torch.bfloat16))


def _product(label: str, m: int, k: int, n: int, count: int) -> tuple[float, float]:
    """(bf16 ms, FP8 ms) of one product, printed with its TFLOP/s and its ms over a step (``count`` per step)."""
    x, weights = _inputs(m, k, n)
    ms = _time_products(lambda i: F.linear(x, weights[i]))
    ms8 = _fp8_ms(x, weights)
    print(
        f"{label:34s} M={m:5d} K={k:5d} N={n:5d}: bf16 {ms * 1e3:7.1f} us ({_tflops(m, k, n, ms):4.0f} TFLOP/s), "
        f"FP8 {ms8 * 1e3:7.1f} us ({_tflops(m, k, n, ms8):4.0f}); x{count} a step: {ms * count:6.2f} / "
        f"{ms8 * count:6.2f} ms",
        flush=True,
    )
    return ms * count, ms8 * count


def _gelu_epilogue(m: int) -> None:
    """The up projection then tanh GELU: F.linear + F.gelu against cuBLAS's GELU epilogue (one kernel)."""
    x, weights = _inputs(m, DIM, MLP)
    bias = torch.randn(MLP, device="cuda", dtype=torch.bfloat16)
    apart = _time_products(lambda i: F.gelu(F.linear(x, weights[i], bias), approximate="tanh"))
    fused = _time_products(lambda i: torch._addmm_activation(bias, x, weights[i].t(), use_gelu=True))
    difference = (torch._addmm_activation(bias, x, weights[0].t(), use_gelu=True).float()
                  - F.gelu(F.linear(x, weights[0], bias), approximate="tanh").float()).abs().max().item()  # fmt: skip
    print(
        f"up projection + tanh GELU M={m}: apart {apart * 1e3:7.1f} us, cuBLAS epilogue {fused * 1e3:7.1f} us "
        f"(max difference {difference:.4f})",
        flush=True,
    )


def gemms() -> None:
    torch.manual_seed(0)
    print("-- as diffusers runs them (FluxTransformerBlock x19, FluxSingleTransformerBlock x38)")
    now = [
        _product("double, image q/k/v/out", IMAGE, DIM, DIM, 4 * DOUBLE),
        _product("double, image ff up", IMAGE, DIM, MLP, DOUBLE),
        _product("double, image ff down", IMAGE, MLP, DIM, DOUBLE),
        _product("double, text q/k/v/out", TEXT, DIM, DIM, 4 * DOUBLE),
        _product("double, text ff up", TEXT, DIM, MLP, DOUBLE),
        _product("double, text ff down", TEXT, MLP, DIM, DOUBLE),
        _product("single, q/k/v", JOINT, DIM, DIM, 3 * SINGLE),
        _product("single, proj_mlp", JOINT, DIM, MLP, SINGLE),
        _product("single, proj_out", JOINT, DIM + MLP, DIM, SINGLE),
    ]
    print(f"sum a step: bf16 {sum(a for a, _ in now):.2f} ms, FP8 {sum(b for _, b in now):.2f} ms")
    print("-- fused alternatives (replacing the rows above)")
    fused = [
        _product("double, image q+k+v fused", IMAGE, DIM, 3 * DIM, DOUBLE),
        _product("double, text q+k+v fused", TEXT, DIM, 3 * DIM, DOUBLE),
        _product("single, q+k+v+mlp fused", JOINT, DIM, 3 * DIM + MLP, SINGLE),
        _product("single, q+k+v fused", JOINT, DIM, 3 * DIM, SINGLE),
    ]
    del fused
    for m in (IMAGE, JOINT):
        _gelu_epilogue(m)


# mode -> accelerate's options (None: eager, as the pipeline runs without us)
MODES = {
    "eager": None,
    "fast": {},
    "fast-fp8": {"quantize": "fp8"},
    "fast-fp8-attn": {"quantize": "fp8", "attention": "fp8"},
}


def _call_profile(pipe, case: Case, label: str, options: dict | None) -> None:
    if options is not None:
        accelerate(pipe, mode="fast", **options)
    try:
        start = time.perf_counter()
        pipe(**case.kwargs("latent", device=CUDA))
        print(f"{label}: first call {time.perf_counter() - start:.1f} s", flush=True)
        for _ in range(2):
            pipe(**case.kwargs("latent", device=CUDA))
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe(**case.kwargs("latent", device=CUDA))
        torch.cuda.synchronize()
        print(f"{label}: {case.steps} steps without the decode {time.perf_counter() - start:.3f} s", flush=True)
        kernel_table(lambda: pipe(**case.kwargs("latent", device=CUDA)), f"{label}, per step", top=30, per=case.steps)
    finally:
        if options is not None:
            restore(pipe)
        torch._dynamo.reset()


def call(pipeline: str = "flux", modes: tuple[str, ...] = ("fast", "fast-fp8", "fast-fp8-attn")) -> None:
    """Per-step kernels of ``pipeline`` (one of bench.published's, at its published size and guidance, 8 steps;
    4 with CFG) in each of ``modes``."""
    from bench.published import PUBLISHED, build

    spec = PUBLISHED[pipeline]
    pipe = build(pipeline, "random-full", CUDA)
    pipe.set_progress_bar_config(disable=True)
    steps = 4 if spec.uses_cfg(spec.guidance) else 8
    case = Case(pipeline, spec.height, spec.width, steps, spec.guidance, frames=spec.frames)
    for mode in modes:
        _call_profile(pipe, case, f"{pipeline} {mode}", MODES[mode])


def main() -> None:
    from bench.published import PUBLISHED

    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="gemms,call", help="comma-separated, of gemms, call")
    parser.add_argument("--pipeline", default="flux", choices=sorted(PUBLISHED), help="the call section's pipeline")
    parser.add_argument("--modes", default="fast,fast-fp8,fast-fp8-attn", help=f"the call's, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    for name in args.sections.split(","):
        if name == "gemms":
            section("FLUX.1 gemms", gemms)
        elif name == "call":
            section(f"{args.pipeline} call", lambda: call(args.pipeline, modes))
        else:
            parser.error(f"unknown section {name!r}; choose from gemms, call")


if __name__ == "__main__":
    main()
