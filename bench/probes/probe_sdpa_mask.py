"""GPU probe: what a text mask costs Qwen-Image's joint attention at 512², per SDPA backend.

Answered (run 24, `bench/results/2026-11-30-h200/probe-sdpa-mask.log`): a text mask costs Qwen-Image's batched attention nothing on cuDNN (115 against 117 µs one by one on flash), and cuDNN alone is fastest (77 µs).

Fast mode batches true CFG's cond and uncond calls; when the two prompts differ in length the batch
needs a text mask, and PyTorch's flash kernel takes no mask. This times one block's attention
(24 heads x 128, 1024 image tokens) for: each prompt alone unmasked (what unbatched CFG runs), the
batch with a mask on each backend that accepts one, and the batch with equal lengths unmasked.

    python -m bench.probes.probe_sdpa_mask [--cond 40] [--uncond 8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iterations: int = 200) -> float:
    """Median-free but steady: microseconds per call over ``iterations`` after 20 warm-up calls."""
    for _ in range(20):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cond", type=int, default=40)
    parser.add_argument("--uncond", type=int, default=8)
    parser.add_argument("--image", type=int, default=1024)
    args = parser.parse_args()
    heads, dim, device = 24, 128, "cuda"
    length = max(args.cond, args.uncond)

    def qkv(batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(batch, heads, tokens, dim, device=device, dtype=torch.bfloat16) for _ in range(3))

    cond, uncond = qkv(1, args.cond + args.image), qkv(1, args.uncond + args.image)
    batch = qkv(2, length + args.image)
    mask = torch.ones(2, length + args.image, dtype=torch.bool, device=device)
    mask[0, args.cond : length] = False
    mask[1, args.uncond : length] = False
    mask = mask[:, None, None, :]

    results = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        results["one by one, unmasked (flash)"] = timed(
            lambda: (F.scaled_dot_product_attention(*cond), F.scaled_dot_product_attention(*uncond))
        )
        results["batch, equal lengths, unmasked (flash)"] = timed(lambda: F.scaled_dot_product_attention(*batch))
    results["batch, masked, default choice"] = timed(lambda: F.scaled_dot_product_attention(*batch, attn_mask=mask))
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                results[f"batch, masked ({name})"] = timed(
                    lambda: F.scaled_dot_product_attention(*batch, attn_mask=mask)
                )
        except RuntimeError as exc:
            results[f"batch, masked ({name})"] = f"not available: {str(exc).splitlines()[0][:120]}"
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            results["one by one, unmasked (cudnn)"] = timed(
                lambda: (F.scaled_dot_product_attention(*cond), F.scaled_dot_product_attention(*uncond))
            )
    except RuntimeError as exc:
        results["one by one, unmasked (cudnn)"] = f"not available: {str(exc).splitlines()[0][:120]}"
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, text {args.cond} / {args.uncond}, image {args.image}"
    )
    for name, value in results.items():
        shown = (
            f"{value:8.1f} us per block, {value * 60 / 1000:6.2f} ms per forward (60 blocks)"
            if isinstance(value, float)
            else value
        )
        print(f"{name:42s} {shown}")


if __name__ == "__main__":
    main()
