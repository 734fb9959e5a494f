"""GPU probe: why attention runs slower inside a pipeline's step than alone.

Profiles of fast mode's steps show SDPA's cuDNN kernel at about 525 TFLOP/s on Qwen-Image-Edit-2511's
shape and 537 on FLUX.1's (runs 176 and 179), where SDPA's cuDNN path alone reaches 594 and 649
(``bench.probes.probe_fa4_attention``, run 198, which printed no kernel names). This probe tells apart the two
explanations:

* **the kernel**: cuDNN picks its kernel (a "knob") from the tensors' shapes and strides, and a layout
  other than the probe's may get a slower one. Each layout's kernel name is printed;
* **the load**: alone, a few calls run between host syncs, and the GPU holds its top clock; in a step,
  attention runs between large matrix products for seconds on end, near the board's power limit.
  Each layout runs as a *burst* (5 calls a replay, a host sync after each replay, as
  ``probe_fa4_attention``) and *sustained* (the same graph replayed back to back for a few seconds); fast
  mode's layout also runs *between products* (each call followed by the block's feed-forward products, bf16
  or FP8, replayed back to back; the kernels' own times from the profiler). ``nvidia-smi`` samples the SM clock and the
  power draw all along, and each phase prints their means.

    python -m bench.probes.probe_attention_under_load [--shapes qwen-edit-1024,flux-1024] [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bcg_diffusion.patches.attention import _cudnn_attention
from bench.measure import kernel_kind
from bench.probes.probe_fa4_attention import SHAPES
from bench.probes.probe_fast_floor import capture_graph, gpu_kernels, replay_ms

_SMI_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


class ClockLog:
    """``nvidia-smi`` sampling the SM clock, the power draw and the clock event reasons every 50 ms into a file.
    :meth:`start` marks where a phase's samples begin and :meth:`summary` gives their mean clock (MHz) and
    power (W): samples are written as they are taken, so a phase's are the lines added since its start."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")  # noqa: SIM115 - open for the probe's life, closed by close()
        fields = _SMI_FIELDS
        try:  # older drivers name the clock event reasons "clocks_throttle_reasons"
            query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            if subprocess.run(query, capture_output=True).returncode != 0:
                fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
        except OSError:
            pass
        command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50"]
        try:
            self.process: subprocess.Popen | None = subprocess.Popen(
                command, stdout=self.file, stderr=subprocess.DEVNULL
            )
        except OSError as error:  # no nvidia-smi: the times still come, without clocks
            print(f"nvidia-smi not started ({error}): no clock or power figures", flush=True)
            self.process = None
        self.first = 0

    def _lines(self) -> list[str]:
        self.file.flush()
        with open(self.file.name) as samples:
            return samples.readlines()

    def start(self) -> None:
        self.first = len(self._lines()) if self.process is not None else 0

    def summary(self) -> str:
        """The samples since :meth:`start`, as one line ("" without nvidia-smi)."""
        if self.process is None:
            return ""
        clocks, powers, reasons = [], [], set()
        for line in self._lines()[self.first :]:
            fields = [f.strip() for f in line.split(",")]
            try:
                clocks.append(float(fields[0]))
                powers.append(float(fields[1]))
            except (ValueError, IndexError):  # a line nvidia-smi was still writing, or "[N/A]"
                continue
            reasons.add(fields[2] if len(fields) > 2 else "?")
        if not clocks:
            return "  (no clock samples)"
        return (
            f"  SM clock {statistics.mean(clocks):.0f} MHz (min {min(clocks):.0f}), power {statistics.mean(powers):.0f} W"
            f" (max {max(powers):.0f}), clock event reasons {sorted(reasons)}"
        )

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
        self.file.close()


