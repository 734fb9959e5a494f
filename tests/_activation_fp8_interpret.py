"""The activation-to-FP8 Triton kernel in Triton's interpreter, against its plain-PyTorch references.

Run as a script by ``test_activation_fp8.py`` in a process of its own: ``TRITON_INTERPRET=1`` must be set
before Triton is imported. fp16 and fp32 inputs only (the interpreter's bf16 is not reliable on this
machine). Exits non-zero on the first case out of tolerance; prints one line per case.
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

from bcg_diffusion.kernels import _activation_fp8_triton, activation_fp8  # noqa: E402


def _numpy(function):  # noqa: ANN001, ANN202
    def apply(y: tl.tensor) -> tl.tensor:
        return tl.tensor(TensorHandle(function(y.handle.data), y.handle.dtype), y.type)

    return apply


# The interpreter has no libdevice; numpy's float32 functions stand in for it (the GPU's may differ by an ulp).
_activation_fp8_triton.libdevice = types.SimpleNamespace(tanh=_numpy(np.tanh), exp=_numpy(np.exp))


def case(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    config: tuple[int, int, bool],
    strided: bool,
    swiglu: bool = False,
    head_width: int = 0,
    head_scale: float = 3.0,
) -> None:
    fp8 = torch.float8_e4m3fn
    torch.manual_seed(len(shape) + shape[-1])
    wide = (torch.randn(2, *shape[:-1], shape[-1] + (8 if strided else 0)) * 3).to(dtype)
    # rows with a stride wider than the row (a slice of a wider output)
    hidden, up = wide[0, ..., : shape[-1]], wide[1, ..., : shape[-1]]
    head = (torch.randn(*shape[:-1], head_width + 4) * head_scale).to(dtype)[..., 4:] if head_width else None
    data, scale = activation_fp8._empty(hidden, fp8, head)
    activation_fp8._launch(hidden, data, scale, config, up=up if swiglu else None, head=head)
    if swiglu:
        expected_data, expected_scale = activation_fp8.reference_swiglu_fp8(hidden, up, fp8)
    else:
        expected_data, expected_scale = activation_fp8.reference_gelu_fp8(hidden, fp8, head)
    # The activation's transcendental comes from numpy here and from PyTorch in the reference: where the
    # two differ by an ulp of float32, the rounded activation may differ by one step of the input's dtype.
    torch.testing.assert_close(scale, expected_scale, rtol=2e-3, atol=0, equal_nan=True)
    exact = close_fp8(data, expected_data)
    assert exact > 0.9, exact
    name = "swiglu" if swiglu else f"gelu, head {head_width} x{head_scale}" if head_width else "gelu"
    print(f"{name} {dtype} -> {fp8}, {tuple(shape)}, config {config}, strided {strided}: {exact:.4%} of bytes equal")


def main() -> None:
    for dtype in (torch.float16, torch.float32):
        for swiglu in (False, True):
            case(dtype, (5, 300), (128, 4, False), strided=True, swiglu=swiglu)  # two passes, ragged end
            case(dtype, (5, 300), (512, 4, False), strided=True, swiglu=swiglu)  # one pass, the row masked
            case(dtype, (5, 300), (128, 4, True), strided=True, swiglu=swiglu)  # approximate, two passes
            case(dtype, (5, 300), (16384, 8, True), strided=True, swiglu=swiglu)  # the library's setting
        case(dtype, (2, 3, 64), (2048, 8, False), strided=False)  # one chunk of the row's size
        case(dtype, (4, 200), (64, 2, False), strided=False)
        # a head joined before the GELU (FLUX's single blocks): one pass and two, the largest in either part
        for config in ((512, 4, False), (128, 4, True), (16384, 8, True)):
            case(dtype, (5, 300), config, strided=True, head_width=40, head_scale=9.0)
            case(dtype, (5, 300), config, strided=True, head_width=40, head_scale=0.1)
    # A row of zeros (scale 0, NaN data) is checked on the reference only: the interpreter casts NaN to -384.
    print("all cases within tolerance")


if __name__ == "__main__":
    main()
