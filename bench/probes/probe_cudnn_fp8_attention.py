"""Probe: cuDNN's FP8 attention (through ``nvidia-cudnn-frontend``) on Qwen-Image's and Z-Image's shapes.

Fast mode's bf16 attention is cuDNN's kernel through PyTorch's SDPA (about 615 TFLOP/s at Qwen-Image's
1024² shape); our Triton FP8 kernel reaches 585–709 TFLOP/s alone and gains little end to end
(docs/results.md). cuDNN also has an FP8 forward (query, key, value and the softmax probabilities in
e4m3, one scale each), reachable from Python through NVIDIA's cudnn-frontend package. This probe
measures, on the tensors as fast mode's processors hold them (``[B, S, H, D]``, replayed from a CUDA
graph, which also checks that the frontend's execution captures):

- the kernel alone, against SDPA's cuDNN bf16 kernel and our Triton FP8 kernel;
- what its scales cost: per-tensor largest magnitudes and the casts, compiled by inductor;
- its error against float32 attention, for several scales of the probabilities, beside bf16's.

Run on a GPU (carry the frontend's wheel in .whl/):
    python -m bench.probes.probe_cudnn_fp8_attention
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from bcg_diffusion.kernels import attention as kernels
from bench.probes.probe_attention_kernels import SHAPES, _sdpa
from bench.probes.probe_fast_floor import graph_replay_ms

FP8_MAX = 448.0
_UIDS = dict(q=1, k=2, v=3, o=4, descale_q=5, descale_k=6, descale_v=7, descale_s=8, scale_s=9, scale_o=10)
_UIDS.update(amax_s=11, amax_o=12)


def bshd_strides(batch: int, tokens: int, heads: int, dim: int) -> tuple[int, ...]:
    """Strides of a contiguous ``[B, S, H, D]`` tensor, in cuDNN's ``[B, H, S, D]`` dimension order."""
    return (tokens * heads * dim, dim, heads * dim, 1)


