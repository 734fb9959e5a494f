"""Attention for fast mode: per-prompt joint attention in Qwen-Image's CFG batch; for Z-Image, cuDNN
and RoPE outside autocast.

Fast mode batches Qwen-Image's cond and uncond calls (:mod:`bcg_diffusion.features.cfg_batching`). When the two
prompts differ in length, the batch pads the shorter one and masks it; with a key mask PyTorch's
SDPA takes its cuDNN kernel with the mask as a bias. Each row differs only in how many text tokens are
valid, so the batch can instead attend per prompt over its own valid tokens, without a mask: in a
side-by-side run (H200, run 33, Qwen-Image 512², 10 steps, CFG 4) the denoising loop took 0.689 s
against 0.708 s masked.

Which kernel: PyTorch 2.11's SDPA already takes cuDNN's kernel for these unmasked calls on Hopper
(612–619 TFLOP/s at Qwen-Image's 1024² shapes, flash 352–362; run 83). Diffusers' ``_native_cudnn``
backend first copies the tensors into cuDNN's layout, which the kernel does not need: on the
``[B, S, H, D]`` views as they are it runs as fast (612 against 610 TFLOP/s), so fast mode's Z-Image
processor calls SDPA's cuDNN kernel on them directly (:func:`_cudnn_attention`): one compiled block
714.7 against 759.8 µs at 512², 3026 against 3068 µs at 1024² (run 83). Qwen-Image's processors keep
diffusers' dispatch, which PyTorch sends to the same kernel.

The kernel of each attention module can be chosen (:data:`KERNEL_ATTRIBUTE`, :func:`attend`): the FP8
kernels, cuDNN's (:mod:`bcg_diffusion.kernels.cudnn_fp8_attention`, fed bounds on the query's and key's
magnitudes from their RMS norms) and ours (:mod:`bcg_diffusion.kernels.attention`), are the opt-in of
:mod:`bcg_diffusion.features.fp8_attention`; FlashAttention-4's bf16 kernel
(:mod:`bcg_diffusion.kernels.fa4_attention`) that of :mod:`bcg_diffusion.features.fa4_attention`.

Attention's prologue (the query and key RMS norms, RoPE, Qwen-Image's joint text-and-image tensors)
is inductor's compiled code, or, per attention module (:data:`QK_PROLOGUE_ATTRIBUTE`, default
:data:`QK_PROLOGUE_DEFAULT`), one launch of our fused kernel (:mod:`bcg_diffusion.kernels.qk_prologue`),
whose output each group of a CFG batch attends over as slices, with no concatenation. With cuDNN's FP8
attention, that launch writes the query and key in float8 itself and reduces the value's largest
magnitude (:data:`FP8_PROLOGUE_ATTRIBUTE` turns it off).

The image stream's output projection then runs on each group's rows where they lie, each product
written into its rows of one output (:mod:`bcg_diffusion.patches.stacked_output`), instead of on the
groups' rows joined by a copy. Where the output projection (Qwen-Image's image stream's, Z-Image's) is
an FP8 linear and attention is cuDNN's FP8 kernel fed by the prologue, it takes attention's float8 output
as it is (:mod:`bcg_diffusion.patches.fp8_output_projection`).

All of this changes rounding only (another kernel, no padded keys to skip), which is why it is fast
mode's, scoped to the accelerated model (:mod:`bcg_diffusion.patches.scoped`). cuDNN is used on
compute capability 9.0 and newer only (where it was measured), with cuDNN attention enabled in
PyTorch (``torch.backends.cuda.enable_cudnn_sdp``).

Z-Image's processor is ours in fast mode, with or without cuDNN (:func:`_zimage_attention_call`):
diffusers' computation, except that its RoPE no longer enters a no-op ``autocast`` context, which
kept PyTorch's AOT autograd cache from storing the compiled blocks (see :func:`_rotate_complex`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.attention_dispatch import dispatch_attention_fn as _diffusers_dispatch

from ..kernels import attention as kernels
from ..kernels import cudnn_fp8_attention, fa4_attention, qk_prologue, triton_available, untested_triton
from . import fp8_output_projection, stacked_output
from .fp8_feed_forward import Fp8Rows, linear_on_fp8
from .rope import rotate_pairs
from .scoped import ProcessorPatch

__all__ = [
    "QK_PROLOGUE_ATTRIBUTE",
    "QK_PROLOGUE_DEFAULT",
    "QWEN_ATTENTION_PATCH",
    "TEXT_LENGTHS_KWARG",
    "ZIMAGE_ATTENTION_PATCH",
    "ZIMAGE_ROPE_PATCH",
    "FP8_PROLOGUE_ATTRIBUTE",
    "FUSED_QKV_ATTRIBUTE",
    "FUSED_QKV_PROCESSORS",
    "TAKES_FP8_ROWS",
    "choose_qk_prologue",
    "cudnn_attention_unsupported",
    "fp8_prologue_chosen",
    "dispatch_attention_fn",
    "qwen_joint_attention_per_group",
    "qwen_joint_projections",
    "qwen_per_group_lengths",
]

# The attention keyword argument through which fast mode's CFG batcher tells Qwen-Image's processors
# how many text tokens each group of rows has (see ``qwen_joint_attention_per_group``).
TEXT_LENGTHS_KWARG = "bcg_text_lengths"

_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
_CUDNN_MAX_HEAD_DIM = 128  # what was measured; cuDNN's limits depend on its version and the GPU


def cudnn_attention_unsupported(model: torch.nn.Module) -> str | None:
    """Why fast mode's cuDNN attention is not used for ``model`` (None: it is).

    Needs the model on a CUDA GPU of compute capability 9.0 or newer (Hopper, where cuDNN's kernel was
    measured faster than flash) with cuDNN attention enabled in PyTorch.
    """
    if not hasattr(AttentionBackendName, "_NATIVE_CUDNN"):
        return "this diffusers has no _native_cudnn attention backend"
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cuda":
        return "the model is not on a CUDA GPU"
    if torch.cuda.get_device_capability(parameter.device) < (9, 0):
        return "cuDNN attention was measured faster than flash on compute capability 9.0 and newer only"
    if not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()):
        return "cuDNN attention is not available or is turned off in PyTorch"
    return None


def _cudnn_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Tensors ``[B, S, H, D]`` that cuDNN's kernel takes as measured: CUDA, half precision, one head
    count, head size a multiple of 8 up to 128; and deterministic algorithms off, as PyTorch refuses
    cuDNN attention under them ("No available kernel"), where SDPA's own choice serves."""
    head_dim = query.shape[-1]
    return (
        # Read at trace time; dynamo's guards on the global state recompile when it changes. Warn-only
        # mode is not told apart: dynamo cannot trace its getter, and SDPA's choice is right either way.
        not torch.are_deterministic_algorithms_enabled()
        and query.is_cuda
        and query.dim() == 4
        and query.dtype in _CUDNN_DTYPES
        and query.dtype == key.dtype == value.dtype
        and query.shape[2] == key.shape[2] == value.shape[2]
        and head_dim == key.shape[-1] == value.shape[-1]
        and head_dim % 8 == 0
        and head_dim <= _CUDNN_MAX_HEAD_DIM
    )


