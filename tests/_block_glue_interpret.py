"""The block-glue Triton kernel in Triton's interpreter, against its plain-PyTorch references.

Run as a script by ``test_block_glue.py`` in a process of its own: ``TRITON_INTERPRET=1`` must be set before
Triton is imported. fp16 only (the interpreter's bf16 is not reliable on this machine). Exits non-zero on the
first case out of tolerance; prints one line per case.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import types  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402 - after the environment Triton reads on import
import triton.language as tl  # noqa: E402
from _fp8_interpret import close_fp8  # noqa: E402
from triton.runtime.interpreter import TensorHandle  # noqa: E402

from bcg_diffusion.kernels import _block_glue_triton, block_glue  # noqa: E402


def _numpy(function):  # noqa: ANN001, ANN202
    def apply(y: tl.tensor) -> tl.tensor:
        return tl.tensor(TensorHandle(function(y.handle.data).astype(np.float32), y.handle.dtype), y.type)

    return apply


# The interpreter has no libdevice; numpy's float32 functions stand in for it (the GPU's may differ by an ulp).
_block_glue_triton.libdevice = types.SimpleNamespace(tanh=_numpy(np.tanh), rsqrt=_numpy(lambda v: 1 / np.sqrt(v)))

FP8 = torch.float8_e4m3fn


def case(shape: tuple[int, int, int], config: tuple[int, int, bool], strided: bool) -> None:
    """Z-Image's three passes."""
    dtype = torch.float16
    batch, tokens, width = shape
    torch.manual_seed(sum(shape))
    pad = 8 if strided else 0
    x, branch = ((torch.randn(batch, tokens, width + pad) * 2).to(dtype)[..., :width] for _ in range(2))
    weights = [(1 + 0.1 * torch.randn(width)).to(dtype) for _ in range(2)]
    modulation = (0.5 * torch.randn(batch, 4 * width)).to(dtype)  # gate and scale: rows of one product
    gate, scale = modulation[:, :width], modulation[:, 2 * width : 3 * width]
    zimage = block_glue._ZIMAGE

    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, zimage, weight=weights[0], eps=1e-5, scale=scale, data=data, scales=scales, config=config)
    want_data, want_scales = block_glue.reference_modulated_norm_fp8(x, weights[0], 1e-5, scale, FP8)
    torch.testing.assert_close(scales, want_scales, rtol=2e-3, atol=0)
    equal = [close_fp8(data, want_data)]

    stream = torch.empty(x.shape, dtype=dtype)
    block_glue._launch(x, zimage, branch=branch, branch_weight=weights[1], branch_eps=1e-6, gate=gate, stream=stream,
                       config=config)  # fmt: skip
    want_stream = block_glue.reference_gated_residual(x, branch, weights[1], 1e-6, gate)
    torch.testing.assert_close(stream, want_stream, rtol=2e-3, atol=2e-3)
    equal.append((stream == want_stream).float().mean().item())

    stream = torch.empty(x.shape, dtype=dtype)
    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, zimage, branch=branch, branch_weight=weights[1], branch_eps=1e-6, gate=gate, stream=stream,
                       weight=weights[0], eps=1e-5, scale=scale, data=data, scales=scales, config=config)  # fmt: skip
    want = block_glue.reference_gated_residual_fp8(x, branch, weights[1], 1e-6, gate, weights[0], 1e-5, scale, FP8)
    torch.testing.assert_close(stream, want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(scales, want[2], rtol=5e-3, atol=0)
    equal.append(close_fp8(data, want[1]))
    assert min(equal) > 0.9, equal
    print(f"Z-Image {shape}, config {config}, strided {strided}: {', '.join(f'{e:.4%}' for e in equal)} equal")


def qwen_case(shape: tuple[int, int, int], config: tuple[int, int, bool], strided: bool) -> None:
    """Qwen-Image's three passes: LayerNorm without weight, a shift, a plain gate."""
    dtype = torch.float16
    batch, tokens, width = shape
    torch.manual_seed(sum(shape) + 1)
    pad = 8 if strided else 0
    # an offset on x: the LayerNorm's mean is not zero
    x, branch = ((torch.randn(batch, tokens, width + pad) * 2 + 1).to(dtype)[..., :width] for _ in range(2))
    modulation = (0.5 * torch.randn(batch, 6 * width)).to(dtype)  # shift, scale, gate (twice): one product's rows
    shift, scale, gate = (modulation[:, i * width : (i + 1) * width] for i in range(3))
    qwen = block_glue._QWEN

    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, qwen, eps=1e-6, scale=scale, shift=shift, data=data, scales=scales, config=config)
    want_data, want_scales = block_glue.reference_modulated_layer_norm_fp8(x, 1e-6, scale, shift, FP8)
    torch.testing.assert_close(scales, want_scales, rtol=2e-3, atol=0)
    equal = [close_fp8(data, want_data)]

    stream = torch.empty(x.shape, dtype=dtype)
    block_glue._launch(x, qwen, branch=branch, gate=gate, stream=stream, config=config)
    want_stream = block_glue.reference_gated_add(x, branch, gate)
    torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)  # one product, one sum: PyTorch's roundings
    equal.append((stream == want_stream).float().mean().item())

    stream = torch.empty(x.shape, dtype=dtype)
    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, qwen, branch=branch, gate=gate, stream=stream, eps=1e-6, scale=scale, shift=shift,
                       data=data, scales=scales, config=config)  # fmt: skip
    want = block_glue.reference_gated_add_layer_norm_fp8(x, branch, gate, 1e-6, scale, shift, FP8)
    torch.testing.assert_close(stream, want[0], rtol=0, atol=0)
    torch.testing.assert_close(scales, want[2], rtol=5e-3, atol=0)
    equal.append(close_fp8(data, want[1]))
    assert min(equal) > 0.9, equal
    print(f"Qwen-Image {shape}, config {config}, strided {strided}: {', '.join(f'{e:.4%}' for e in equal)} equal")


