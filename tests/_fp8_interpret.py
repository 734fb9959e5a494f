"""The float8 comparison the Triton-interpreter scripts share (``_*_interpret.py``)."""

from __future__ import annotations

import torch


def close_fp8(data: torch.Tensor, expected: torch.Tensor) -> float:
    """Assert float8 ``data`` within one mantissa step of ``expected`` (same shape and dtype); return the
    share of equal bytes, for the caller to bound and print."""
    got, want = data.float(), expected.float()
    bound = torch.maximum(got.abs(), want.abs()) * 2.0**-3 + torch.finfo(data.dtype).tiny
    # The interpreter's float32-to-float8 cast loses the carry when rounding up reaches the next power of
    # two (124.3 becomes 64, not 128; the GPU's cast instruction does not): accept exactly that.
    carried = (want.abs() == torch.exp2(torch.round(torch.log2(want.abs())))) & (got == want / 2)
    assert torch.all(((got - want).abs() <= bound) | carried), (got - want).abs().max()
    return (data.view(torch.uint8) == expected.view(torch.uint8)).float().mean().item()
