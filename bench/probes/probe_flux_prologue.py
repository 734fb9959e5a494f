"""FLUX's attention prologue in our kernel, per launch setting (``kernels.qk_prologue``, ``norm="torch"``,
``(cos, sin)`` frequencies): a FLUX.1 single block's query and key at 1024² (4,608 tokens, 24 heads of 128),
in bf16 and written in float8 for cuDNN's FP8 attention (the value's largest magnitude reduced on the way).

Each setting (rows of ``D`` per program, warps) launches 20 times in one CUDA graph; the time per launch is
printed. Run 180 (H100): 42–48 µs in bf16 for every setting, about 2.6 TB/s; 61–70 µs in FP8. The library's
setting, ``qk_prologue._CONFIG_REAL`` (8, 2), is within 2 µs of the fastest in both.

    python -m bench.probes.probe_flux_prologue
"""

from __future__ import annotations

import torch

from bcg_diffusion.kernels import cudnn_fp8_attention, qk_prologue

SETTINGS = ((8, 2), (8, 1), (16, 4), (16, 2), (32, 8), (4, 1))
TOKENS, HEADS, HEAD_DIM = 4608, 24, 128
LAUNCHES = 20


def _launch(tensors: dict, setting: tuple[int, int], fp8: bool, outputs: tuple) -> None:
    """One launch of the prologue on ``tensors`` at ``setting``, into ``outputs`` (query, key, largest)."""
    out_q, out_k, largest = outputs
    weights, freqs = tensors["weights"], (tensors["freqs"], None)
    if fp8:
        largest.zero_()
        qk_prologue._launch((tensors["query"], tensors["key"], tensors["value"]), None, weights, [1e-6] * 2, freqs,
                            [0], (out_q, out_k, None), setting, fp8=(*tensors["descales"], largest), norm="torch")  # fmt: skip
    else:
        qk_prologue._launch((tensors["query"], tensors["key"], None), None, weights, [1e-6] * 2, freqs, [0],
                            (out_q, out_k, None), setting, norm="torch")  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    query, key, value = (
        torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    weights = [torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    angles = torch.rand(TOKENS, HEAD_DIM // 2, device="cuda").repeat_interleave(2, 1)  # FLUX's: pairs alike
    descales = [cudnn_fp8_attention.descale(cudnn_fp8_attention.rms_norm_bound([w], HEAD_DIM)) for w in weights]
    tensors = {"query": query, "key": key, "value": value, "weights": weights, "descales": descales,
               "freqs": (angles.cos(), angles.sin())}  # fmt: skip
    for setting in SETTINGS:
        for fp8 in (False, True):
            if fp8:
                outputs = qk_prologue._norm_rope_fp8_empty(query)
            else:
                outputs = (torch.empty_like(query), torch.empty_like(key), None)
            for _ in range(3):  # compiles, then warms
                _launch(tensors, setting, fp8, outputs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(LAUNCHES):
                    _launch(tensors, setting, fp8, outputs)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"config {setting} fp8 {fp8}: {start.elapsed_time(end) / LAUNCHES * 1000:.1f} us", flush=True)


if __name__ == "__main__":
    main()