def dispatch_attention_fn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """Same contract as diffusers' function of that name. Plain attention (no mask, dropout, causality,
    head grouping or parallelism, no backend chosen by the user and diffusers' default backend active)
    on tensors cuDNN takes goes to diffusers' ``_native_cudnn`` backend; every other call to diffusers'
    dispatch as it was."""
    if (
        attn_mask is None
        and backend is None
        and parallel_config is None
        and not attention_kwargs
        and dropout_p == 0.0
        and not is_causal
        and not enable_gqa
        and _default_backend_active()
        and _cudnn_fits(query, key, value)
    ):
        backend = AttentionBackendName._NATIVE_CUDNN
    return _diffusers_dispatch(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        attention_kwargs=attention_kwargs,
        backend=backend,
        parallel_config=parallel_config,
    )


def _default_backend_active() -> bool:
    """Whether diffusers' active attention backend is its default, PyTorch's SDPA (a user who chose
    another one, e.g. with ``attention_backend(...)``, keeps it)."""
    return _AttentionBackendRegistry.get_active_backend()[0] == AttentionBackendName.NATIVE


# The attribute on an attention module (diffusers' ``Attention``) naming the kernel fast mode's processors
# use for it (see :func:`attend`), set by :mod:`bcg_diffusion.features.fp8_attention`. A module
# attribute, so that the check of the Python state a graph read sees it change.
KERNEL_ATTRIBUTE = "_bcg_attention_kernel"
# "dispatch": diffusers' dispatch (PyTorch's SDPA picks its kernel); "cudnn": SDPA's cuDNN kernel on
# the [B, S, H, D] tensors as they are; "triton": our Triton kernel; "fp8": our FP8 kernel;
# "cudnn-fp8": cuDNN's FP8 kernel (kernels/cudnn_fp8_attention.py); "fa4": FlashAttention-4's bf16 kernel
# (kernels/fa4_attention.py).
KERNELS = ("dispatch", "cudnn", "triton", "fp8", "cudnn-fp8", "fa4")


