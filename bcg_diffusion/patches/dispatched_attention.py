"""Our attention kernels for every model whose attention processors call diffusers' attention dispatcher.

Diffusers' transformers share one way to attend: a processor projects the query, key and value, then
calls ``dispatch_attention_fn(query, key, value, attn_mask=..., backend=..., parallel_config=...)`` on
``[B, S, H, D]`` tensors (FLUX.1, FLUX.2, Wan, Qwen-Image, HunyuanImage, LTX...). Fast mode's
``attention="fp8"`` and ``attention="fa4"`` plug in there: each such processor of the accelerated
transformer gets a ``__call__`` that is diffusers' own code, except that the name ``dispatch_attention_fn``
resolves to :func:`kernel_dispatch`'s function for the kernel chosen for that module. That function sends a
plain call (no dropout, causality, head grouping, backend or parallel config of the user's, diffusers'
default backend active) whose tensors the kernel takes to it, and every other call to diffusers'
dispatcher unchanged: a parallel call keeps PyTorch's attention. A plain call may carry a mask that hides
keys only (a prompt's padding: HunyuanImage, HunyuanVideo); cuDNN's FP8 kernel and FlashAttention-4
take it as key counts (:mod:`bcg_diffusion.kernels.key_padding`), and any other mask keeps PyTorch's attention.
Our Triton FP8 kernel leaves masked calls to PyTorch: given key lengths, it made HunyuanImage 2.1's step 7%
slower than PyTorch's bf16 attention (H100, run 220): what surrounds the kernel cost more than it saved.

Why not the processors' own code: nothing model-specific is needed to reach the kernel, so a new model
gets these kernels without a patch of ours. Why not diffusers' backend registry (a backend of our own,
``set_attention_backend``): that setting is the user's and process-wide, and the registry's backends
are checked against masks and shapes differently per release; scoping to one model's processors keeps
every other model (and an exact-mode pipeline in the same process) on diffusers' arithmetic.

Without either option, bf16 attention needs nothing of this: PyTorch 2.11's SDPA already runs cuDNN's
kernel for these calls on Hopper (612 TFLOP/s against flash's 352 at Qwen-Image's 1024² shapes, run 83),
which is where the model-specific processors' own cuDNN call was measured no faster than diffusers' dispatch.

The kernel is a property of the processor's class (one subclass per original class and kernel), so
the check of the Python state a graph read sees a processor replaced or its kernel changed. The
processors Qwen-Image's and Z-Image's fast mode rewrites (:mod:`bcg_diffusion.patches.attention`, named in
:data:`OWN_PROCESSORS`) reach the same kernels through ``attend`` and are left to it.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn as _diffusers_dispatch

from ..core.hooks import MethodPatches
from ..kernels import attention as triton_kernels
from ..kernels import cudnn_fp8_attention, fa4_attention, key_padding
from .attention import _default_backend_active, fp8_prologue_chosen
from .scoped import _with_globals

__all__ = [
    "DISPATCH_NAME",
    "DISPATCHED_KERNELS",
    "FP8_KERNELS",
    "KERNEL_OF_CLASS",
    "OWN_PROCESSORS",
    "attention_modules",
    "dispatches_attention",
    "fp8_prologue_wanted",
    "install",
    "kernel_dispatch",
    "own_processor",
    "sends_to_cudnn_fp8",
]

DISPATCH_NAME = "dispatch_attention_fn"
# Our names of the FP8 kernels (as ``patches.attention.KERNELS`` spells them): ours in Triton, cuDNN's.
FP8_KERNELS = ("fp8", "cudnn-fp8")
# Every kernel a scoped processor can send plain calls to: the FP8 ones and FlashAttention-4's bf16 one.
DISPATCHED_KERNELS = (*FP8_KERNELS, "fa4")
# The kernels that take a mask hiding keys only, as the count of keys each batch row sees (not our Triton FP8
# kernel: measured slower than PyTorch's attention there, see the module's docstring).
KEY_LENGTH_KERNELS = ("cudnn-fp8", "fa4")
# The processors whose fast-mode ``__call__`` routes attention through ``patches.attention.attend``; every
# other processor that calls diffusers' dispatcher goes through this module.
OWN_PROCESSORS = ("QwenDoubleStreamAttnProcessor2_0", "ZSingleStreamAttnProcessor")
# Set on each scoped processor class: the kernel its dispatch sends plain calls to.
KERNEL_OF_CLASS = "_bcg_dispatch_kernel"


def dispatches_attention(processor: Any) -> bool:
    """Whether ``processor`` (an attention processor object) attends through diffusers' dispatcher in its
    own ``__call__``: the name ``dispatch_attention_fn`` appears in its code and resolves there to
    diffusers' function. Helpers the processor calls that dispatch in turn (Flux2's key-value cache
    processors) are not seen, and those calls keep PyTorch's attention."""
    call = inspect.getattr_static(type(processor), "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None or DISPATCH_NAME not in code.co_names:
        return False
    return call.__globals__.get(DISPATCH_NAME) is _diffusers_dispatch


def sends_to_cudnn_fp8(processor: Any) -> bool:
    """Whether ``processor``'s class sends its plain calls to cuDNN's FP8 kernel (``attention="fp8"`` on cuDNN,
    :func:`install`)."""
    return getattr(type(processor), KERNEL_OF_CLASS, None) == "cudnn-fp8"


def fp8_prologue_wanted(processor: Any, attn: torch.nn.Module, attention_mask: torch.Tensor | None) -> bool:
    """Whether a processor's own prologue should hand cuDNN's FP8 attention its query and key quantized
    at their norms' bounds: the processor's class sends plain calls to that kernel (:func:`install`), this
    call is plain (no mask, backend or parallel config, diffusers' default backend active), and the module
    has not chosen otherwise (``features.fp8_attention.choose_prologue``). Raises ValueError for a choice
    that is not a bool."""
    return (
        fp8_prologue_chosen(attn)
        and sends_to_cudnn_fp8(processor)
        and attention_mask is None
        and processor._attention_backend is None
        and processor._parallel_config is None
        and _default_backend_active()
    )


def own_processor(module: torch.nn.Module) -> bool:
    """Whether ``module``'s processor is one of fast mode's own (:data:`OWN_PROCESSORS`)."""
    return type(module.__dict__.get("processor")).__name__ in OWN_PROCESSORS


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` whose kernel fast mode can choose: those with one of fast mode's own
    processors (through ``patches.attention.attend``), and those whose processor :func:`dispatches_attention`."""
    found = []
    for module in model.modules():
        processor = module.__dict__.get("processor")
        if processor is None:
            continue
        if own_processor(module) or dispatches_attention(processor):
            found.append(module)
    return found


def _dispatch(
    kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: Any
) -> torch.Tensor:
    """``dispatch_attention_fn(query, key, value, **options)`` with plain calls through ``kernel`` where it takes
    the tensors and the mask."""
    mask = options.get("attn_mask")
    if _plain(**options) and _unsupported(kernel)(query, key, value) is None:
        scale = options.get("scale")
        if mask is None:
            return _attend(kernel, query, key, value, scale)
        visible = key_padding.visible_keys(mask, key) if kernel in KEY_LENGTH_KERNELS else None
        if visible is not None:
            key, value, lengths = key_padding.visible_first(key, value, visible)
            return _attend(kernel, query, key, value, scale, lengths)
    return _diffusers_dispatch(query, key, value, **options)


def _unsupported(kernel: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], str | None]:
    """``kernel``'s check of the ``[B, S, H, D]`` tensors it takes (tensor properties only, decided when a
    compiled block is traced)."""
    if kernel == "fp8":
        return triton_kernels.unsupported
    return cudnn_fp8_attention.unsupported if kernel == "cudnn-fp8" else fa4_attention.unsupported


def _attend(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernel`` on tensors it takes; ``key_lengths`` only for :data:`KEY_LENGTH_KERNELS`."""
    if kernel == "fp8":
        return triton_kernels.fp8_attention(query, key, value, scale=scale)
    if kernel == "cudnn-fp8":
        return cudnn_fp8_attention.attention(query, key, value, scale=scale, key_lengths=key_lengths)
    return fa4_attention.attention(query, key, value, scale=scale, key_lengths=key_lengths)


def _plain(
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **rest: Any,
) -> bool:
    """A call our kernels compute as diffusers would, but for its mask (:func:`_dispatch` decides on that): no
    dropout, causality or head grouping, and no attention kwargs, backend, parallel config or other option of
    the caller's, under diffusers' default backend."""
    return (
        dropout_p == 0.0
        and not is_causal
        and not enable_gqa
        and all(value is None or value == {} for value in rest.values())
        and _default_backend_active()
    )


# Module-level functions, not closures: dynamo guards a global function the compiled code reads through the
# function's module, and would look for a closure's cells on diffusers' own dispatch_attention_fn.
def _dispatch_fp8(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **options: Any) -> Any:
    return _dispatch("fp8", query, key, value, **_named(args), **options)


def _dispatch_cudnn_fp8(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **options: Any
) -> Any:
    return _dispatch("cudnn-fp8", query, key, value, **_named(args), **options)


def _dispatch_fa4(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **options: Any) -> Any:
    return _dispatch("fa4", query, key, value, **_named(args), **options)


_POSITIONAL = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "attention_kwargs")


def _named(args: tuple[Any, ...]) -> dict[str, Any]:
    """``dispatch_attention_fn``'s positional arguments after the value, by name."""
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"dispatch_attention_fn takes at most {3 + len(_POSITIONAL)} positional arguments")
    return dict(zip(_POSITIONAL, args))


_DISPATCH = {"fp8": _dispatch_fp8, "cudnn-fp8": _dispatch_cudnn_fp8, "fa4": _dispatch_fa4}


def kernel_dispatch(kernel: str) -> Callable[..., torch.Tensor]:
    """A function with ``dispatch_attention_fn``'s contract that runs plain calls through ``kernel`` (one of
    :data:`DISPATCHED_KERNELS`) where it takes the tensors, and every other call through diffusers' dispatcher.

    Raises ValueError for another kernel name.

    >>> kernel_dispatch("fp8")(q, k, v)  # doctest: +SKIP
    """
    if kernel not in _DISPATCH:
        raise ValueError(f"attention kernel {kernel!r}: expected one of {DISPATCHED_KERNELS}")
    return _DISPATCH[kernel]


@functools.cache
def _scoped_class(cls: type, kernel: str) -> type:
    """``cls`` with a ``__call__`` whose ``dispatch_attention_fn`` is :func:`kernel_dispatch` of ``kernel``."""
    call = _with_globals(cls.__call__, {DISPATCH_NAME: kernel_dispatch(kernel)})
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__, KERNEL_OF_CLASS: kernel})


def install(
    modules: list[torch.nn.Module], kernel_of: Callable[[torch.nn.Module], str], patches: MethodPatches
) -> None:
    """Give each attention module in ``modules`` (each holding a processor that
    :func:`dispatches_attention`) a copy of its processor whose dispatch runs ``kernel_of(module)``;
    recorded in ``patches``, so ``restore`` gives the original processors back."""
    for module in modules:
        processor = module.__dict__["processor"]
        scoped = copy.copy(processor)
        scoped.__class__ = _scoped_class(type(processor), kernel_of(module))
        patches.replace(module, "processor", scoped)