def qwen_per_token_case(shape: tuple[int, int, int], config: tuple[int, int, bool]) -> None:
    """Qwen-Image-Edit-2511's per-token modulation (``zero_cond_t``): each token's shift, scale and gate from
    its batch row's first or second set, as its index says (the reference image's tokens: the second)."""
    dtype = torch.float16
    batch, tokens, width = shape
    torch.manual_seed(sum(shape) + 2)
    x, branch = ((torch.randn(batch, tokens, width) * 2 + 1).to(dtype) for _ in range(2))
    modulation = (0.5 * torch.randn(2 * batch, 6 * width)).to(dtype)
    shift, scale, gate = (modulation[:, i * width : (i + 1) * width] for i in range(3))
    index = torch.zeros(batch, tokens, dtype=torch.int32)
    index[:, tokens // 2 :] = 1
    index[-1, 0] = 1  # any pattern, not only a split
    qwen = block_glue._QWEN

    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, qwen, eps=1e-6, scale=scale, shift=shift, data=data, scales=scales, index=index,
                       config=config)  # fmt: skip
    want_data, want_scales = block_glue.reference_modulated_layer_norm_fp8(x, 1e-6, scale, shift, FP8, index)
    torch.testing.assert_close(scales, want_scales, rtol=2e-3, atol=0)
    equal = [close_fp8(data, want_data)]

    stream = torch.empty(x.shape, dtype=dtype)
    block_glue._launch(x, qwen, branch=branch, gate=gate, stream=stream, index=index, config=config)
    torch.testing.assert_close(stream, block_glue.reference_gated_add(x, branch, gate, index), rtol=0, atol=0)

    stream = torch.empty(x.shape, dtype=dtype)
    data, scales = block_glue._fp8_empty(x, FP8)
    block_glue._launch(x, qwen, branch=branch, gate=gate, stream=stream, eps=1e-6, scale=scale, shift=shift,
                       data=data, scales=scales, index=index, config=config)  # fmt: skip
    want = block_glue.reference_gated_add_layer_norm_fp8(x, branch, gate, 1e-6, scale, shift, FP8, index)
    torch.testing.assert_close(stream, want[0], rtol=0, atol=0)
    torch.testing.assert_close(scales, want[2], rtol=5e-3, atol=0)
    equal.append(close_fp8(data, want[1]))
    assert min(equal) > 0.9, equal
    print(f"Qwen-Image per token {shape}, config {config}: {', '.join(f'{e:.4%}' for e in equal)} equal")


def main() -> None:
    case((1, 5, 96), (1, 4, False), strided=False)
    case((2, 3, 100), (2, 4, True), strided=True)  # a ragged width, two rows per program past the end
    case((2, 7, 64), (4, 8, True), strided=True)  # the batch's modulation rows per token
    qwen_case((1, 5, 96), (1, 4, False), strided=False)
    qwen_case((2, 3, 100), (2, 4, True), strided=True)  # the LayerNorm's mean over a ragged width
    qwen_case((2, 7, 64), (4, 8, True), strided=True)
    qwen_per_token_case((2, 6, 96), (1, 4, True))
    qwen_per_token_case((2, 7, 64), (4, 8, True))  # rows of a program across a batch row's end
    print("all cases within tolerance")


if __name__ == "__main__":
    main()