def attend(
    attn: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dispatch: Callable[..., torch.Tensor],
    default: str = "dispatch",
    **dispatch_kwargs: Any,
) -> torch.Tensor:
    """Attention without a mask of ``[B, S, H, D]`` tensors through the kernel ``attn`` names in
    :data:`KERNEL_ATTRIBUTE`, else ``default`` (one of :data:`KERNELS`); ``[B, S, H, D]`` out. Through
    ``dispatch(query, key, value, **dispatch_kwargs)`` when that kernel is ``"dispatch"``, the user chose
    an attention backend of diffusers' or a parallel config, or the kernel does not take these tensors
    (dtype, head size, device). Raises ValueError for a kernel name that is not one of :data:`KERNELS`."""
    kernel = _kernel(attn, default, dispatch_kwargs)
    if kernel != "dispatch":
        if kernel == "cudnn" and _cudnn_fits(query, key, value):
            return _cudnn_attention(query, key, value)
        if kernel in ("triton", "fp8") and kernels.unsupported(query, key, value) is None:
            return (kernels.fp8_attention if kernel == "fp8" else kernels.attention)(query, key, value)
        if kernel == "cudnn-fp8" and cudnn_fp8_attention.unsupported(query, key, value) is None:
            return cudnn_fp8_attention.attention(query, key, value, *_query_key_bounds(attn, query.shape[-1]))
        if kernel == "fa4" and fa4_attention.unsupported(query, key, value) is None:
            return fa4_attention.attention(query, key, value)
    return dispatch(query, key, value, **dispatch_kwargs)


def _kernel(attn: torch.nn.Module, default: str, dispatch_kwargs: dict[str, Any]) -> str:
    """The kernel :func:`attend` tries for ``attn``: the one it names (else ``default``), or
    ``"dispatch"`` where the user chose an attention backend of diffusers' or a parallel config."""
    kernel = _choice(attn, KERNEL_ATTRIBUTE, default, KERNELS)
    chosen_elsewhere = any(dispatch_kwargs.get(name) is not None for name in ("backend", "parallel_config"))
    return "dispatch" if chosen_elsewhere or not _default_backend_active() else kernel


def _query_key_bounds(attn: torch.nn.Module, head_dim: int) -> list[torch.Tensor | None]:
    """Bounds on the magnitudes of the query and of the key that fast mode's processors give
    :func:`attend`: RMS-normed (then rotated), so ``cudnn_fp8_attention.rms_norm_bound`` of their norms'
    weights (the text stream's norms too where the module has one, as Qwen-Image's joint tensors do);
    None where a norm is missing or not an RMS norm with a weight."""
    joint = getattr(attn, "add_q_proj", None) is not None
    bounds: list[torch.Tensor | None] = []
    for names in (("norm_q", "norm_added_q"), ("norm_k", "norm_added_k")):
        norms = tuple(getattr(attn, name, None) for name in (names if joint else names[:1]))
        weights = _norm_weights(norms)
        if weights is None or any(norm is None for norm in norms):
            bounds.append(None)
        else:
            bounds.append(cudnn_fp8_attention.rms_norm_bound(weights[0], head_dim))
    return bounds


