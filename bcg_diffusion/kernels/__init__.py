"""GPU kernels of our own, for what no maintained package gives on the device we target.

Each module needs Triton, imported only when a kernel is first called or checked for
(:func:`triton_available`), so ``import bcg_diffusion`` stays light and CPU-only installs never touch it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["TESTED_TRITON", "triton_available", "triton_unavailable", "untested_triton"]

# The Triton releases (major.minor) our kernels were compiled, run and measured with (on the GPU machine, and
# in Triton's interpreter on the CPU). Another release keeps fast mode on inductor's kernels, with a warning;
# BCG_UNTESTED_TRITON=1 runs ours anyway.
TESTED_TRITON = ("3.6",)


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels, not its CPU ones)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def untested_triton() -> str | None:
    """Why the installed Triton is not one our kernels were tested with (None: it is, or the user said to run
    them anyway, or Triton is not installed)."""
    if not triton_available() or os.environ.get("BCG_UNTESTED_TRITON") == "1":
        return None
    version = importlib.metadata.version("triton")
    if ".".join(version.split(".")[:2]) in TESTED_TRITON:
        return None
    return (
        f"Triton {version} is not a release bcg-diffusion's kernels were tested with ({', '.join(TESTED_TRITON)}): "
        "fast mode keeps inductor's kernels instead (BCG_UNTESTED_TRITON=1 runs ours anyway)"
    )


def triton_unavailable(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (None: they can): they need Triton, a release they were
    tested with (:func:`untested_triton`, which warns once here) and a CUDA GPU. Elsewhere each operator
    computes its plain-PyTorch reference."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA GPU"
    if not triton_available():
        return "Triton is not installed (it comes with PyTorch's CUDA builds)"
    reason = untested_triton()
    if reason is not None and not _WARNED:
        from ..core.runner import BCGWarning

        _WARNED.append(reason)
        warnings.warn(f"bcg-diffusion: {reason}", BCGWarning, stacklevel=3)
    return reason


_WARNED: list[str] = []  # the untested Triton's reason, once warned about
