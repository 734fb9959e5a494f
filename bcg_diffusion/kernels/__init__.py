"""GPU kernels of our own, for what no maintained package gives on the device we target.

Each module needs Triton, imported only when a kernel is first called or checked for
(:func:`triton_available`), so ``import bcg_diffusion`` stays light and CPU-only installs never touch it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["triton_available", "triton_unavailable"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels, not its CPU ones)."""
    return importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (None: they can): they need Triton and a CUDA GPU.
    Elsewhere each operator computes its plain-PyTorch reference."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA GPU"
    if not triton_available():
        return "Triton is not installed (it comes with PyTorch's CUDA builds)"
    return None