def _cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """SDPA's cuDNN kernel on ``[B, S, H, D]`` views as ``[B, H, S, D]`` (no copies: cuDNN reads strided
    tensors and writes its output in the query's layout, so the result transposes back for free)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out.transpose(1, 2)


# The attribute on an attention module naming how fast mode's processors compute attention's prologue
# (the query and key RMS norms, RoPE and, for Qwen-Image, the joint text-and-image tensors):
# "compiled": PyTorch operations that inductor compiles (several kernels); "fused": one launch of our
# Triton kernel (:mod:`bcg_diffusion.kernels.qk_prologue`; its plain-PyTorch reference where Triton or a
# GPU is missing). Calls the kernel refuses (see ``qk_prologue.unsupported_joint``) stay "compiled".
# A module attribute, so that the check of the Python state a graph read sees it change.
QK_PROLOGUE_ATTRIBUTE = "_bcg_qk_prologue"
QK_PROLOGUES = ("compiled", "fused")
# What modules without the attribute use: "auto" is "fused" where the Triton kernel runs (a CUDA tensor,
# Triton installed), "compiled" elsewhere (the reference would only add an opaque operator). Measured on an
# H200 (run 87): the prologue alone 80.7 against 248.5 us (Qwen-Image 1024² CFG batch) and 37.5 against
# 174.8 us (Z-Image 1024²); one compiled block 3963 against 4147 us (Qwen-Image 1024² CFG), 2937 against
# 3040 us (Z-Image 1024²), 733.6 against 771.8 us (Z-Image 512²).
QK_PROLOGUE_DEFAULT = "auto"
# The attribute on an attention module saying whether, under cuDNN's FP8 attention, the fused prologue
# writes the query and key in float8 itself (True, the default: ``qk_prologue.joint_qkv_fp8`` and
# ``norm_rope_fp8``) or in bf16, quantized after it (False: the path before it did, kept to compare;
# ``features.fp8_attention.choose_prologue``). A module attribute, so that the check of the Python state
# a graph read sees it change.
FP8_PROLOGUE_ATTRIBUTE = "_bcg_fp8_prologue"
# The submodule of an attention module that projects its query, key and value in one product, where
# :mod:`bcg_diffusion.features.fused_qkv` gave it one, and the processors (by class name) that use it.
FUSED_QKV_ATTRIBUTE = "bcg_to_qkv"  # registered: in the state_dict while fused
FUSED_QKV_PROCESSORS = ("ZSingleStreamAttnProcessor",)
# Set on a processor's ``__call__`` that takes its input quantized already (:class:`Fp8Rows`): fast mode's
# Z-Image processor where the module holds the fused FP8 product, and its Qwen-Image processor where it
# attends per group (:func:`qwen_per_group_lengths`).
TAKES_FP8_ROWS = "_bcg_takes_fp8_rows"
_TRITON = triton_available() and untested_triton() is None  # once: compiled code must not trace importlib


def choose_qk_prologue(model: torch.nn.Module, choice: str) -> int:
    """Set how fast mode computes attention's prologue (:data:`QK_PROLOGUE_ATTRIBUTE`: one of
    :data:`QK_PROLOGUES` or ``"auto"``) on every attention module of ``model`` (each module holding a
    processor), before ``accelerate``; returns how many. Raises ValueError for another choice.

    >>> choose_qk_prologue(pipe.transformer, "compiled")  # inductor's kernels, to compare  # doctest: +SKIP
    """
    if choice not in (*QK_PROLOGUES, "auto"):
        raise ValueError(f"attention prologue {choice!r}: expected one of {(*QK_PROLOGUES, 'auto')}")
    modules = [module for module in model.modules() if "processor" in module.__dict__]
    for module in modules:
        setattr(module, QK_PROLOGUE_ATTRIBUTE, choice)
    return len(modules)


def _choice(attn: torch.nn.Module, attribute: str, default: Any, allowed: tuple[Any, ...]) -> Any:
    """``attn``'s ``attribute`` (else ``default``); raises ValueError when it is not one of ``allowed``."""
    choice = getattr(attn, attribute, default)
    if choice not in allowed:
        raise ValueError(f"{type(attn).__name__}.{attribute} is {choice!r}; expected one of {allowed}")
    return choice


def fp8_prologue_chosen(attn: torch.nn.Module) -> bool:
    """``attn``'s :data:`FP8_PROLOGUE_ATTRIBUTE` (True where unset). Raises ValueError for a value that is not
    a bool."""
    choice = getattr(attn, FP8_PROLOGUE_ATTRIBUTE, True)
    if not isinstance(choice, bool):  # not _choice: 1 and 0 are "in (True, False)"
        raise ValueError(f"{type(attn).__name__}.{FP8_PROLOGUE_ATTRIBUTE} is {choice!r}; expected True or False")
    return choice


def _fp8_prologue(attn: torch.nn.Module, default: str, options: dict[str, Any]) -> bool:
    """Whether ``attn``'s fused prologue writes cuDNN's FP8 attention's query and key (its kernel is
    cuDNN's FP8 one, :func:`fp8_prologue_chosen`). Raises ValueError as that function does."""
    return fp8_prologue_chosen(attn) and _kernel(attn, default, options) == "cudnn-fp8"


def _fused_prologue(attn: torch.nn.Module, like: torch.Tensor) -> bool:
    """Whether ``attn``'s prologue runs as the fused kernel, for inputs like ``like``. Raises ValueError
    for a value of :data:`QK_PROLOGUE_ATTRIBUTE` that is not one of :data:`QK_PROLOGUES` or ``"auto"``."""
    choice = _choice(attn, QK_PROLOGUE_ATTRIBUTE, QK_PROLOGUE_DEFAULT, (*QK_PROLOGUES, "auto"))
    if choice == "auto":
        return like.is_cuda and _TRITON
    return choice == "fused"


def _norm_weights(norms: tuple[torch.nn.Module | None, ...]) -> tuple[list[Any], list[float]] | None:
    """The weights and epsilons of query and key norms the fused kernel computes (all diffusers'
    ``RMSNorm`` with a weight and no bias, or all absent: ``([None, ...], [0.0, ...])``); None otherwise."""
    from diffusers.models.normalization import RMSNorm

    if all(norm is None for norm in norms):
        return [None] * len(norms), [0.0] * len(norms)
    if all(
        type(norm) is RMSNorm and norm.weight is not None and getattr(norm, "bias", None) is None for norm in norms
    ):
        return [norm.weight for norm in norms], [float(norm.eps) for norm in norms]
    return None


