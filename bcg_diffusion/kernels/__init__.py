"""GPU kernels of our own, for what no maintained package gives on the device we target.

Each module needs Triton, imported only when a kernel is first called or checked for
(:func:`triton_available`), so ``import bcg_diffusion`` stays light and CPU-only installs never touch it.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels, not its CPU ones)."""
    return importlib.util.find_spec("triton") is not None
