"""Process-wide torch settings that change which kernels a forward runs, read as one key per call.

A graph replays the kernels its capture launched. A call made under other global settings would launch
others: under ``torch.autocast`` its products run in bfloat16; with TF32 or reduced-precision reductions
allowed, cuBLAS picks other kernels; an ``sdpa_kernel`` context or the SDP switches pick another
attention; deterministic algorithms swap some kernels for their deterministic twins; a global module hook
(``register_module_forward_hook``) runs code at every module call. None of these is an argument or an
attribute of the model, so :func:`current` reads them all, once per runner call (about 3 µs), and the
runner puts them in the signature: a call under other settings captures graphs of its own (logged at INFO
with what differs, see :func:`differences`) instead of replaying kernels chosen under the old ones.

Each getter is looked up once, when this module is imported, and one missing from the installed torch is
left out (they moved between releases).

>>> key = current()                          # doctest: +SKIP
>>> with torch.autocast("cuda", torch.bfloat16):
...     differences(key, current())          # doctest: +SKIP
['autocast cuda: off -> bfloat16']
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.modules.module as _module

__all__ = ["DEFAULTS", "NAMES", "current", "describe", "differences", "settle"]

logger = logging.getLogger(__name__)


def _autocast(device: str) -> Callable[[], Any]:
    def read() -> Any:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    return read


class _Hooks(tuple):
    """A hook registry's size and last handle id: handle ids only grow, so the pair changes whenever a hook
    is added or removed."""

    def __str__(self) -> str:
        return f"{self[0]} hook(s)"


def _hooks(registry: dict) -> Callable[[], Any]:
    def read() -> Any:
        return _Hooks((len(registry), next(reversed(registry)))) if registry else None

    return read


def _guarded(getter: Callable[[], Any]) -> Callable[[], Any]:
    """``getter``, or "unreadable" where it raises: torch refuses to read its legacy TF32 flags once the old
    and the new precision APIs were both used (the new API's values are read as well, below)."""

    def read() -> Any:
        try:
            return getter()
        except RuntimeError:
            return "unreadable"

    return read


def _getters() -> list[tuple[str, Callable[[], Any]]]:
    c = torch._C
    found: list[tuple[str, Callable[[], Any]]] = [
        ("autocast cpu", _autocast("cpu")),
        ("autocast cuda", _autocast("cuda")),
    ]
    plain = (
        ("TF32 matmul", "_get_cublas_allow_tf32"),
        ("TF32 cuDNN", "_get_cudnn_allow_tf32"),
        ("float32 matmul precision", "_get_float32_matmul_precision"),
        ("fp16 reduced-precision reduction", "_get_cublas_allow_fp16_reduced_precision_reduction"),
        ("bf16 reduced-precision reduction", "_get_cublas_allow_bf16_reduced_precision_reduction"),
        ("fp16 accumulation", "_get_cublas_allow_fp16_accumulation"),
        ("flash SDP", "_get_flash_sdp_enabled"),
        ("memory-efficient SDP", "_get_mem_efficient_sdp_enabled"),
        ("math SDP", "_get_math_sdp_enabled"),
        ("cuDNN SDP", "_get_cudnn_sdp_enabled"),
        ("math SDP fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction"),
        ("deterministic algorithms", "_get_deterministic_algorithms"),
        ("deterministic algorithms warn only", "_get_deterministic_algorithms_warn_only"),
        ("cuDNN deterministic", "_get_cudnn_deterministic"),
        ("cuDNN benchmark", "_get_cudnn_benchmark"),
        ("cuDNN enabled", "_get_cudnn_enabled"),
    )
    found += [(name, _guarded(getattr(c, getter))) for name, getter in plain if hasattr(c, getter)]
    order = getattr(c, "_get_sdp_priority_order", None)  # what sdpa_kernel(..., set_priority=True) sets
    if order is not None:
        found.append(("SDP priority order", lambda: tuple(order())))
    precision = getattr(c, "_get_fp32_precision_getter", None)
    if precision is not None:
        for backend, op in (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul")):
            try:
                precision(backend, op)
            except RuntimeError:
                continue
            found.append((f"fp32 precision {backend} {op}", lambda b=backend, o=op: precision(b, o)))
    found.append(("global module forward hooks", _hooks(_module._global_forward_hooks)))
    found.append(("global module forward pre-hooks", _hooks(_module._global_forward_pre_hooks)))
    return found


_GETTERS = _getters()
NAMES: tuple[str, ...] = tuple(name for name, _ in _GETTERS)
_READ = tuple(getter for _, getter in _GETTERS)


def current() -> tuple[Any, ...]:
    """The settings now, one value per name in :data:`NAMES` (hashable: part of a signature)."""
    return tuple([read() for read in _READ])


DEFAULTS = current()  # as the process found them when bcg_diffusion was imported: what describe() leaves out


def _shown(value: Any) -> str:
    if value is None:
        return "off"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def differences(old: tuple[Any, ...], new: tuple[Any, ...]) -> list[str]:
    """``"name: old -> new"`` for every setting that differs between two keys of :func:`current`."""
    return [f"{name}: {_shown(a)} -> {_shown(b)}" for name, a, b in zip(NAMES, old, new) if a != b]


def describe(key: tuple[Any, ...]) -> str:
    """The settings of ``key`` that differ from what the process started with ("" when none do)."""
    return ", ".join(f"{name} {_shown(b)}" for name, a, b in zip(NAMES, DEFAULTS, key) if a != b)


def settle(device: torch.device) -> None:
    """Make now the changes to these settings that PyTorch makes lazily at its first kernels on ``device``, so
    that the key a pipeline's first call reads is the key its later calls read.

    PyTorch's first scaled-dot-product attention on a Hopper GPU puts cuDNN's kernel first in SDPA's priority
    order (H100, torch 2.11: ``(1, 2, 0, 3, 4)`` -> ``(3, 1, 2, 0, 4)``, runs 169-170). A component called before
    any attention ran (Z-Image's text encoder, in a fresh process) was keyed under the old order, and captured
    again at the pipeline's next call. One small attention call here makes the change first. Nothing on other
    devices; a failure is logged and only costs that one capture.
    """
    if device.type != "cuda":
        return
    try:
        with torch.no_grad():
            query = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16, device=device)
            F.scaled_dot_product_attention(query, query, query)
    except RuntimeError as error:  # the user's settings may allow no kernel for it (deterministic algorithms)
        logger.info(
            "settling torch's lazy SDPA settings on %s failed (%s); a first call may capture twice", device, error
        )