def _fused_joint_qkv(
    attn: torch.nn.Module,
    image: list[torch.Tensor],
    text: list[torch.Tensor],
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    text_lengths: tuple[int, ...],
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | qk_prologue.Fp8Joint | None:
    """Qwen-Image's joint query, key and value from its projections before the norms, through
    ``qk_prologue.joint_qkv`` (one buffer per tensor; each group's joint tensor a slice of it); with
    ``fp8``, through ``qk_prologue.joint_qkv_fp8``, the query and key quantized for cuDNN's FP8 attention
    by their norms' bounds, except where cuDNN's kernel does not take them or a bound is missing (then
    the bf16 tensors, which :func:`attend` quantizes). None where the kernel does not take them."""
    norms = _norm_weights((attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k))
    freqs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if image_rotary_emb is not None:
        if not all(f.dtype == torch.complex64 for f in image_rotary_emb):
            return None
        freqs = (torch.view_as_real(image_rotary_emb[0]), torch.view_as_real(image_rotary_emb[1]))
    if norms is None or qk_prologue.unsupported_joint(image, text, norms[0], freqs, text_lengths) is not None:
        return None
    bounds = _query_key_bounds(attn, image[0].shape[-1]) if fp8 else [None]
    if any(bound is None for bound in bounds) or cudnn_fp8_attention.unsupported(*image) is not None:
        return qk_prologue.joint_qkv(image, text, norms[0], norms[1], freqs, text_lengths)
    descales = [cudnn_fp8_attention.descale(bound) for bound in bounds]
    return qk_prologue.joint_qkv_fp8(image, text, norms[0], norms[1], freqs, text_lengths, *descales)


def qwen_joint_projections(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor | Fp8Rows,
    encoder_hidden_states: torch.Tensor | Fp8Rows,
    normed: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Qwen-Image's query, key and value ``[B, S, H, D]`` of the image and of the text stream, the
    queries and keys RMS-normed (unless ``normed`` is false), before RoPE: ``([q, k, v] of the image,
    [q, k, v] of the text)``. A stream may come quantized already (:class:`Fp8Rows`, from fast mode's
    Qwen-Image block), for projections with torchao's row-wise FP8 weights."""
    head_dim = attn.inner_dim // attn.heads

    def project(x: torch.Tensor | Fp8Rows, linear: torch.nn.Module, norm: torch.nn.Module | None) -> torch.Tensor:
        x = linear_on_fp8(linear, *x) if isinstance(x, Fp8Rows) else linear(x)
        x = x.unflatten(-1, (-1, head_dim))
        return x if norm is None or not normed else norm(x)

    image = [
        project(hidden_states, attn.to_q, attn.norm_q),
        project(hidden_states, attn.to_k, attn.norm_k),
        project(hidden_states, attn.to_v, None),
    ]
    text = [
        project(encoder_hidden_states, attn.add_q_proj, attn.norm_added_q),
        project(encoder_hidden_states, attn.add_k_proj, attn.norm_added_k),
        project(encoder_hidden_states, attn.add_v_proj, None),
    ]
    return image, text


def _rows(x: torch.Tensor | Fp8Rows | None) -> torch.Tensor | None:
    """A stream's rows: the tensor itself, or the float8 data of one quantized already (same shape)."""
    return x.data if isinstance(x, Fp8Rows) else x


def qwen_joint_attention_per_group(
    processor: Any,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor | Fp8Rows,
    encoder_hidden_states: torch.Tensor | Fp8Rows,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    text_lengths: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's joint attention (``QwenDoubleStreamAttnProcessor2_0``) for a batch whose rows fall
    into ``len(text_lengths)`` equal groups of consecutive rows, group ``g`` having valid text tokens
    ``[0, text_lengths[g])`` and padding after them (fast mode's CFG batch: cond rows, then uncond).

    Computes what the processor computes with that text mask, except that each group attends over
    its own valid tokens without a mask; outputs at padded text positions are zeros (diffusers' are
    values no valid token ever reads). Returns ``(image_output, text_output)`` like the processor.
    Raises ValueError when the batch does not split into those groups or a length exceeds the text.
    Either stream may come quantized already (:class:`Fp8Rows`, see :func:`qwen_joint_projections`).
    """
    image_rows, text_rows = _rows(hidden_states), _rows(encoder_hidden_states)
    batch, text_tokens = text_rows.shape[:2]
    groups = len(text_lengths)
    if groups == 0 or batch % groups or image_rows.shape[0] != batch:
        raise ValueError(f"{groups} text lengths cannot split a batch of {batch} rows into equal groups")
    # Checked eagerly only: compiled, the comparison would guard (and recompile) on which text is the
    # longer one; fast mode's batcher builds the lengths from the very texts it pads.
    if not torch.compiler.is_compiling() and max(text_lengths) > text_tokens:
        raise ValueError(f"text lengths {text_lengths} exceed the {text_tokens} text tokens given")
    fused = _fused_prologue(attn, image_rows)
    image, text = qwen_joint_projections(attn, hidden_states, encoder_hidden_states, normed=not fused)
    options = {"backend": processor._attention_backend, "parallel_config": processor._parallel_config}
    joints = None
    if fused:
        fp8 = _fp8_prologue(attn, "dispatch", options)
        joints = _fused_joint_qkv(attn, image, text, image_rotary_emb, text_lengths, fp8=fp8)
    if fused and joints is None:  # the kernel refuses these tensors: normed as in the compiled path
        for stream, norms in ((image, (attn.norm_q, attn.norm_k)), (text, (attn.norm_added_q, attn.norm_added_k))):
            for index, norm in enumerate(norms):
                if norm is not None:
                    stream[index] = norm(stream[index])
    freqs = None
    if image_rotary_emb is not None:
        freqs = tuple(torch.view_as_real(f) for f in image_rotary_emb)
    rows = batch // groups
    # cuDNN's FP8 output handed to an FP8 image output projection as it is (else scaled back to bf16)
    fp8_output = isinstance(joints, qk_prologue.Fp8Joint) and fp8_output_projection.takes_fp8(attn)
    image_outputs, image_descales, text_outputs = [], [], []
    for group, length in enumerate(text_lengths):
        first, last = group * rows, (group + 1) * rows
        if joints is not None:  # the fused prologue's buffers: this group's valid text, then the image
            query, key, value = (tensor[first:last, text_tokens - length :] for tensor in joints[:3])
        else:
            query, key, value = _compiled_joint(image, text, freqs, first, last, length)
        if isinstance(joints, qk_prologue.Fp8Joint):
            descales, largest = (joints.query_descale, joints.key_descale), joints.value_largest[group]
            if fp8_output:
                out, descale = cudnn_fp8_attention.attention_fp8_output(query, key, *descales, value, largest)
            else:
                out = cudnn_fp8_attention.attention_quantized(query, key, *descales, value, largest)
        else:
            out = attend(attn, query, key, value, _diffusers_dispatch, **options)
        out = out.flatten(2, 3)
        if fp8_output:
            text_out = cudnn_fp8_attention.dequantize(out[:, :length], descale, value.dtype)  # its projection: bf16
            image_descales.extend([descale] * rows)
        else:
            out = out.to(value.dtype)
            text_out = out[:, :length]
        text_outputs.append(F.pad(text_out, (0, 0, 0, text_tokens - length)))
        image_outputs.extend(out[:, length:].unbind(0))  # each batch row's image rows, [S_image, C]
    if fp8_output:
        image_output = fp8_output_projection.project(attn, image_outputs, image_descales, value.dtype)
    else:
        image_output = stacked_output.project_image(attn, image_outputs)
    text_output = attn.to_add_out(torch.cat(text_outputs))
    return image_output, text_output


def _compiled_joint(
    image: list[torch.Tensor],
    text: list[torch.Tensor],
    freqs: tuple[torch.Tensor, torch.Tensor] | None,
    first: int,
    last: int,
    length: int,
) -> list[torch.Tensor]:
    """The joint query, key and value of rows ``[first, last)`` with ``length`` valid text tokens, from
    the normed projections, in PyTorch operations (for inductor to compile)."""
    joint = []
    for index, (text_part, image_part) in enumerate(zip(text, image)):
        text_part, image_part = text_part[first:last, :length], image_part[first:last]
        if index < 2 and freqs is not None:
            # RoPE on each group's slice, as it joins the concatenation, not on the whole batch
            # before: compiled, it then fuses into the copy that builds the joint tensor, and the
            # norm before it stays a one-pass kernel (RoPE's interleaved reads fused into the norm
            # made inductor loop its reduction: 26 us per image query or key at 512², run 35).
            text_part = rotate_pairs(text_part, freqs[1][:length])
            image_part = rotate_pairs(image_part, freqs[0])
        joint.append(torch.cat([text_part, image_part], dim=1))  # joint order as in diffusers: text, image
    return joint


def qwen_per_group_lengths(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    encoder_hidden_states_mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    text_lengths: tuple[int, ...] | None,
) -> tuple[int, ...] | None:
    """The text lengths by which fast mode's Qwen-Image processor attends per group for this call
    (:func:`qwen_joint_attention_per_group`), or None where it runs diffusers' processor instead: with
    ``text_lengths`` from fast mode's CFG batcher; with none, one group of every text token where nothing
    is masked and the module's kernel or prologue is ours. Only types, shapes and module attributes are
    read (a compiled block guards on them)."""
    if encoder_hidden_states is None or attention_mask is not None:
        return None
    if text_lengths is not None:
        return tuple(text_lengths)
    ours = getattr(attn, KERNEL_ATTRIBUTE, "dispatch") != "dispatch" or _fused_prologue(attn, hidden_states)
    if encoder_hidden_states_mask is None and ours:
        # No padding (one prompt, or a CFG batch of texts of one length): one group with every text token
        # valid is the processor's own computation, through the chosen kernel or prologue.
        return (encoder_hidden_states.shape[1],)
    return None


def _qwen_call_with_text_lengths(call: Callable[..., Any]) -> Callable[..., Any]:
    """A ``__call__`` for Qwen-Image's processor that also takes ``bcg_text_lengths``: where
    :func:`qwen_per_group_lengths` gives lengths, the per-group attention above (the text mask then only
    restates those lengths and is not read), its streams possibly quantized already (:class:`Fp8Rows`);
    otherwise the processor's own code."""

    def __call__(
        self: Any,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        bcg_text_lengths: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = qwen_per_group_lengths(
            attn,
            _rows(hidden_states),
            _rows(encoder_hidden_states),
            encoder_hidden_states_mask,
            attention_mask,
            bcg_text_lengths,
        )
        if lengths is None:
            if isinstance(hidden_states, Fp8Rows) or isinstance(encoder_hidden_states, Fp8Rows):
                raise ValueError("diffusers' Qwen-Image processor cannot take an input quantized already")
            return call(
                self,
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        return qwen_joint_attention_per_group(
            self, attn, hidden_states, encoder_hidden_states, image_rotary_emb, lengths
        )

    setattr(__call__, TAKES_FP8_ROWS, True)
    return __call__


QWEN_ATTENTION_PATCH = ProcessorPatch(
    name="qwenimage attention (per prompt in a CFG batch)",
    processor_class="QwenDoubleStreamAttnProcessor2_0",
    wrap_call=_qwen_call_with_text_lengths,
    accepts=(TEXT_LENGTHS_KWARG,),
)


def _rotate_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's RoPE as diffusers writes it (``x`` ``[B, S, H, D]`` viewed as complex pairs, times
    ``freqs_cis`` ``[B, S, D/2]``), but with autocast turned off only when it is on.

    Diffusers wraps the rotation in ``torch.amp.autocast("cuda", enabled=False)`` unconditionally.
    Compiled, that context becomes ``_enter_autocast`` / ``_exit_autocast`` nodes, with which
    PyTorch's AOT autograd cache refuses the graph ("Unsupported call_function target
    _enter_autocast"): every new process then re-traced and re-optimised each compiled block,
    warm caches or not. Without autocast active the context changes nothing, so it is left out.
    """
    if not torch.is_autocast_enabled("cuda"):
        return _complex_rotation(x, freqs_cis)
    with torch.amp.autocast("cuda", enabled=False):
        return _complex_rotation(x, freqs_cis)


def _complex_rotation(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


def _fused_norm_rope(
    attn: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    freqs_cis: torch.Tensor | None,
    fp8_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...] | None:
    """Z-Image's query and key normed and rotated by ``qk_prologue.norm_rope`` (one launch); None where
    the kernel does not take them. With ``fp8_value`` (the value, for cuDNN's FP8 attention): through
    ``qk_prologue.norm_rope_fp8``, ``(query8, key8, query_descale, key_descale, value_largest)``, the query
    and key quantized by their norms' bounds; None where cuDNN's kernel does not take these tensors or a
    bound is missing."""
    norms = _norm_weights((attn.norm_q, attn.norm_k))
    if freqs_cis is not None and freqs_cis.dtype != torch.complex64:
        return None
    freqs = None if freqs_cis is None else torch.view_as_real(freqs_cis)
    if norms is None or qk_prologue.unsupported_norm_rope(query, key, norms[0], freqs) is not None:
        return None
    if fp8_value is None:
        return qk_prologue.norm_rope(query, key, norms[0], norms[1], freqs)
    bounds = _query_key_bounds(attn, query.shape[-1])
    if any(bound is None for bound in bounds) or cudnn_fp8_attention.unsupported(query, key, fp8_value) is not None:
        return None
    descales = [cudnn_fp8_attention.descale(bound) for bound in bounds]
    if qk_prologue.unsupported_norm_rope_fp8(query, key, fp8_value, norms[0], freqs, descales) is not None:
        return None
    query8, key8, largest = qk_prologue.norm_rope_fp8(query, key, fp8_value, norms[0], norms[1], freqs, *descales)
    return query8, key8, *descales, largest


def _zimage_projections(attn: torch.nn.Module, hidden_states: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, ...]:
    """Query, key and value ``[B, S, H, D]``: three views of one product where the module holds a fused
    projection (:data:`FUSED_QKV_ATTRIBUTE`), else the three products. ``hidden_states`` may come
    quantized already (:class:`Fp8Rows`, from fast mode's Z-Image block), for the fused FP8 product only;
    raises ValueError when the module holds none."""
    fused = getattr(attn, FUSED_QKV_ATTRIBUTE, None)
    if isinstance(hidden_states, Fp8Rows):
        if fused is None:
            raise ValueError("an input quantized already needs the fused FP8 query, key and value product")
        return linear_on_fp8(fused, *hidden_states).unflatten(-1, (3, attn.heads, -1)).unbind(-3)
    if fused is not None:
        return fused(hidden_states).unflatten(-1, (3, attn.heads, -1)).unbind(-3)
    return tuple(linear(hidden_states).unflatten(-1, (attn.heads, -1)) for linear in (attn.to_q, attn.to_k, attn.to_v))


def _zimage_attention(
    attn: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    freqs_cis: torch.Tensor | None,
    prologue: bool,
    dispatch: Callable[..., torch.Tensor],
    default: str,
    options: dict[str, Any],
) -> torch.Tensor:
    """Z-Image's attention from its projections ``[B, S, H, D]``: the query and key normed and rotated (by
    the fused prologue where ``prologue`` and the kernel takes them), then masked attention through
    ``dispatch``, unmasked through :func:`attend`. Returns ``[B, S, H, D]``."""
    fused = _fused_norm_rope(attn, query, key, freqs_cis) if prologue else None
    if fused is not None:
        query, key = fused
    else:
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = _rotate_complex(query, freqs_cis), _rotate_complex(key, freqs_cis)
    if attention_mask is None:
        return attend(attn, query, key, value, dispatch, default, **options)
    if attention_mask.ndim == 2:
        attention_mask = attention_mask[:, None, None, :]  # [B, S] -> broadcast over heads and queries
    return dispatch(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False, **options)


def _zimage_attention_call(dispatch: Callable[..., torch.Tensor], default: str) -> Callable[..., torch.Tensor]:
    """A ``__call__`` for Z-Image's ``ZSingleStreamAttnProcessor``: diffusers' computation, with the RoPE
    of :func:`_rotate_complex`; masked attention through ``dispatch``, unmasked through :func:`attend`
    with ``default`` as the kernel where the module names none (with cuDNN's FP8 kernel and the fused
    prologue, the prologue writes the query and key in float8 for it, and an FP8 output projection takes
    its float8 output as it is: :mod:`bcg_diffusion.patches.fp8_output_projection`)."""

    def __call__(
        self: Any,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value = _zimage_projections(attn, hidden_states)
        options = {"backend": self._attention_backend, "parallel_config": self._parallel_config}
        prologue = _fused_prologue(attn, query)
        quantized = None  # cuDNN's FP8 attention: the query and key quantized by the fused prologue
        if prologue and attention_mask is None and _fp8_prologue(attn, default, options):
            quantized = _fused_norm_rope(attn, query, key, freqs_cis, fp8_value=value)
        if quantized is not None:
            query8, key8, *descales, largest = quantized
            if fp8_output_projection.takes_fp8(attn):  # the float8 output as it is, one descale for the batch
                out8, descale = cudnn_fp8_attention.attention_fp8_output(query8, key8, *descales, value, largest)
                rows = out8.flatten(0, 1).flatten(1, 2)  # [B * S, C]
                output = fp8_output_projection.project(attn, [rows], [descale], value.dtype)
                return output.reshape(*out8.shape[:2], -1)
            out = cudnn_fp8_attention.attention_quantized(query8, key8, *descales, value, largest)
        else:
            out = _zimage_attention(
                attn, query, key, value, attention_mask, freqs_cis, prologue, dispatch, default, options
            )
        output = attn.to_out[0](out.flatten(2, 3).to(value.dtype))
        if len(attn.to_out) > 1:
            output = attn.to_out[1](output)  # dropout
        return output

    setattr(__call__, TAKES_FP8_ROWS, True)
    return __call__


ZIMAGE_ATTENTION_PATCH = ProcessorPatch(
    name="zimage attention (cuDNN, RoPE outside autocast)",
    processor_class="ZSingleStreamAttnProcessor",
    wrap_call=lambda call: _zimage_attention_call(dispatch_attention_fn, default="cudnn"),
    condition=cudnn_attention_unsupported,
)
# Where cuDNN's attention is not used: the same processor with diffusers' dispatch (exactly one of the
# two applies to a model).
ZIMAGE_ROPE_PATCH = ProcessorPatch(
    name="zimage attention (RoPE outside autocast)",
    processor_class="ZSingleStreamAttnProcessor",
    wrap_call=lambda call: _zimage_attention_call(_diffusers_dispatch, default="dispatch"),
    condition=lambda model: None if cudnn_attention_unsupported(model) else "the cuDNN patch applies instead",
)