class CudnnFp8Attention:
    """One built cuDNN FP8 attention graph for one shape; ``__call__`` runs it on the current stream."""

    def __init__(self, batch: int, tokens: int, heads: int, dim: int, out_dtype: torch.dtype) -> None:
        import cudnn

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        fp8, out_type = cudnn.data_type.FP8_E4M3, _cudnn_type(out_dtype)
        graph = cudnn.pygraph(
            io_data_type=fp8, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
        )
        dims, strides = (batch, heads, tokens, dim), bshd_strides(batch, tokens, heads, dim)
        q, k, v = (graph.tensor(uid=_UIDS[n], dim=dims, stride=strides, data_type=fp8) for n in ("q", "k", "v"))
        scalars = {
            name: graph.tensor(uid=_UIDS[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)
            for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        }
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=q, k=k, v=v, **scalars, generate_stats=False, attn_scale=1.0 / math.sqrt(dim), use_causal_mask=False
        )
        o.set_uid(_UIDS["o"]).set_output(True).set_dim(dims).set_stride(strides).set_data_type(out_type)
        for name, tensor in (("amax_s", amax_s), ("amax_o", amax_o)):
            tensor.set_uid(_UIDS[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
            tensor.set_data_type(cudnn.data_type.FLOAT)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
        self.amax = torch.empty(2, dtype=torch.float32, device="cuda")
        self.out_shape, self.out_dtype = (batch, tokens, heads, dim), out_dtype
        self.scales: dict[float, torch.Tensor] = {}

    def __call__(self, q8, k8, v8, descales: torch.Tensor, scale_s: float, scale_o: torch.Tensor) -> torch.Tensor:
        """``descales``: float32 ``[3]`` (query, key, value); returns ``[B, S, H, D]``."""
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device="cuda")
        if scale_s not in self.scales:  # made before a capture: a copy from the host cannot be captured
            self.scales[scale_s] = torch.tensor([scale_s, 1.0 / scale_s], device="cuda")
        s = self.scales[scale_s]
        pack = {
            _UIDS["q"]: q8, _UIDS["k"]: k8, _UIDS["v"]: v8, _UIDS["o"]: out,
            _UIDS["descale_q"]: descales[0:1], _UIDS["descale_k"]: descales[1:2], _UIDS["descale_v"]: descales[2:3],
            _UIDS["scale_s"]: s[0:1], _UIDS["descale_s"]: s[1:2], _UIDS["scale_o"]: scale_o,
            _UIDS["amax_s"]: self.amax[0:1], _UIDS["amax_o"]: self.amax[1:2],
        }  # fmt: skip
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return out


def _cudnn_type(dtype: torch.dtype) -> Any:
    import cudnn

    return {
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float16: cudnn.data_type.HALF,
        torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3,
    }[dtype]


def quantize_per_tensor(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each tensor in e4m3 with one scale (its largest magnitude over 448), and the descales ``[n]``."""
    amax = torch.stack([t.abs().amax().float() for t in tensors]).clamp(min=1e-12)
    descales = amax / FP8_MAX
    return [(t.float() / d).to(torch.float8_e4m3fn) for t, d in zip(tensors, descales)], descales


def main() -> None:
    import cudnn

    print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version_string()}, torch {torch.__version__}")
    torch.manual_seed(0)
    quantize = torch.compile(quantize_per_tensor)
    for label, (batch, tokens, heads) in SHAPES.items():
        probe_shape(label, batch, tokens, heads, quantize)


def probe_shape(label: str, batch: int, tokens: int, heads: int, quantize: Any) -> None:
    q, k, v = (torch.randn(batch, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q = q * 2  # query and key as RMS norms leave them (weights ~ 1), value wider
    v = v * 4
    flops = 4 * batch * heads * tokens * tokens * 128
    reference = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    def report(name: str, ms: float, out: torch.Tensor | None, flops: int = flops) -> None:
        error = "" if out is None else f"  rel. error {_error(out, reference):.4f}"
        print(f"   {name:44s}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s{error}", flush=True)

    print(f"\n-- {label}: q {tuple(q.shape)}, {flops / 1e9:.0f} GFLOP", flush=True)
    ms, out = graph_replay_ms(lambda: [_sdpa(None)(q, k, v) for _ in range(5)][-1])
    report("sdpa default (cuDNN bf16)", ms / 5, out.unflatten(-1, (heads, 128)))
    quantized = kernels.quantize_for_fp8_attention(q, k, v)
    ms, out = graph_replay_ms(
        lambda: [torch.ops.bcg_diffusion.fp8_attention(*quantized, 128**-0.5, q.dtype) for _ in range(5)][-1]
    )
    report("triton fp8 kernel alone", ms / 5, out)
    (q8, k8, v8), descales = quantize(q, k, v)
    ms, _ = graph_replay_ms(lambda: [quantize(q, k, v) for _ in range(5)][-1])
    print(f"   {'per-tensor scales and casts (inductor)':44s}: {ms / 5 * 1e3:8.1f} us", flush=True)
    one = torch.ones(1, device="cuda")
    built = {}
    for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        try:
            attention = built[out_dtype] = CudnnFp8Attention(batch, tokens, heads, 128, out_dtype)
        except Exception as error:  # a refused graph is a result here
            print(f"   cudnn fp8 -> {out_dtype}: not built: {type(error).__name__}: {str(error)[:300]}")
            continue
        for scale_s in (448.0, 256.0, 64.0):
            scale_o = one if out_dtype != torch.float8_e4m3fn else 1.0 / descales[2:3]
            try:
                ms, out = graph_replay_ms(
                    lambda a=attention, s=scale_s, o=scale_o: [a(q8, k8, v8, descales, s, o) for _ in range(5)][-1]
                )
            except Exception as error:
                print(f"   cudnn fp8 -> {out_dtype}, scale_s {scale_s}: failed: {type(error).__name__}: {error}")
                break
            if out_dtype == torch.float8_e4m3fn:
                out = out.float() / scale_o
            report(f"cudnn fp8 -> {str(out_dtype)[6:]}, P scale {scale_s:g}", ms / 5, out)
    for out_dtype, attention in built.items():
        ms, out = graph_replay_ms(
            lambda a=attention: [attention_with_scales(a, quantize, q, k, v) for _ in range(5)][-1]
        )
        report(f"scales + cudnn fp8 -> {str(out_dtype)[6:]} + to bf16", ms / 5, out)


def attention_with_scales(attention: CudnnFp8Attention, quantize: Any, q, k, v) -> torch.Tensor:
    """Quantize, attend, and return bf16 (an FP8 output scaled back, as the next product would read it)."""
    (q8, k8, v8), descales = quantize(q, k, v)
    if attention.out_dtype != torch.float8_e4m3fn:
        return attention(q8, k8, v8, descales, 448.0, torch.ones(1, device="cuda"))
    out = attention(q8, k8, v8, descales, 448.0, 1.0 / descales[2:3])
    return (out.float() * descales[2]).to(torch.bfloat16)


def _error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).norm() / reference.norm()).item()


if __name__ == "__main__":
    main()