def sustained_ms(graph: torch.cuda.CUDAGraph, seconds: float) -> float:
    """Median ms of one replay over the second half of ``seconds`` of back-to-back replays (the host stays
    a few replays ahead, so the GPU never idles)."""
    events = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
        if len(events) > 3:
            events[-3][1].synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events[len(events) // 2 :])


def kernel_ms(graph: torch.cuda.CUDAGraph, replays: int = 5) -> dict[str, tuple[float, int]]:
    """Each kernel's mean ms and count per replay over ``replays`` back-to-back replays, from the profiler."""
    totals: dict[str, list[float]] = defaultdict(list)
    for event in gpu_kernels(lambda: [graph.replay() for _ in range(replays)]):
        totals[event.name].append(event.device_time / 1e3)
    return {name: (sum(times) / len(times), len(times) // replays) for name, times in totals.items()}


def _attention_kernel(kernels: dict[str, tuple[float, int]]) -> str:
    return next(name for name in kernels if kernel_kind(name) == "attention")


def _feed_forward(rows: int, fp8: bool) -> Callable[[], object]:
    """The block's feed-forward products on ``rows`` tokens (3072 -> 12288 -> 3072), bf16 or row-wise FP8."""
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(12288, 3072, device="cuda", dtype=torch.bfloat16) / 55
    w2 = torch.randn(3072, 12288, device="cuda", dtype=torch.bfloat16) / 110
    if not fp8:
        return lambda: F.linear(F.linear(x, w1), w2)
    e4m3 = torch.float8_e4m3fn
    x8, h8 = x.to(e4m3), torch.randn(rows, 12288, device="cuda").to(e4m3)
    w1t, w2t = w1.to(e4m3).t(), w2.to(e4m3).t()  # column-major, as _scaled_mm wants its second operand
    sx, sh = torch.ones(rows, 1, device="cuda"), torch.ones(rows, 1, device="cuda")
    s1, s2 = torch.ones(1, 12288, device="cuda"), torch.ones(1, 3072, device="cuda")

    def products() -> torch.Tensor:
        torch._scaled_mm(x8, w1t, sx, s1, out_dtype=torch.bfloat16)
        return torch._scaled_mm(h8, w2t, sh, s2, out_dtype=torch.bfloat16)

    return products


def _layouts(batch: int, tokens: int, heads: int) -> dict[str, Callable[[], torch.Tensor]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def bhsd() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh)

    return {"cudnn [B,S,H,D] views (fast mode)": lambda: _cudnn_attention(q, k, v), "cudnn [B,H,S,D]": bhsd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen-edit-1024,flux-1024", help="from " + ", ".join(SHAPES))
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each sustained run")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    clock = ClockLog()
    try:
        for label in args.shapes.split(","):
            batch, tokens, heads = SHAPES[label]
            flops = 4 * batch * heads * tokens * tokens * 128
            print(
                f"\n-- {label}: {batch}x{tokens} tokens, {heads} heads of 128, {flops / 1e9:.0f} GFLOP a call",
                flush=True,
            )
            layouts = _layouts(batch, tokens, heads)
            for name, attention in layouts.items():
                graph, _ = capture_graph(lambda attention=attention: [attention() for _ in range(5)])
                kernels = kernel_ms(graph)
                print(f"   {name}: kernel {_attention_kernel(kernels)[:110]}", flush=True)
                for way, measure in (("burst", replay_ms), ("sustained", lambda g: sustained_ms(g, args.seconds))):
                    clock.start()
                    ms = measure(graph) / 5
                    print(
                        f"     {way:10s}: {ms * 1e3:7.1f} us a call, {flops / ms / 1e9:4.0f} TFLOP/s"
                        + clock.summary(),
                        flush=True,
                    )
                del graph
            attention = layouts["cudnn [B,S,H,D] views (fast mode)"]
            for fp8 in (False, True):
                products = _feed_forward(batch * tokens, fp8)
                graph, _ = capture_graph(lambda a=attention, p=products: [(a(), p()) for _ in range(5)][-1])
                clock.start()
                sustained_ms(graph, args.seconds)
                kernels = kernel_ms(graph)
                attn_name = _attention_kernel(kernels)
                ms, _ = kernels[attn_name]
                others = sum(m * c for n, (m, c) in kernels.items() if n != attn_name) / 5
                print(
                    f"   between {'FP8' if fp8 else 'bf16'} feed-forward products: attention {ms * 1e3:7.1f} us a call,"
                    f" {flops / ms / 1e9:4.0f} TFLOP/s (products {others:.2f} ms a block)" + clock.summary(),
                    flush=True,
                )
                del graph, products
            del layouts, attention
            torch.cuda.empty_cache()
    finally:
        clock.close()


if __name__ == "__main__":
    main()
